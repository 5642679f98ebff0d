"""Verify the heldout9 set: correct implementations against torchao 0.18 (bitwise)
or the float64 blockwise emulation (within an accumulation bound), and every
planted bug against its twin on a case built from its trigger, then with each
trigger token removed.

    OMP_NUM_THREADS=2 /work/main/.venv/bin/python property_tests/heldout9/verify.py
"""
import importlib.util
import inspect
import json
import math
import sys
import time
import traceback
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent  # /work/main
torch.set_num_threads(2)

DT = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}


# --------------------------------------------------------------------------- cases
@dataclass(frozen=True)
class Case:
    dtype: str = "bf16"        # input dtype
    wdtype: str = ""           # weight dtype ("" = same as input)
    bias: bool = False
    nd: bool = False           # 3-D input (2 x M/2 x K)
    x_layout: str = "C"        # C contiguous, T transposed storage, S strided slice
    w_layout: str = "C"
    go_layout: str = "C"
    kn: bool = False           # K == N
    data: str = "normal"
    steps: int = 1             # 2 = call, w.mul_(3).add_(0.01), call again
    seed: int = 0
    blockwise: bool = False
    bare: bool = False         # converter given a bare nn.Linear instead of a container

    def dims(self):
        if self.blockwise:
            m, k, n = 128, 256, 128
            if self.kn:
                k = n = 256
        else:
            m, k, n = 32, 48, 64
            if self.kn:
                k = n = 64
        return m, k, n

    def cid(self):
        parts = [self.dtype + ("/w" + self.wdtype if self.wdtype else ""), "bias" if self.bias else "nobias",
                 "3d" if self.nd else "2d", "in:" + self.x_layout, "w:" + self.w_layout,
                 "go:" + self.go_layout, "K==N" if self.kn else "", self.data,
                 "steps2" if self.steps == 2 else "", "bare" if self.bare else ""]
        return "|".join(p for p in parts if p)


def _layout(t, how):
    """Same logical values, other storage."""
    if how == "C":
        return t.contiguous()
    if how == "T":  # transposed storage of the last two dims
        return t.transpose(-1, -2).contiguous().transpose(-1, -2)
    if how == "S":  # strided slice along the last dim
        big = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)
        big[..., ::2] = t
        return big[..., ::2]
    raise ValueError(how)


def _input_values(case, m, k, g):
    x = torch.randn(m, k, generator=g, dtype=torch.float64)
    d = case.data
    if d == "normal":
        pass
    elif d == "zeros":
        x = torch.zeros_like(x)
    elif d == "large":
        x = x * 1000
    elif d == "tiny_amax":
        x = x * 1e-30
    elif d == "small_amax":
        x = x * 2.0 ** -16
    elif d == "nearmax":
        x = torch.sign(x) * (440 + 8 * torch.rand(m, k, generator=g, dtype=torch.float64))
    elif d == "negative":
        x = -x.abs() + 0.1 * x.abs() * (torch.rand(m, k, generator=g, dtype=torch.float64) > 0.9)
    elif d == "zero_rows":
        x[: m // 4] = 0
        x[:, : k // 4] = 0
    elif d == "outlier_row":
        x[m // 3] *= 1e4
    elif d == "outlier":
        x[:, k // 3] *= 100
    else:
        raise ValueError(d)
    return x


def build(case):
    """Returns x (leaf), weight param, bias param, grad_output tensor(s)."""
    g = torch.Generator().manual_seed(1234 + case.seed)
    m, k, n = case.dims()
    dt = DT[case.dtype]
    wdt = DT[case.wdtype] if case.wdtype else dt
    x = _input_values(case, m, k, g)
    w = (torch.rand(n, k, generator=g, dtype=torch.float64) * 2 - 1) / math.sqrt(k)
    b = (torch.rand(n, generator=g, dtype=torch.float64) * 2 - 1) / math.sqrt(k)
    gos = [torch.randn(m, n, generator=g, dtype=torch.float64) for _ in range(case.steps)]
    shape_x = (2, m // 2, k) if case.nd else (m, k)
    shape_y = (2, m // 2, n) if case.nd else (m, n)
    x = _layout(x.reshape(shape_x).to(dt), case.x_layout).requires_grad_(True)
    gos = [_layout(go.reshape(shape_y).to(dt), case.go_layout) for go in gos]
    return x, w.to(wdt), (b.to(wdt) if case.bias else None), gos


# --------------------------------------------------------------------------- loading
_loaded = {}


def load(impl):
    path, attr = impl.rsplit(":", 1)
    key = (path, attr)
    if key not in _loaded:
        p = ROOT / path
        modname = "h9v_" + p.stem
        spec = importlib.util.spec_from_file_location(modname, p)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[modname] = mod
        spec.loader.exec_module(mod)
        _loaded[key] = getattr(mod, attr)
    return _loaded[key]


def torchao_impl(recipe):
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    def conv(module):
        cfg = Float8LinearConfig.from_recipe_name(recipe)
        return convert_to_float8_training(module, config=cfg)
    return conv


# --------------------------------------------------------------------------- running
class Recorder(TorchDispatchMode):
    """Records aten._scaled_mm(_v2) calls (re-entering custom ops so inner calls show)."""

    def __init__(self):
        super().__init__()
        self.calls = []
        self.phase = "forward"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func)
        if name.startswith("aten._scaled_mm"):
            named = {}
            for i, a in enumerate(func._schema.arguments):
                if i < len(args):
                    named[a.name] = args[i]
                elif a.name in kwargs:
                    named[a.name] = kwargs[a.name]
                elif a.has_default_value():
                    named[a.name] = a.default_value
            out = func(*args, **kwargs)
            self.calls.append((self.phase, named, tuple(out.shape)))
            return out
        if not name.startswith(("aten.", "prim.", "prims.")):
            from torch._library.custom_ops import OPDEFS
            opdef = OPDEFS.get(func._schema.name)
            if opdef is not None:  # a torch.library custom op: run its Python body under the recorder
                with self:
                    return opdef._init_fn(*args, **kwargs)
        return func(*args, **kwargs)


def gpu_rule_violations(rec, case, recipe):
    """The SM90 cuBLASLt rules of torch._scaled_mm, per GEMM of the last call."""
    m, k, n = case.dims()
    out = []
    for phase, a, oshape in rec.calls:
        if phase == "forward":
            gemm = "output"
        else:
            gemm = "grad_input" if oshape[0] == m and oshape != (n, k) else "grad_weight"
        A, B = a["self"], a["mat2"]
        why = []
        if not (A.stride(1) == 1 and A.stride(0) >= max(1, A.shape[1])):
            why.append("A not row-major")
        if not (B.stride(0) == 1 and B.stride(1) >= max(1, B.shape[0])):
            why.append("B not column-major")
        if A.shape[1] % 16 or B.shape[1] % 16:
            why.append("dims not multiples of 16")
        for s in ("scale_a", "scale_b"):
            t = a[s]
            if t.dtype != torch.float32 or t.device != A.device:
                why.append(s + " not fp32 on device")
        if a.get("out_dtype") is None:
            why.append("out_dtype not passed")
        fast = bool(a.get("use_fast_accum", False))
        if fast != (gemm == "output"):
            why.append("use_fast_accum=%s on %s" % (fast, gemm))
        if why:
            out.append((gemm, tuple(why)))
    return out


def _call(form, impl, x, model_or_w, bias):
    if form == "function":
        x2 = x.reshape(-1, x.shape[-1])
        if "bias" in inspect.signature(impl).parameters:
            y = impl(x2, model_or_w, bias=bias)
        else:
            y = impl(x2, model_or_w)
            if bias is not None:
                y = y + bias.to(y.dtype)
        return y.reshape(*x.shape[:-1], y.shape[-1])
    return model_or_w(x)


def run(form, impl, case, record=False):
    """fwd+bwd (steps times). Returns dict of results of the last call (+ recorder)."""
    x, w, b, gos = build(case)
    m, k, n = case.dims()
    dt = DT[case.dtype]
    wdt = DT[case.wdtype] if case.wdtype else dt
    with torch.device("meta"):
        lin = nn.Linear(k, n, bias=case.bias, dtype=wdt)
    lin.weight = nn.Parameter(_layout(w, case.w_layout))
    if case.bias:
        lin.bias = nn.Parameter(b.clone())
    if form == "function":
        holder = None
        wparam, bparam = lin.weight, lin.bias
    else:
        if form == "module":
            holder = impl.from_float(lin)
        elif form == "converter":
            holder = impl(lin) if case.bare else impl(nn.Sequential(lin))
        else:
            raise ValueError(form)
        params = dict(holder.named_parameters())
        wparam = [p for nm, p in params.items() if nm.endswith("weight")][0]
        bl = [p for nm, p in params.items() if nm.endswith("bias")]
        bparam = bl[0] if bl else None
    rec = Recorder() if record else None
    res = {}
    for step in range(case.steps):
        if step:
            with torch.no_grad():
                wparam.mul_(3).add_(0.01)
            for t in (x, wparam, bparam):
                if t is not None:
                    t.grad = None
        if rec is not None:
            rec.calls = []
            rec.phase = "forward"
            with rec:
                y = _call(form, impl, x, holder if holder is not None else wparam, bparam)
        else:
            y = _call(form, impl, x, holder if holder is not None else wparam, bparam)
        res = {"output": y.detach()}
        try:
            if rec is not None:
                rec.phase = "backward"
                with rec:
                    y.backward(gos[step])
            else:
                y.backward(gos[step])
        except Exception as e:  # noqa: BLE001
            res["grad_input"] = e
            return res, rec
        res["grad_input"] = x.grad
        res["grad_weight"] = wparam.grad
        res["grad_bias"] = bparam.grad if bparam is not None else None
    return res, rec


def run_safe(form, impl, case, record=False):
    try:
        return run(form, impl, case, record)
    except Exception as e:  # noqa: BLE001
        return {"output": e}, None


GEMMS = ("output", "grad_input", "grad_weight")


def same(a, b):
    if a is None or b is None:
        return a is None and b is None
    if isinstance(a, Exception) or isinstance(b, Exception):
        return False
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return bool(((a == b) | (a.isnan() & b.isnan())).all())


def first_diff(r1, r2, out_strides=True):
    """First GEMM whose result differs (a raise counts), or None; also grad_bias."""
    for g in GEMMS:
        a, b = r1.get(g), r2.get(g)
        if isinstance(a, Exception) or isinstance(b, Exception):
            return g
        if g not in r1 and g not in r2:
            return None
        if not same(a, b):
            return g
        if g == "output" and out_strides and a.stride() != b.stride():
            return g
    if not same(r1.get("grad_bias"), r2.get("grad_bias")):
        return "grad_bias"
    return None


def run_with_inputs(form, impl, case, record=False):
    """run() plus the final weight / input / grad_output for the emulation."""
    res, rec = run_safe(form, impl, case, record)
    x, w, b, gos = build(case)
    w = w.clone()
    for _ in range(case.steps - 1):
        w = w.mul_(3).add_(0.01)
    return res, rec, x.detach(), w, b, gos[-1]


# --------------------------------------------------------------------------- blockwise emulation
def _tiles64(t):
    """1x128 tiles along the last dim: the recipe's e4m3 values, dequantized in float64."""
    r, c = t.shape
    v = t.to(torch.float32).reshape(r, c // 128, 128)
    amax = v.abs().amax(-1, keepdim=True).to(torch.float64).clamp(min=1e-12)
    s = (448.0 / amax).to(torch.float32)
    q = (v * s).clamp(-448, 448).to(torch.float8_e4m3fn)
    return (q.to(torch.float64) / s.to(torch.float64)).reshape(r, c)


def _blocks64(w):
    n, k = w.shape
    v = w.to(torch.float32).reshape(n // 128, 128, k // 128, 128)
    amax = v.abs().amax(dim=(1, 3), keepdim=True).to(torch.float64).clamp(min=1e-12)
    s = (448.0 / amax).to(torch.float32)
    q = (v * s).clamp(-448, 448).to(torch.float8_e4m3fn)
    return (q.to(torch.float64) / s.to(torch.float64)).reshape(n, k)


def _unit(dtype):
    return {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11, torch.float32: 2.0 ** -24}[dtype]


def check_blockwise(res, x, w, b, go):
    """Each GEMM within |impl - emu| <= (inner+8) * 2^-23 * (|A| @ |B|) + 1.01 * u_out * (|emu| + |impl|) + tiny,
    emu = the float64 product of the recipe's dequantized e4m3 operands (u_out: unit roundoff of the
    result dtype; the first term bounds float32 accumulation, block scaling and dequantization)."""
    k = x.shape[-1]
    n = w.shape[0]
    x2 = x.reshape(-1, k)
    g2 = go.reshape(-1, n)
    xd, wd, gd = _tiles64(x2), _blocks64(w), _tiles64(g2)
    gtd, xtd = _tiles64(g2.t()), _tiles64(x2.t())
    want = {
        "output": (xd @ wd.t(), xd.abs() @ wd.abs().t(), k, x.dtype),
        "grad_input": (gd @ wd, gd.abs() @ wd.abs(), n, go.dtype),
        "grad_weight": (gtd @ xtd.t(), gtd.abs() @ xtd.abs().t(), x2.shape[0], w.dtype),
    }
    if b is not None:
        e, a, kk, dt = want["output"]
        want["output"] = (e + b.to(x.dtype).to(torch.float64), a + b.to(torch.float64).abs(), kk, dt)
    for g in GEMMS:
        got = res.get(g)
        if isinstance(got, Exception) or got is None:
            return "%s: %r" % (g, got)
        emu, absprod, inner, dt = want[g]
        if got.dtype != dt:
            return "%s dtype %s != %s" % (g, got.dtype, dt)
        got64 = got.reshape(emu.shape).to(torch.float64)
        u = _unit(dt)
        tol = (inner + 8) * 2.0 ** -23 * absprod + 1.01 * u * (emu.abs() + got64.abs()) + torch.finfo(dt).tiny
        if g == "grad_weight" and w.dtype != go.dtype:
            tol = tol + 1.01 * _unit(go.dtype) * (emu.abs() + got64.abs())
        bad = (got64 - emu).abs() > tol
        if bad.any() or not torch.isfinite(got64).all():
            i = int(bad.flatten().nonzero()[0]) if bad.any() else -1
            return "%s out of bound at %d: got %r want %r tol %r" % (
                g, i, got64.flatten()[i].item(), emu.flatten()[i].item(), tol.flatten()[i].item())
    if b is not None:
        gb = res.get("grad_bias")
        want_gb = g2.to(torch.float64).sum(0)
        if gb is None or (gb.to(torch.float64) - want_gb).abs().max() > g2.shape[0] * _unit(go.dtype) * g2.abs().to(torch.float64).sum(0).max() + 1e-6:
            return "grad_bias"
    return None


# --------------------------------------------------------------------------- checks
CORRECT_CASES = [
    Case(), Case(bias=True, nd=True), Case(dtype="fp32", bias=True), Case(dtype="fp16", nd=True),
    Case(x_layout="T"), Case(dtype="fp32", x_layout="T", nd=True), Case(x_layout="S", bias=True),
    Case(w_layout="T", go_layout="T"), Case(dtype="fp16", bias=True, go_layout="S"), Case(kn=True),
    Case(data="zeros"), Case(data="zero_rows"), Case(data="large"), Case(dtype="fp32", data="tiny_amax"),
    Case(steps=2, bias=True), Case(wdtype="fp32", bias=True), Case(data="nearmax", dtype="fp16", nd=True),
    Case(bare=True, bias=True, nd=True),
]


_REF, _TWIN = {}, {}


def check_correct(entry):
    form, recipe = entry["form"], entry["recipe"]
    impl = load(entry["impl"])
    n_ok, fails = 0, []
    for c in CORRECT_CASES:
        if recipe == "blockwise":
            c = replace(c, blockwise=True)
            res, rec, x, w, b, go = run_with_inputs(form, impl, c, record=False)
            why = check_blockwise(res, x, w, b, go)
        else:
            if recipe != "tensorwise" and c.nd and c.x_layout == "T":
                continue  # torchao 0.18 rowwise raises on 3-D transposed-storage input
            res, rec = run_safe(form, impl, c, record=True)
            key = (recipe, c)
            if key not in _REF:
                _REF[key] = run_safe("converter", torchao_impl(recipe), c)[0]
            ref = _REF[key]
            d = first_diff(res, ref)
            why = None if d is None else "differs from torchao in " + d
        if why is None and rec is not None:
            v = gpu_rule_violations(rec, c, recipe)
            if v:
                why = "GPU rule: %s" % (v,)
        if why is None:
            n_ok += 1
        else:
            fails.append("%s: %s" % (c.cid(), why))
    return n_ok, fails


TOKEN_EDITS = {
    "non-contiguous input": lambda c: replace(c, x_layout="T"),
    "non-contiguous weight": lambda c: replace(c, w_layout="T"),
    "non-contiguous grad_output": lambda c: replace(c, go_layout="T"),
    "K == N": lambda c: replace(c, kn=True),
    "N-D input": lambda c: replace(c, nd=True),
    "fp32 input": lambda c: replace(c, dtype="fp32"),
    "fp16 input": lambda c: replace(c, dtype="fp16"),
    "fp32 weight": lambda c: replace(c, wdtype="fp32"),
    "second call": lambda c: replace(c, steps=2),
    "bias": lambda c: replace(c, bias=True),
    "gpu only": lambda c: c,
}


def case_for(trigger, recipe):
    c = Case(blockwise=(recipe == "blockwise"))
    for tok in trigger:
        if tok.startswith("data:"):
            c = replace(c, data=tok[5:])
        else:
            c = TOKEN_EDITS[tok](c)
    return c


def observe(entry, twin, case, gpu):
    """The GEMM where the bug first shows on `case` (None = identical), plus a note."""
    form = entry["form"]
    rb, recb = run_safe(form, load(entry["impl"]), case, record=gpu)
    key = (twin["impl"], case, gpu)
    if key not in _TWIN:
        _TWIN[key] = run_safe(form, load(twin["impl"]), case, record=gpu)
    rt, rect = _TWIN[key]
    d = first_diff(rb, rt)
    if not gpu:
        return d, ""
    if d is not None:
        return "cpu:" + d, "CPU results differ"
    vt = gpu_rule_violations(rect, case, entry["recipe"]) if rect else []
    vb = gpu_rule_violations(recb, case, entry["recipe"]) if recb else []
    if vt:
        return "twin-violates", str(vt)
    return (vb[0][0] if vb else None), (str(vb[0][1]) if vb else "")


def check_bug(entry, twin):
    trig = entry["trigger"]
    gpu = "gpu only" in trig
    problems = []
    got, note = observe(entry, twin, case_for(trig, entry["recipe"]), gpu)
    wrong_label = got != entry["gemm"]
    if wrong_label:
        problems.append("with trigger %s: first difference in %s, labelled %s %s" % (trig, got, entry["gemm"], note))
    for tok in trig:
        if tok == "gpu only":
            continue  # shown above: identical CPU results, only the GPU rule breaks
        rest = [t for t in trig if t != tok]
        got2, note2 = observe(entry, twin, case_for(rest, entry["recipe"]), gpu)
        if got2 is not None:
            problems.append("without %r still shows in %s %s" % (tok, got2, note2))
    return problems, wrong_label, got, note


def lint_device(path):
    """Every allocation names a device (or copies one: new_ones/zeros_like...)."""
    import re
    src = Path(path).read_text()
    bad = []
    for mtch in re.finditer(r"torch\.(zeros|ones|empty|full|tensor|arange|rand|randn)\(", src):
        depth, i = 1, mtch.end()
        while depth and i < len(src):
            depth += {"(": 1, ")": -1}.get(src[i], 0)
            i += 1
        if "device=" not in src[mtch.end():i]:
            bad.append(src[mtch.start():i])
    for tok in (".cpu()", ".numpy()", ".tolist()", ".item()"):
        if tok in src:
            bad.append(tok)
    return bad


def main():
    t0 = time.time()
    manifest = json.loads((HERE / "manifest.json").read_text())
    by_name = {e["name"]: e for e in manifest}
    correct = [e for e in manifest if e["category"] == "none"]
    bugs = [e for e in manifest if e["category"] != "none"]
    n_corr = 0
    for e in correct:
        n_ok, fails = check_correct(e)
        lint = lint_device(ROOT / e["impl"].rsplit(":", 1)[0])
        good = not fails and not lint
        n_corr += good
        print("%-4s correct %-22s %-18s %-9s %2d cases ok%s" % (
            "OK" if good else "FAIL", e["name"], e["recipe"], e["form"], n_ok,
            "" if good else " | " + "; ".join(fails[:3] + lint[:3])))
    n_bug, n_wrong = 0, 0
    for e in bugs:
        twin = by_name[TWINS[e["name"]]]
        problems, wrong, got, note = check_bug(e, twin)
        n_wrong += wrong
        n_bug += not problems
        print("%-4s %-10s %-12s %-11s %-26s %s%s" % (
            "OK" if not problems else "FAIL", e["name"], e["category"], e["gemm"], ",".join(e["trigger"]) or "-",
            ("(" + note + ") ") if note and not problems else "", "; ".join(problems)))
    print("SUMMARY: correct %d/%d verified, bugs %d/%d verified, %d wrong label(s), %.0fs" % (
        n_corr, len(correct), n_bug, len(bugs), n_wrong, time.time() - t0))
    return 0 if (n_corr == len(correct) and n_bug == len(bugs)) else 1


# twin of every planted bug (the correct file it was copied from)
TWINS = {
 "bug_tw_01": "tw_func_helpers",
 "bug_tw_02": "tw_func_helpers",
 "bug_tw_03": "tw_func_helpers",
 "bug_tw_04": "tw_func_helpers",
 "bug_tw_05": "tw_func_helpers",
 "bug_tw_06": "tw_func_helpers",
 "bug_tw_07": "tw_module_fp8saved",
 "bug_tw_08": "tw_module_fp8saved",
 "bug_tw_09": "tw_module_fp8saved",
 "bug_tw_10": "tw_module_fp8saved",
 "bug_tw_11": "tw_module_fp8saved",
 "bug_tw_12": "tw_conv_customop",
 "bug_tw_13": "tw_conv_customop",
 "bug_tw_14": "tw_conv_customop",
 "bug_tw_15": "tw_conv_customop",
 "bug_rw_01": "rw_module_explicit",
 "bug_rw_02": "rw_module_explicit",
 "bug_rw_03": "rw_module_explicit",
 "bug_rw_04": "rw_module_explicit",
 "bug_rw_05": "rw_module_explicit",
 "bug_rw_06": "rw_module_explicit",
 "bug_rw_07": "rw_module_explicit",
 "bug_rw_08": "rw_conv_quantizer",
 "bug_rw_09": "rw_conv_quantizer",
 "bug_rw_10": "rw_conv_quantizer",
 "bug_rw_11": "rw_func_ops",
 "bug_rw_12": "rw_func_ops",
 "bug_rw_13": "rw_func_ops",
 "bug_rw_14": "rw_func_ops",
 "bug_rw_15": "rw_func_ops",
 "bug_gw_01": "gwhp_func",
 "bug_gw_02": "gwhp_func",
 "bug_gw_03": "gwhp_func",
 "bug_gw_04": "gwhp_func",
 "bug_gw_05": "gwhp_func",
 "bug_gw_06": "gwhp_func",
 "bug_gw_07": "gwhp_conv",
 "bug_gw_08": "gwhp_conv",
 "bug_gw_09": "gwhp_conv",
 "bug_gw_10": "gwhp_conv",
 "bug_bw_01": "bw_func_qdq",
 "bug_bw_02": "bw_func_qdq",
 "bug_bw_03": "bw_func_qdq",
 "bug_bw_04": "bw_func_qdq",
 "bug_bw_05": "bw_func_qdq",
 "bug_bw_06": "bw_module_kblock",
 "bug_bw_07": "bw_module_kblock",
 "bug_bw_08": "bw_module_kblock",
 "bug_bw_09": "bw_module_kblock",
 "bug_bw_10": "bw_conv_bmm",
 "bug_bw_11": "bw_conv_bmm",
 "bug_bw_12": "bw_conv_bmm",
}

if __name__ == "__main__":
    sys.exit(main())
