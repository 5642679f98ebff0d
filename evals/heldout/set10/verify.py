"""Verify the heldout10 set: correct implementations against torchao 0.18 (bitwise) or a float64
emulation (blockwise), then every bug against its twin on its trigger case and with each token removed.

    OMP_NUM_THREADS=2 /work/main/.venv/bin/python property_tests/heldout10/verify.py [name ...]
"""
import importlib.util
import inspect
import json
import re
import math
import os
import sys
import time

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

torch.set_num_threads(2)
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
GEMMS = ("output", "grad_input", "grad_weight")
_MODS = {}


def load(impl):
    path, attr = impl.rsplit(":", 1)
    full = os.path.join(ROOT, path)
    if full not in _MODS:
        name = "heldout10_" + os.path.splitext(os.path.basename(full))[0]
        spec = importlib.util.spec_from_file_location(name, full)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        _MODS[full] = mod
    return getattr(_MODS[full], attr)


# ----------------------------------------------------------------------------- cases
def gen_data(kind, shape, g):
    r = lambda: torch.randn(shape, generator=g)
    if kind == "normal":
        return r()
    if kind == "uniform":
        return torch.rand(shape, generator=g) * 2 - 1
    if kind == "heavy":
        z = r(); v = torch.rand(shape, generator=g).clamp(min=0.05)
        return z / v.sqrt() * 0.5
    if kind == "outlier":
        x = r(); x[..., 0] *= 100.0; return x
    if kind == "zeros":
        return torch.zeros(shape)
    if kind == "nearmax":
        return torch.sign(r()) * (400 + 48 * torch.rand(shape, generator=g))
    if kind == "tiny":
        return torch.sign(r()) * torch.exp2(-20 * torch.rand(shape, generator=g))
    if kind == "negative":
        return -r().abs() * 2 + 0.3 * torch.rand(shape, generator=g)
    if kind == "zero_rows":
        x = r(); x2 = x.reshape(-1, shape[-1])
        x2[: x2.shape[0] // 4] = 0; x2[:, : shape[-1] // 4] = 0; return x
    if kind == "outlier_row":
        x = r(); x.reshape(-1, shape[-1])[1] *= 1e4; return x
    if kind == "tiny_amax":
        return r() * 1e-30
    if kind == "small_amax":
        return r() * 2.0 ** -16
    if kind == "large":
        return r() * 1000.0
    raise ValueError(kind)


def t_storage(t):
    """same values, last two dims stored transposed."""
    return t.transpose(-1, -2).contiguous().transpose(-1, -2)


def make_case(recipe, tokens, seed=0):
    tokens = set(tokens)
    g = torch.Generator().manual_seed(seed)
    bw = recipe == "blockwise"
    K, N, M = (128, 256, 256) if bw else (32, 48, 64)
    if "K == N" in tokens:
        N = K
    lead = (2, M // 2) if "N-D input" in tokens else (M,)
    idt = torch.float32 if "fp32 input" in tokens else torch.float16 if "fp16 input" in tokens else torch.bfloat16
    wdt = torch.float32 if "fp32 weight" in tokens else idt
    kind = "normal"
    for t in tokens:
        if t.startswith("data:"):
            kind = t[5:]
    x = gen_data(kind, lead + (K,), g).to(idt)
    w = (torch.randn(N, K, generator=g) / math.sqrt(K)).to(wdt)
    b = (torch.randn(N, generator=g) * 0.5).to(wdt) if "bias" in tokens else None
    go = torch.randn(lead + (N,), generator=g).to(idt)
    if "non-contiguous input" in tokens:
        x = t_storage(x)
    if "non-contiguous weight" in tokens:
        w = t_storage(w)
    if "non-contiguous grad_output" in tokens:
        go = t_storage(go)
    return dict(x=x, w=w, b=b, go=go, second="second call" in tokens, K=K, N=N)


# ----------------------------------------------------------------------------- running
class Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace not in ("aten", "prim", "prims"):  # a custom op: record the GEMMs inside it
            from torch._library.custom_ops import _maybe_get_opdef
            opdef = _maybe_get_opdef(func)
            if opdef is not None:
                with self:
                    return opdef._init_fn(*args, **kwargs)
        if func in (torch.ops.aten._scaled_mm.default,):
            a, b = args[0], args[1]
            sa = kwargs.get("scale_a", args[2] if len(args) > 2 else None)
            sb = kwargs.get("scale_b", args[3] if len(args) > 3 else None)
            fast = kwargs.get("use_fast_accum", args[7] if len(args) > 7 else False)
            self.calls.append(dict(a_shape=tuple(a.shape), a_stride=a.stride(), b_shape=tuple(b.shape),
                                   b_stride=b.stride(), sa=sa.dtype, sb=sb.dtype,
                                   dev=(a.device, b.device, sa.device, sb.device), fast=bool(fast),
                                   out_dtype=kwargs.get("out_dtype", args[6] if len(args) > 6 else None)))
        return func(*args, **kwargs)


def gpu_violations(call, gemm):
    v = []
    M, K = call["a_shape"]; K2, N = call["b_shape"]
    if not (call["a_stride"][1] == 1 and call["a_stride"][0] > 1):
        v.append("A not row-major")
    if not (call["b_stride"][0] == 1 and call["b_stride"][1] > 1):
        v.append("B not column-major")
    if K % 16 or N % 16:
        v.append("dims not multiple of 16")
    if call["sa"] != torch.float32 or call["sb"] != torch.float32:
        v.append("scales not fp32")
    if len(set(call["dev"])) != 1:
        v.append("mixed devices")
    if call["out_dtype"] is None:
        v.append("out_dtype not passed")
    if call["fast"] != (gemm == "output"):
        v.append("fast accum %s on %s" % (call["fast"], gemm))
    return v


def build_runner(form, fn, linear):
    if form == "function":
        params = inspect.signature(fn).parameters
        if "bias" in params:
            return lambda x: fn(x, linear.weight, bias=linear.bias)
        return lambda x: fn(x, linear.weight) + (0 if linear.bias is None else linear.bias.to(x.dtype))
    if form == "module":
        return fn.from_float(linear)
    return fn(linear)


def torchao_runner(recipe):
    from torchao.float8 import Float8LinearConfig
    from torchao.float8.float8_linear import Float8Linear
    cfg = Float8LinearConfig.from_recipe_name(recipe)
    return lambda linear: Float8Linear.from_float(linear, config=cfg)


def run(case, make):
    """make(linear) -> callable. Returns results per GEMM (or exceptions) and the recorded GEMM calls."""
    K, N = case["K"], case["N"]
    lin = nn.Linear(K, N, bias=case["b"] is not None, device="meta")
    lin.weight = nn.Parameter(case["w"].clone())
    if case["b"] is not None:
        lin.bias = nn.Parameter(case["b"].clone())
    res = {"calls": {}}
    try:
        runner = make(lin)
    except Exception as e:  # noqa
        res["raise"] = ("output", repr(e)[:200]); return res
    n_calls = 2 if case["second"] else 1
    for i in range(n_calls):
        x = case["x"].clone().requires_grad_(True)
        x_before = x.detach().clone()
        rec = Recorder()
        try:
            with rec:
                out = runner(x)
        except Exception as e:  # noqa
            res["raise"] = ("output", repr(e)[:200]); return res
        res["calls"]["output"] = rec.calls
        res["output"] = out.detach().clone()
        res["input_modified"] = not same(x.detach(), x_before)
        rec = Recorder()
        try:
            with rec:
                out.backward(case["go"])
        except Exception as e:  # noqa
            res["raise"] = ("backward", repr(e)[:200]); return res
        calls = rec.calls
        res["calls"]["grad_input"] = calls[:1]
        res["calls"]["grad_weight"] = calls[1:2]
        res["grad_input"] = x.grad
        res["grad_weight"] = lin.weight.grad
        res["grad_bias"] = None if lin.bias is None else lin.bias.grad
        if i + 1 < n_calls:
            with torch.no_grad():
                lin.weight.mul_(3).add_(0.01)
            lin.weight.grad = None
            if lin.bias is not None:
                lin.bias.grad = None
    return res


def same(a, b):
    if a is None or b is None:
        return a is None and b is None
    if a.dtype != b.dtype or a.shape != b.shape or a.stride() != b.stride():
        return False
    if a.dtype.is_floating_point:
        return bool(((a == b) | (a.isnan() & b.isnan())).all())
    return bool((a == b).all())


def first_diff(ra, rb, check_gpu=False):
    """First GEMM whose result differs between two runs (None if none)."""
    if "raise" in ra or "raise" in rb:
        sa, sb = ra.get("raise", (None,))[0], rb.get("raise", (None,))[0]
        if sa == "output" or sb == "output":
            return "output"
        if not same(ra["output"], rb["output"]) or ra["input_modified"] != rb["input_modified"]:
            return "output"
        return "backward"
    for gm in GEMMS:
        if not same(ra[gm], rb[gm]):
            return gm
        if gm == "output" and ra["input_modified"] != rb["input_modified"]:
            return gm
        if gm == "grad_weight" and not same(ra["grad_bias"], rb["grad_bias"]):
            return gm
        if check_gpu:
            va = [v for c in ra["calls"].get(gm, []) for v in gpu_violations(c, gm)]
            vb = [v for c in rb["calls"].get(gm, []) for v in gpu_violations(c, gm)]
            if va != vb:
                return gm
    return None


# ----------------------------------------------------------------------------- blockwise oracle
def _q_emul(t, tiles):
    """float64 emulation of the block quantization of t (2-D), tiles=(tr, tc); returns the dequantized fp64."""
    r, c = t.shape
    tr, tc = tiles
    v = t.to(torch.float32).reshape(r // tr, tr, c // tc, tc)
    amax = v.abs().amax(dim=(1, 3), keepdim=True).double()
    s = (448.0 / amax.clamp(min=1e-12)).float()
    q = (v * s).clamp(-448, 448).to(torch.float8_e4m3fn)
    return (q.double() * s.reciprocal().double()).reshape(r, c)


def blockwise_emulation(case):
    x, w, go = case["x"], case["w"], case["go"]
    if case["second"]:
        w = w.clone(); w.mul_(3).add_(0.01)
    x2 = x.reshape(-1, x.shape[-1]); g2 = go.reshape(-1, go.shape[-1])
    xq = _q_emul(x2, (1, 128)); wq = _q_emul(w, (128, 128)); gq = _q_emul(g2, (1, 128))
    gtq = _q_emul(g2.t(), (1, 128)); xtq = _q_emul(x2.t(), (1, 128))
    out = xq @ wq.t(); gi = gq @ wq; gw = gtq @ xtq.t()
    bounds = [(xq.abs() @ wq.abs().t(), x2.shape[1]), (gq.abs() @ wq.abs(), g2.shape[1]),
              (gtq.abs() @ xtq.abs().t(), x2.shape[0])]
    return dict(output=out, grad_input=gi, grad_weight=gw), bounds


def check_blockwise(res, case):
    ref, bounds = blockwise_emulation(case)
    for gm in GEMMS:
        got = res[gm].double().reshape(ref[gm].shape)
        if gm == "output" and case["b"] is not None:
            got = got - case["b"].to(res[gm].dtype).double()  # bias added after rounding: allow its rounding
        absab, kdim = bounds[GEMMS.index(gm)]
        acc = kdim * 2.0 ** -23 * absab
        tol = 2.0 ** -8 * (ref[gm].abs() + acc) + acc + (2.0 ** -7 * (ref[gm].abs() + case["b"].double().abs()) if (gm == "output" and case["b"] is not None) else 0) + 1e-30
        if not bool(((got - ref[gm]).abs() <= tol).all()):
            return "%s outside bound (max excess %.3g)" % (gm, float(((got - ref[gm]).abs() - tol).max()))
    if res["output"].dtype != case["x"].dtype or res["grad_weight"].dtype != case["w"].dtype:
        return "dtype"
    return None


# ----------------------------------------------------------------------------- checks
CORRECT_CASES = [
    [], ["bias"], ["fp32 input"], ["fp16 input"], ["fp32 weight"], ["N-D input"], ["non-contiguous input"],
    ["non-contiguous weight"], ["non-contiguous grad_output"], ["K == N", "bias"], ["second call"],
    ["data:outlier"], ["data:zeros", "bias"], ["data:zero_rows"], ["data:tiny_amax"], ["data:large"],
    ["data:nearmax"], ["data:outlier_row"], ["data:tiny"], ["data:small_amax"], ["data:negative"],
    ["fp32 input", "bias", "N-D input"], ["fp16 input", "bias", "non-contiguous weight"],
    ["N-D input", "non-contiguous input"], ["fp32 input", "non-contiguous input", "second call"],
]


def check_correct(entry):
    fn = load(entry["impl"]); form, recipe = entry["form"], entry["recipe"]
    n_ok = n = 0; errors = []
    cases = CORRECT_CASES if recipe != "blockwise" else CORRECT_CASES[:13] + [["data:outlier_row"], ["data:zero_rows", "N-D input"]]
    for toks in cases:
        if recipe in ("rowwise", "rowwise_with_gw_hp") and "N-D input" in toks and "non-contiguous input" in toks:
            continue  # torchao 0.18 rowwise raises on 3-D transposed-storage inputs
        case = make_case(recipe, toks, seed=len(toks) + 7)
        wrap = form == "converter" and toks == ["bias"]  # a converter must also swap a Linear inside a container
        mine = run(case, (lambda lin: build_runner(form, fn, nn.Sequential(lin))) if wrap else (lambda lin: build_runner(form, fn, lin)))
        n += 1
        if "raise" in mine:
            errors.append("%s: raised %s" % (toks, mine["raise"])); continue
        bad = [v for gm in GEMMS for c in mine["calls"].get(gm, []) for v in gpu_violations(c, gm)]
        if bad:
            errors.append("%s: GPU contract %s" % (toks, bad)); continue
        if mine["input_modified"]:
            errors.append("%s: input modified" % toks); continue
        if recipe == "blockwise":
            err = check_blockwise(mine, case)
            if err:
                errors.append("%s: %s" % (toks, err)); continue
        else:
            ref = run(case, torchao_runner(recipe))
            d = first_diff(mine, ref)
            if d is not None:
                errors.append("%s: differs from torchao in %s" % (toks, d)); continue
        n_ok += 1
    return n_ok == n, "%d/%d cases" % (n_ok, n), errors


def check_bug(entry, twin):
    fb = load(entry["impl"]); ft = load(twin["impl"]); form, recipe = entry["form"], entry["recipe"]
    trig = entry["trigger"]; gpu = "gpu only" in trig
    toks = [t for t in trig if t != "gpu only"]
    msgs = []
    case = make_case(recipe, toks)
    rb = run(case, lambda lin: build_runner(form, fb, lin))
    rt = run(case, lambda lin: build_runner(form, ft, lin))
    if "raise" in rt:
        return False, ["twin raised %s" % (rt["raise"],)]
    if gpu:
        d_cpu = first_diff(rb, rt)
        if d_cpu is not None:
            msgs.append("gpu-only bug differs on CPU in %s" % d_cpu)
    d = first_diff(rb, rt, check_gpu=gpu)
    label = entry["gemm"]
    if d is None:
        msgs.append("no difference on trigger case")
    elif d == "backward":
        if label not in ("grad_input", "grad_weight"):
            msgs.append("raised in backward but labelled %s" % label)
    elif d != label:
        msgs.append("first difference in %s, labelled %s" % (d, label))
    if entry["category"] == "crash" and "raise" not in rb and not gpu:
        msgs.append("crash bug did not raise")
    for t in toks:  # each token removed: the bug must vanish (incl. on the GPU-rule check)
        rest = [u for u in toks if u != t]
        c2 = make_case(recipe, rest)
        r2b = run(c2, lambda lin: build_runner(form, fb, lin))
        r2t = run(c2, lambda lin: build_runner(form, ft, lin))
        d2 = first_diff(r2b, r2t, check_gpu=gpu)
        if d2 is not None:
            msgs.append("still differs (%s) without %r" % (d2, t))
    return not msgs, msgs


def main(argv):
    t0 = time.time()
    manifest = json.load(open(os.path.join(HERE, "manifest.json")))
    by_file = {}
    for e in manifest:
        by_file.setdefault(e["impl"].split(":")[0], e)
    only = set(argv)
    cor_ok = cor_n = bug_ok = bug_n = wrong = 0
    for e in manifest:
        if only and e["name"] not in only:
            continue
        if e["category"] == "none":
            ok, info, errs = check_correct(e)
            cor_n += 1; cor_ok += ok
            print("%-4s correct %-14s %s %s" % ("OK" if ok else "FAIL", e["name"], info, "; ".join(errs[:4])))
        else:
            stem = re.match(r"bug_(.+)_\d+$", os.path.basename(e["impl"].split(":")[0])[:-3]).group(1)
            twin = next(t for t in manifest if t["category"] == "none" and t["impl"].split(":")[0].endswith("/" + stem + ".py"))
            ok, msgs = check_bug(e, twin)
            bug_n += 1; bug_ok += ok; wrong += (not ok)
            print("%-4s bug %-10s %-18s %-11s %s" % ("OK" if ok else "FAIL", e["name"], e["category"], e["gemm"], "; ".join(msgs)))
        sys.stdout.flush()
    print("SUMMARY: correct %d/%d verified, bugs %d/%d verified, %d wrong label(s), %.0fs"
          % (cor_ok, cor_n, bug_ok, bug_n, wrong, time.time() - t0))
    return 0 if (cor_ok == cor_n and bug_ok == bug_n) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
