"""Self-check of the heldout7 labels (CPU, torch + torchao only).

    cd /work/main && OMP_NUM_THREADS=2 .venv/bin/python property_tests/heldout7/verify.py

1. Correct tensorwise / rowwise / rowwise_with_gw_hp implementations must be bitwise equal to
   torchao 0.18's Float8Linear of their recipe (output, grad_input, grad_weight, grad_bias:
   values, dtype, shape, strides) on a set of cases; correct blockwise implementations must
   lie within a stated bound of a float64 emulation of the blockwise recipe (and have
   nn.Linear's dtypes, shapes and strides).
2. Every buggy entry runs beside its twin on the case its trigger describes. The GEMMs before
   the labelled one must be identical and the labelled one must differ (values, NaN, dtype,
   shape, strides) or raise. Then each trigger token is removed in turn and the bug must
   vanish. "gpu only" entries must be invisible on the CPU; they are checked on the recorded
   aten._scaled_mm calls (SM90 layout contract, use_fast_accum) instead.

Prints one line per entry; exits 1 when any label is not confirmed.
Options: -k SUBSTRING (only entries whose name contains it), -v (details).
"""
import argparse
import importlib.util
import inspect
import itertools
import json
import math
import os
import sys
import time
import warnings
from dataclasses import dataclass, replace

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

warnings.filterwarnings("ignore")
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
GEMMS = ("output", "grad_input", "grad_weight")
DEVICE = "cpu"   # --device cuda re-runs every check on a GPU (then "gpu only" bugs must show)
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


# --------------------------------------------------------------------------------------
# cases
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    lead: tuple = (32,)          # leading dims of the input; M = prod(lead)
    K: int = 64
    N: int = 48
    in_dtype: torch.dtype = BF16
    w_dtype: torch.dtype = BF16
    in_layout: str = "C"         # C contiguous, T transposed storage, S sliced storage
    w_layout: str = "C"
    go_layout: str = "C"
    bias: bool = False
    data: str = "normal"         # normal | large | tiny | zero_rows | nearmax | outlier
    steps: int = 1               # 2: a second call after an in-place weight update
    seed: int = 0

    @property
    def M(self):
        return math.prod(self.lead)

    def short(self):
        d = {BF16: "bf16", FP16: "fp16", FP32: "fp32"}
        s = f"M{'x'.join(map(str, self.lead))}K{self.K}N{self.N}|in:{d[self.in_dtype]}:{self.in_layout}"
        s += f"|w:{d[self.w_dtype]}:{self.w_layout}|go:{self.go_layout}"
        s += "|bias" if self.bias else ""
        s += f"|{self.data}" if self.data != "normal" else ""
        s += f"|steps{self.steps}" if self.steps > 1 else ""
        return s + f"|seed{self.seed}"


BASE = {
    "tensorwise": Case(),
    "rowwise": Case(),
    "rowwise_with_gw_hp": Case(),
    "blockwise": Case(lead=(128,), K=256, N=384),
}


def apply_trigger(case, tokens):
    for tok in tokens:
        if tok == "non-contiguous input":
            case = replace(case, in_layout="T")
        elif tok == "non-contiguous weight":
            case = replace(case, w_layout="T")
        elif tok == "non-contiguous grad_output":
            case = replace(case, go_layout="T")
        elif tok == "K == N":
            case = replace(case, N=case.K)
        elif tok == "N-D input":
            case = replace(case, lead=(2, case.M // 2))
        elif tok == "fp32 input":
            case = replace(case, in_dtype=FP32)
        elif tok == "fp16 input":
            case = replace(case, in_dtype=FP16)
        elif tok == "fp32 weight":
            case = replace(case, w_dtype=FP32)
        elif tok == "second call":
            case = replace(case, steps=2)
        elif tok == "bias":
            case = replace(case, bias=True)
        elif tok.startswith("data:"):
            case = replace(case, data=tok[5:])
        elif tok == "gpu only":
            pass
        else:
            raise ValueError(f"unknown trigger token {tok!r}")
    return case


def _layout(values, layout):
    values = values.to(DEVICE)
    if layout == "C":
        return values.contiguous()
    if layout == "T":
        return values.transpose(-1, -2).contiguous().transpose(-1, -2)
    if layout == "S":
        buf = torch.full((*values.shape[:-1], values.shape[-1] + 16), float("nan"),
                         dtype=values.dtype, device=values.device)
        buf[..., : values.shape[-1]] = values
        return buf[..., : values.shape[-1]]
    raise ValueError(layout)


def make_tensors(case):
    g = torch.Generator().manual_seed(1000 + case.seed)
    x = torch.randn(*case.lead, case.K, generator=g)
    if case.data == "large":
        x = x * 2000.0
    elif case.data == "tiny":
        x = x * 1e-3
    elif case.data == "nearmax":
        x = x * 2e36
    elif case.data == "outlier":
        x[..., 3] *= 100.0
    elif case.data == "zero_rows":
        x.reshape(-1, case.K)[: max(1, case.M // 4)] = 0.0
    w = torch.randn(case.N, case.K, generator=g) * case.K ** -0.5
    b = torch.randn(case.N, generator=g) * 0.5
    go = [torch.randn(*case.lead, case.N, generator=g) for _ in range(case.steps)]
    upd = [torch.randn(case.N, case.K, generator=g) * 0.25 for _ in range(case.steps)]
    x = _layout(x.to(case.in_dtype), case.in_layout)
    w = _layout(w.to(case.w_dtype), case.w_layout)
    go = [_layout(t.to(case.in_dtype), case.go_layout) for t in go]
    return (x, w, b.to(case.w_dtype).to(DEVICE), go,
            [u.to(case.w_dtype).to(DEVICE) for u in upd])


# --------------------------------------------------------------------------------------
# loading and running implementations
# --------------------------------------------------------------------------------------
_counter = itertools.count()


def load_attr(impl):
    path, attr = impl.rsplit(":", 1)
    path = os.path.join(ROOT, path)
    name = f"_heldout7_{os.path.splitext(os.path.basename(path))[0]}_{next(_counter)}"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return getattr(mod, attr)


def build_layer(entry, weight, bias):
    """Returns a callable x -> output, the three plug-in forms as a user would wire them."""
    if isinstance(entry, tuple) and entry[0] == "torchao":
        from torchao.float8.config import Float8LinearConfig
        from torchao.float8.float8_linear import Float8Linear

        lin = _linear(weight, bias)
        return Float8Linear.from_float(lin, config=Float8LinearConfig.from_recipe_name(entry[1]))
    if isinstance(entry, tuple) and entry[0] == "nn.Linear":
        # nn.Linear's contract in the input's precision (weight/bias cast like autocast would)
        return lambda x: nn.functional.linear(
            x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))
    attr = load_attr(entry["impl"])
    form = entry["form"]
    if form == "function":
        if "bias" in inspect.signature(attr).parameters:
            return lambda x: attr(x, weight, bias=bias)
        return lambda x: attr(x, weight) + (0 if bias is None else bias.to(x.dtype))
    if form == "module":
        return attr.from_float(_linear(weight, bias))
    if form == "converter":
        return attr(nn.Sequential(_linear(weight, bias)))
    raise ValueError(form)


def _linear(weight, bias):
    n, k = weight.shape
    with torch.device("meta"):
        lin = nn.Linear(k, n, bias=bias is not None)
    lin.weight = weight
    lin.bias = bias
    return lin


class CallRecorder(TorchDispatchMode):
    OPS = {torch.ops.aten._scaled_mm.default}
    if hasattr(torch.ops.aten, "_scaled_mm_v2"):
        OPS.add(torch.ops.aten._scaled_mm_v2.default)

    def __init__(self):
        super().__init__()
        self.calls = []
        self.pending = None   # the call being executed (to attribute an exception to a GEMM)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.OPS:
            a, b = args[0], args[1]
            bound = dict(zip([a.name for a in func._schema.arguments], args))
            bound.update(kwargs)
            sa, sb = bound.get("scale_a"), bound.get("scale_b")
            call = dict(
                a_shape=tuple(a.shape), a_stride=tuple(a.stride()), a_dtype=a.dtype,
                b_shape=tuple(b.shape), b_stride=tuple(b.stride()), b_dtype=b.dtype,
                sa_shape=tuple(sa.shape) if sa is not None else None,
                sb_shape=tuple(sb.shape) if sb is not None else None,
                out_dtype=bound.get("out_dtype"), fast=bool(bound.get("use_fast_accum", False)),
                bias=bound.get("bias") is not None,
            )
            self.calls.append(call)
            self.pending = call
            out = func(*args, **kwargs)
            self.pending = None
            return out
        return func(*args, **kwargs)


def run(entry, case, record=False):
    """Forward + backward (steps times). Returns a list of per-step dicts. aten._scaled_mm calls
    are always observed, so that an exception raised inside one is attributed to its GEMM."""
    x, w, b, gos, upds = make_tensors(case)
    x.requires_grad_(True)
    w = nn.Parameter(w)
    b = nn.Parameter(b) if case.bias else None
    steps = []
    rec = CallRecorder()
    try:
        layer = build_layer(entry, w, b)
    except Exception as e:  # noqa: BLE001
        return [dict(err=("output", f"{type(e).__name__}: {e}"))]

    def stage(default):
        return gemm_of(rec.pending, case) if rec.pending is not None else default

    for step in range(case.steps):
        res = {}
        x.grad = None
        w.grad = None
        if b is not None:
            b.grad = None
        rec.calls, rec.pending = [], None
        try:
            with rec:
                out = layer(x)
        except Exception as e:  # noqa: BLE001
            res["err"] = (stage("output"), f"{type(e).__name__}: {str(e)[:160]}")
            steps.append(res)
            break
        res["output"] = out.detach().clone()
        try:
            with rec:
                out.backward(gos[step])
        except Exception as e:  # noqa: BLE001
            res["err"] = (stage("grad_input"), f"{type(e).__name__}: {str(e)[:160]}")
        res["grad_input"] = None if x.grad is None else x.grad.clone()
        res["grad_weight"] = None if w.grad is None else w.grad.clone()
        res["grad_bias"] = None if b is None or b.grad is None else b.grad.clone()
        if record:
            res["calls"] = list(rec.calls)
        steps.append(res)
        if "err" in res:
            break
        with torch.no_grad():
            w.add_(upds[step])
    return steps


# --------------------------------------------------------------------------------------
# comparisons
# --------------------------------------------------------------------------------------
def tensor_diff(a, b):
    """None when identical (values incl. NaN positions, dtype, shape, strides)."""
    if a is None and b is None:
        return None
    if a is None or b is None:
        return "missing" if b is None else "unexpected tensor"
    if a.dtype != b.dtype:
        return f"dtype {a.dtype} vs {b.dtype}"
    if a.shape != b.shape:
        return f"shape {tuple(a.shape)} vs {tuple(b.shape)}"
    if a.stride() != b.stride():
        return f"strides {a.stride()} vs {b.stride()}"
    af, bf = a.double(), b.double()
    same = (af == bf) | (torch.isnan(af) & torch.isnan(bf))
    if bool(same.all()):
        return None
    n = int((~same).sum())
    nan = int((torch.isnan(bf) & ~torch.isnan(af)).sum())
    finite = ~(torch.isnan(af) | torch.isnan(bf))
    err = (af - bf).abs()[finite]
    rel = float(err.max() / af.abs().max().clamp(min=1e-300)) if err.numel() else float("nan")
    return f"values {n}/{a.numel()} differ" + (f", {nan} NaN" if nan else "") + f", max rel {rel:.2g}"


def step_diff(ref, bug, with_bias=False):
    """First differing GEMM in one step: (gemm, why) or None."""
    keys = list(GEMMS) + (["grad_bias"] if with_bias else [])
    ref_err = ref.get("err")
    bug_err = bug.get("err")
    for g in keys:
        if ref_err and ref_err[0] == g:
            return (g, f"twin raised: {ref_err[1]}")
        if bug_err and (bug_err[0] == g or (g == "output" and "output" not in bug)):
            return (g, f"raises: {bug_err[1][:90]}")
        if bug_err and g == "grad_input" and bug_err[0] == "grad_weight":
            continue   # the backward raised in the grad_weight GEMM: no grad_input to compare
        d = tensor_diff(ref.get(g), bug.get(g))
        if d:
            return (g, d)
    return None


def first_diff(ref_steps, bug_steps):
    for i in range(max(len(ref_steps), len(bug_steps))):
        if i >= len(ref_steps) or i >= len(bug_steps):
            return (i, "output", "one run stopped early")
        d = step_diff(ref_steps[i], bug_steps[i])
        if d:
            return (i, *d)
    return None


# ----- recorded-call checks for "gpu only" entries --------------------------------------
def gemm_of(call, case):
    (m, k), (_, n) = call["a_shape"], call["b_shape"]
    return {case.K: "output", case.N: "grad_input", case.M: "grad_weight"}.get(k, f"?k={k}")


def sm90_issues(call):
    (m, k), (k2, n) = call["a_shape"], call["b_shape"]
    sa, sb = call["a_stride"], call["b_stride"]
    out = []
    if not (sa[1] == 1 and sa[0] >= k):
        out.append(f"A {m}x{k} not row-major (strides {sa})")
    if not (sb[0] == 1 and sb[1] >= k2):
        out.append(f"B {k2}x{n} not column-major (strides {sb})")
    if k % 16 or n % 16:
        out.append("dims not divisible by 16")
    return out


def call_findings(ref_steps, bug_steps, case):
    """Per GEMM (in GEMM order, all steps) what the buggy recorded calls do differently."""
    found = {}
    for rs, bs in zip(ref_steps, bug_steps):
        rc = {gemm_of(c, case): c for c in rs.get("calls", [])}
        bc = {gemm_of(c, case): c for c in bs.get("calls", [])}
        for g in GEMMS:
            r, b = rc.get(g), bc.get(g)
            if r is None and b is None:
                continue
            why = []
            if r is None or b is None:
                why.append("call missing" if b is None else "extra call")
            else:
                why += [f"buggy: {i}" for i in sm90_issues(b) if i not in sm90_issues(r)]
                if r["fast"] != b["fast"]:
                    why.append(f"use_fast_accum {r['fast']} -> {b['fast']}")
                if r["out_dtype"] != b["out_dtype"]:
                    why.append(f"out_dtype {r['out_dtype']} -> {b['out_dtype']}")
            if r is not None and sm90_issues(r):
                why.append(f"twin violates contract: {sm90_issues(r)}")
            if why:
                found.setdefault(g, why)
    for g in GEMMS:
        if g in found:
            return g, found[g]
    return None


# --------------------------------------------------------------------------------------
# 1. correct implementations
# --------------------------------------------------------------------------------------
TORCHAO_CASES = [
    Case(),
    Case(bias=True),
    Case(lead=(48,), K=32, N=64, in_dtype=FP32, w_dtype=FP32, bias=True),
    Case(lead=(2, 16), K=64, N=32, bias=True),
    Case(lead=(2, 16), K=48, N=64, in_dtype=FP32, w_dtype=FP32),
    Case(K=64, N=64, in_layout="T"),
    Case(lead=(16,), K=32, N=48, w_layout="T", bias=True),
    Case(K=48, N=32, go_layout="T"),
    Case(in_dtype=FP16, w_dtype=FP16, bias=True),
    Case(w_dtype=FP32, bias=True),
    Case(in_layout="S", go_layout="S", seed=1),
    Case(bias=True, steps=2, seed=2),
    Case(data="zero_rows", seed=3),
    Case(lead=(2, 16), K=64, N=48, in_layout="T", seed=4),
]

BLOCK_CASES = [
    Case(lead=(128,), K=256, N=128),
    Case(lead=(128,), K=256, N=128, bias=True, seed=1),
    Case(lead=(256,), K=128, N=256, in_dtype=FP32, w_dtype=FP32, bias=True),
    Case(lead=(2, 64), K=128, N=256, seed=2),
    Case(lead=(128,), K=256, N=128, in_layout="T", w_layout="T", go_layout="T", seed=3),
    Case(lead=(128,), K=128, N=256, in_dtype=FP16, w_dtype=FP16, seed=4),
    Case(lead=(128,), K=256, N=128, w_dtype=FP32, bias=True, seed=5),
    Case(lead=(128,), K=256, N=128, steps=2, seed=6),
    Case(lead=(2, 64), K=256, N=128, in_layout="S", go_layout="S", data="outlier", seed=7),
    Case(lead=(128,), K=128, N=128, data="zero_rows", seed=8),
]

UNIT = {BF16: 2.0 ** -8, FP16: 2.0 ** -11, FP32: 2.0 ** -24}
E4M3 = torch.float8_e4m3fn


def _emu_q(t, amax_dims_view, view_shape):
    """Quantize t (fp32 math like the recipe) by blocks given by view_shape + dims; returns
    the dequantized float64 tensor (fp8 * 1/scale) and the float64 |dequantized| tensor."""
    v = t.to(torch.float32).reshape(view_shape)
    amax = torch.amax(torch.abs(v), dim=amax_dims_view, keepdim=True).to(torch.float64)
    scale = (448.0 / torch.clamp(amax, min=1e-12)).to(torch.float32)
    q = (v * scale).clamp(-448.0, 448.0).to(E4M3)
    return (q.to(torch.float64) / scale.to(torch.float64)).reshape(t.shape)


def emu_1x128(t):
    r, c = t.shape
    return _emu_q(t, (-1,), (r, c // 128, 128))


def emu_128x128(t):
    r, c = t.shape
    return _emu_q(t, (1, 3), (r // 128, 128, c // 128, 128))


def blockwise_emulation(case, x, w, b, go):
    """float64 emulation of one blockwise step: returns dict gemm -> (value, bound)."""
    x2 = x.reshape(-1, case.K)
    go2 = go.reshape(-1, case.N)
    u = UNIT[case.in_dtype]
    res = {}
    a, bb = emu_1x128(x2), emu_128x128(w)
    out = a @ bb.t()
    mag = a.abs() @ bb.abs().t()
    bias = b.double() if b is not None else torch.zeros(case.N, dtype=torch.float64, device=x.device)
    res["output"] = (out + bias, 2 * u * (out.abs() + bias.abs()) + (case.K + 4) * 2.0 ** -24 * mag)
    g = emu_1x128(go2)
    res["grad_input"] = (g @ bb, 2 * u * (g @ bb).abs() + (case.N + 4) * 2.0 ** -24 * (g.abs() @ bb.abs()))
    gt, xt = emu_1x128(go2.t()), emu_1x128(x2.t())
    gw = gt @ xt.t()
    uw = max(u, UNIT[case.w_dtype])
    res["grad_weight"] = (gw, 2 * uw * gw.abs() + (case.M + 4) * 2.0 ** -24 * (gt.abs() @ xt.abs().t()))
    return res


def check_correct_torchao(entry, verbose):
    problems, ran, skipped = [], 0, []
    for case in TORCHAO_CASES:
        ref = run(("torchao", entry["recipe"]), case)
        if ref and "err" in ref[0] and "output" not in ref[0]:
            skipped.append(f"{case.short()} (torchao raises: {ref[0]['err'][1][:70]})")
            continue
        got = run(entry, case)
        ran += 1
        for i, (r, g) in enumerate(zip(ref, got)):
            d = step_diff(r, g, with_bias=case.bias)
            if d:
                problems.append(f"{case.short()} step{i + 1}: {d[0]} {d[1]}")
        if len(ref) != len(got):
            problems.append(f"{case.short()}: {len(got)} steps vs {len(ref)}")
    return problems, ran, skipped


def check_correct_blockwise(entry, verbose):
    problems, ran, worst = [], 0, 0.0
    for case in BLOCK_CASES:
        got = run(entry, case)
        lin = run(("nn.Linear", None), case)
        ran += 1
        x, w, b, gos, upds = make_tensors(case)
        for i, (g, l) in enumerate(zip(got, lin)):
            if "err" in g:
                problems.append(f"{case.short()} step{i + 1}: raises {g['err']}")
                break
            emu = blockwise_emulation(case, x.detach(), w, b if case.bias else None, gos[i])
            for gemm in GEMMS:
                t = g[gemm]
                if t is None:
                    problems.append(f"{case.short()}: {gemm} missing")
                    continue
                if (t.dtype, t.shape, t.stride()) != (l[gemm].dtype, l[gemm].shape, l[gemm].stride()):
                    problems.append(f"{case.short()} step{i + 1}: {gemm} dtype/shape/strides "
                                    f"{t.dtype}{tuple(t.shape)}{t.stride()} vs nn.Linear "
                                    f"{l[gemm].dtype}{tuple(l[gemm].shape)}{l[gemm].stride()}")
                val, bound = emu[gemm]
                err = (t.double().reshape(val.shape) - val).abs()
                ratio = float((err / bound.clamp(min=1e-300)).max())
                worst = max(worst, ratio)
                if not ratio <= 1.0 or bool(torch.isnan(t).any()):
                    problems.append(f"{case.short()} step{i + 1}: {gemm} exceeds bound "
                                    f"(max err/bound {ratio:.3g})")
            if case.bias:
                d = tensor_diff(l["grad_bias"], g["grad_bias"])
                if d and not d.startswith("values"):
                    problems.append(f"{case.short()}: grad_bias {d}")
            with torch.no_grad():
                w.add_(upds[i])
    return problems, ran, worst


# --------------------------------------------------------------------------------------
# 2. buggy implementations
# --------------------------------------------------------------------------------------
def check_bug(entry, twins, verbose):
    """Returns (ok, message)."""
    twin = twins[entry["twin"]]
    trig = entry["trigger"]
    base = BASE[entry["recipe"]]
    gpu = "gpu only" in trig
    case = apply_trigger(base, trig)
    notes = []

    if gpu and DEVICE == "cpu":
        ref, bug = run(twin, case, record=True), run(entry, case, record=True)
        cpu = first_diff(ref, bug)
        if cpu:
            return False, f"'gpu only' but differs on the CPU: step{cpu[0] + 1} {cpu[1]} {cpu[2]}"
        f = call_findings(ref, bug, case)
        if f is None:
            return False, f"no recorded-call difference on {case.short()}"
        if f[0] != entry["gemm"]:
            return False, f"recorded calls first differ at {f[0]} ({f[1]}), label {entry['gemm']}"
        shows = f"{f[0]}: {'; '.join(f[1])}"
        for tok in trig:
            if tok == "gpu only":
                notes.append("w/o 'gpu only' (CPU values): identical")
                continue
            c2 = apply_trigger(base, [t for t in trig if t != tok])
            r2, b2 = run(twin, c2, record=True), run(entry, c2, record=True)
            f2 = call_findings(r2, b2, c2)
            if f2 is not None or first_diff(r2, b2):
                return False, f"still shows without '{tok}': {f2}"
            notes.append(f"w/o '{tok}': vanishes")
        notes += sliced_notes(entry, twin, case, calls=True)
        return True, f"shows [{shows}]; " + "; ".join(notes)

    if gpu and DEVICE != "cpu":
        notes.append("on the GPU")
    ref, bug = run(twin, case), run(entry, case)
    d = first_diff(ref, bug)
    if d is None:
        return False, f"does not show on {case.short()}"
    step, gemm, why = d
    if gemm != entry["gemm"]:
        return False, f"first differing GEMM is {gemm} ({why}) on {case.short()}, label {entry['gemm']}"
    if "second call" in trig and step != 1:
        return False, f"differs already at call {step + 1}"
    cls = entry["category"]
    if cls == "crash" and not why.startswith("raises"):
        return False, f"class crash but {gemm} does not raise ({why})"
    if cls == "contract" and not (why.split()[0] in ("dtype", "shape", "strides", "raises")
                                  or "bias" in trig):
        return False, f"class contract but the difference is {why}"
    if cls == "accumulation" and not why.startswith("values"):
        return False, f"class accumulation but the difference is {why}"
    if cls != "crash" and why.startswith("raises") and not (gpu and cls == "layout"):
        return False, f"class {cls} but it raises ({why})"
    shows = f"{gemm}{' (call 2)' if step else ''}: {why}"
    # robustness: the same trigger with another seed (and, without a trigger, other dims)
    c3 = replace(case, seed=case.seed + 7)
    if not trig:
        c3 = replace(c3, K=case.K * 2 if entry["recipe"] != "blockwise" else case.K,
                     lead=(case.M + (16 if entry["recipe"] != "blockwise" else 128),))
    d3 = first_diff(run(twin, c3), run(entry, c3))
    if d3 is None or d3[1] != entry["gemm"]:
        return False, f"not reproducible on {c3.short()}: {d3}"
    for tok in trig:
        if tok == "gpu only":
            continue
        c2 = apply_trigger(base, [t for t in trig if t != tok])
        d2 = first_diff(run(twin, c2), run(entry, c2))
        if d2 is not None:
            return False, f"still shows without '{tok}' on {c2.short()}: {d2}"
        notes.append(f"w/o '{tok}': vanishes")
    notes += sliced_notes(entry, twin, case)
    return True, f"shows [{shows}]" + ("; " + "; ".join(notes) if notes else "")


SLICED = {"non-contiguous input": "in_layout", "non-contiguous weight": "w_layout",
          "non-contiguous grad_output": "go_layout"}


def sliced_notes(entry, twin, case, calls=False):
    """Informational: the label's 'non-contiguous' tokens are checked with transposed storage;
    report what the same entry does with sliced (non-dense) storage instead."""
    out = []
    for tok, field in SLICED.items():
        if tok not in entry["trigger"]:
            continue
        c = replace(case, **{field: "S"})
        r, b = run(twin, c, record=calls), run(entry, c, record=calls)
        d = first_diff(r, b)
        if calls and d is None:
            f = call_findings(r, b, c)
            what = f"recorded calls differ at {f[0]}" if f else "no difference"
        else:
            what = "no difference" if d is None else f"{d[1]} {d[2].split(':')[0].split(',')[0]}"
        out.append(f"(info) sliced instead of transposed {tok.split()[-1]}: {what}")
    return out


# --------------------------------------------------------------------------------------
def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("-k", default="")
    ap.add_argument("-v", action="store_true")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    global DEVICE
    DEVICE = args.device
    t0 = time.time()
    torch.manual_seed(0)
    manifest = json.load(open(os.path.join(HERE, "manifest.json")))
    names = [e["name"] for e in manifest]
    assert len(names) == len(set(names)), "duplicate names"
    twins = {e["name"]: e for e in manifest if e["category"] == "none"}
    failures = []
    n_ok = {"correct": 0, "buggy": 0}

    for e in manifest:
        if args.k and args.k not in e["name"]:
            continue
        t = time.time()
        if e["category"] == "none":
            if e["recipe"] == "blockwise":
                probs, ran, worst = check_correct_blockwise(e, args.v)
                msg = f"{ran} cases within the float64-emulation bound (worst err/bound {worst:.2f})"
            else:
                probs, ran, skipped = check_correct_torchao(e, args.v)
                msg = f"bitwise = torchao {e['recipe']} on {ran} cases"
                if skipped:
                    msg += f" ({len(skipped)} skipped: torchao raises)"
            ok = not probs
            if not ok:
                msg = "; ".join(probs[:3]) + (f" (+{len(probs) - 3})" if len(probs) > 3 else "")
            kind = "correct"
        else:
            try:
                ok, msg = check_bug(e, twins, args.v)
            except Exception as ex:  # noqa: BLE001
                ok, msg = False, f"verify error {type(ex).__name__}: {ex}"
            kind = "buggy"
        label = ("correct" if e["category"] == "none" else
                 f"{e['category']}/{e['gemm']}/{e['operand']} trigger={e['trigger']}")
        print(f"{'OK  ' if ok else 'FAIL'} {e['name']:<22} {e['recipe']:<18} {label}: {msg}"
              f"  [{time.time() - t:.1f}s]", flush=True)
        if ok:
            n_ok[kind] += 1
        else:
            failures.append(e["name"])

    n_c = sum(1 for e in manifest if e["category"] == "none" and args.k in e["name"])
    n_b = sum(1 for e in manifest if e["category"] != "none" and args.k in e["name"])
    print(f"\nSUMMARY: correct {n_ok['correct']}/{n_c} confirmed, buggy {n_ok['buggy']}/{n_b} "
          f"labels confirmed, {len(failures)} wrong label(s)"
          + (f": {', '.join(failures)}" if failures else "") + f"; {time.time() - t0:.0f}s")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
