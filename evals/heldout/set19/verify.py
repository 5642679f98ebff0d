"""Checks every label of held-out set 19 on the CPU, with an emulated torch.nn.functional.scaled_mm.

    python evals/heldout/set19/verify.py        (from the repository root; about a minute)

- The emulation checks each call strictly (MX-SPEC.md): 2-D operands, A row-major, B column-major,
  element dtypes, scale recipes, scale dtypes, exact swizzled scale sizes, SWIZZLE_32_4_4 (and
  NO_SWIZZLE for the NVFP4 global), output_dtype given, no bias; then dequantizes both operands to
  float64, multiplies in float64 and rounds once to output_dtype.
- A float64 reference written here from MX-SPEC.md (not from the implementations) gives output,
  grad_input, grad_weight and grad_bias; every correct file must equal it bit for bit on the
  plain case, each trigger case, transposed input / weight / grad_output and a mixed-dtype case.
- Each bug must differ from its twin first in the labelled GEMM on its trigger case (earlier GEMMs
  unchanged), in exactly the labelled operands, and equal its twin on the plain case when it has a
  trigger. A crash must raise in the labelled GEMM on its trigger case and not on the plain case.
"""
import importlib.util
import inspect
import json
import math
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
E4M3, E5M2, E8M0 = torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e8m0fnu
FP4 = torch.float4_e2m1fn_x2
GEMMS = ["output", "grad_input", "grad_weight"]
OPERANDS = {"output": ("input", "weight"), "grad_input": ("grad_output", "weight"),
            "grad_weight": ("grad_output", "input")}
FP4_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                           -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=torch.float64)

# --------------------------------------------------------------------------- emulated scaled_mm
LOG = []
_MISSING = object()


def _round_up(a, b):
    return -(-a // b) * b


def _round_once(x64, dtype):
    """Round a float64 tensor to dtype with a single rounding (round-to-odd through fp32)."""
    if dtype == torch.float64:
        return x64.clone()
    x32 = x64.to(torch.float32)
    if dtype == torch.float32:
        return x32
    toward0 = torch.where(x32.double().abs() > x64.abs(), torch.nextafter(x32, torch.zeros_like(x32)), x32)
    inexact = (toward0.double() != x64) & torch.isfinite(x64)
    bits = toward0.view(torch.int32) | inexact.to(torch.int32)
    return bits.view(torch.float32).to(dtype)


def _unswizzle(flat, rows, cols):
    prow, pcol = _round_up(rows, 128), _round_up(cols, 4)
    t = flat.reshape(prow // 128, pcol // 4, 32, 4, 4).permute(0, 3, 2, 1, 4).reshape(prow, pcol)
    return t[:rows, :cols]


def _check(cond, msg):
    if not cond:
        raise RuntimeError("emulated scaled_mm: " + msg)


def emulated_scaled_mm(mat_a, mat_b, scale_a, scale_recipe_a, scale_b, scale_recipe_b,
                       swizzle_a=None, swizzle_b=None, bias=None, output_dtype=_MISSING,
                       contraction_dim=(), use_fast_accum=False):
    as_list = lambda v: list(v) if isinstance(v, (list, tuple)) else [v]
    scale_a, scale_b = as_list(scale_a), as_list(scale_b)
    rec_a, rec_b = as_list(scale_recipe_a), as_list(scale_recipe_b)
    swz_a, swz_b = as_list(swizzle_a), as_list(swizzle_b)
    _check(output_dtype is not _MISSING and output_dtype in (torch.bfloat16, torch.float16, torch.float32),
           f"output_dtype must be given (bf16/fp16/fp32), got {output_dtype}")
    _check(bias is None and tuple(contraction_dim) == (), "bias / contraction_dim not used by the recipes")
    _check(mat_a.dim() == 2 and mat_b.dim() == 2, "2-D operands only")
    _check(mat_a.is_contiguous(), f"A must be row-major, strides {mat_a.stride()}")
    _check(mat_b.t().is_contiguous(), f"B must be column-major, strides {mat_b.stride()}")
    rows, cols = mat_a.shape[0], mat_b.shape[1]
    if mat_a.dtype == FP4:
        _check(mat_b.dtype == FP4, "both operands float4_e2m1fn_x2")
        _check(mat_a.shape[1] == mat_b.shape[0], "packed K mismatch")
        K = 2 * mat_a.shape[1]
        _check(K % 16 == 0, "K % 16")
        _check(rec_a == [F.ScalingType.BlockWise1x16, F.ScalingType.TensorWise] and rec_b == rec_a, "NVFP4 recipes")
        _check(swz_a == [F.SwizzleType.SWIZZLE_32_4_4, F.SwizzleType.NO_SWIZZLE] and swz_b == swz_a, "NVFP4 swizzle")
        deq = []
        for q, (sblk, glob), n in ((mat_a, scale_a, rows), (mat_b.t(), scale_b, cols)):
            _check(len(scale_a) == 2 and len(scale_b) == 2, "two-level scales")
            _check(sblk.dtype == E4M3 and sblk.is_contiguous() and sblk.numel() == _round_up(n, 128) * _round_up(K // 16, 4),
                   f"block scales: dtype {sblk.dtype}, numel {sblk.numel()}")
            _check(glob.dtype == torch.float32 and glob.numel() == 1, "global scale fp32 scalar")
            by = q.contiguous().view(torch.uint8)
            codes = torch.stack([by & 15, by >> 4], dim=-1).reshape(n, K).long()
            vals = FP4_VALUES[codes]
            s = _unswizzle(sblk.reshape(-1), n, K // 16).view(E4M3).double()
            deq.append(vals * s.repeat_interleave(16, dim=1) * glob.reshape(()).double())
    else:
        _check(mat_a.dtype in (E4M3, E5M2) and mat_b.dtype in (E4M3, E5M2), f"fp8 dtypes {mat_a.dtype} {mat_b.dtype}")
        _check(mat_a.shape[1] == mat_b.shape[0], f"K mismatch {tuple(mat_a.shape)} x {tuple(mat_b.shape)}")
        K = mat_a.shape[1]
        _check(K % 32 == 0, "K % 32")
        _check(rec_a == [F.ScalingType.BlockWise1x32] and rec_b == rec_a, "MX recipes")
        _check(swz_a == [F.SwizzleType.SWIZZLE_32_4_4] and swz_b == swz_a, "MX swizzle must be SWIZZLE_32_4_4")
        deq = []
        for q, s, n in ((mat_a, scale_a[0], rows), (mat_b.t(), scale_b[0], cols)):
            _check(len(scale_a) == 1 and len(scale_b) == 1, "one scale per operand")
            _check(s.dtype == E8M0 and s.is_contiguous() and s.numel() == _round_up(n, 128) * _round_up(K // 32, 4),
                   f"e8m0 scales: dtype {s.dtype}, numel {s.numel()}")
            by = _unswizzle(s.reshape(-1).view(torch.uint8), n, K // 32).double()
            sc = torch.where(by == 255, torch.full_like(by, math.nan), torch.exp2(by - 127))
            deq.append(q.double() * sc.repeat_interleave(32, dim=1))
    a64, bt64 = deq
    out = _round_once(a64 @ bt64.t(), output_dtype)
    LOG.append({"A": a64, "B": bt64, "out": out})
    return out


# --------------------------------------------------------------------------- float64 reference
def _e4m3_rne(v):
    """float64 -> nearest e4m3 value (ties to even), |v| <= 448 assumed; NaN stays NaN."""
    a = v.abs()
    ex = torch.floor(torch.log2(torch.where(a > 0, a, torch.ones_like(a)))).clamp(min=-6)
    quantum = torch.exp2(ex - 3)
    r = torch.round(a / quantum) * quantum
    return torch.copysign(r.clamp(max=448.0), v)


def _ref_mx(t, rule):
    x = t.float().contiguous()
    rows, n = x.shape
    xb = x.view(rows, n // 32, 32).double()
    amax32 = x.view(rows, n // 32, 32).abs().amax(-1)
    if rule == "rceil":
        q = (amax32 / 448.0).double()
        e = torch.ceil(torch.log2(q))
    else:
        e = torch.floor(torch.log2(amax32.double())) - 8
    e = torch.where(amax32 == 0, torch.full_like(e, -127.0), e).clamp(-127, 127)
    bad = ~torch.isfinite(amax32)
    e = torch.where(bad, torch.zeros_like(e), e).unsqueeze(-1)
    v = (xb / torch.exp2(e)).clamp(-448.0, 448.0)
    d = _e4m3_rne(v) * torch.exp2(e)
    d = torch.where(bad.unsqueeze(-1), torch.full_like(d, math.nan), d)
    return d.view(rows, n)


def _ref_nv(t):
    x = t.float().contiguous()
    rows, n = x.shape
    amax_t = x.abs().amax()
    g = amax_t / torch.tensor(2688.0) if amax_t != 0 else torch.tensor(1.0)
    if torch.isnan(amax_t):
        g = torch.tensor(math.nan)
    xb = x.view(rows, n // 16, 16)
    sv = (xb.abs().amax(-1) / torch.tensor(6.0)) / g
    s = _e4m3_rne(sv.double().clamp(max=448.0)).float()
    dec = s * g                                              # fp32 product
    y = torch.where(dec.unsqueeze(-1) == 0, torch.zeros_like(xb), xb / dec.unsqueeze(-1))
    mags = FP4_VALUES[:8]
    dist = (y.double().abs().unsqueeze(-1) - mags).abs()
    best = dist.min(-1, keepdim=True).values
    cand = (dist == best)
    # ties: prefer the even code
    even = torch.tensor([1, 0, 1, 0, 1, 0, 1, 0], dtype=torch.bool)
    pick = torch.where((cand & even).any(-1), (cand & even).float().argmax(-1), cand.float().argmax(-1))
    val = torch.copysign(mags[pick], y.double())
    d = val * s.double().unsqueeze(-1) * g.double()
    return d.view(rows, n)


def reference(recipe, x2, w, go2, b):
    """x2 [M,K], w [N,K], go2 [M,N] (any strides). Returns out, grad_input, grad_weight, grad_bias."""
    q = (lambda t: _ref_nv(t)) if recipe == "nvfp4" else (lambda t: _ref_mx(t, "floor" if recipe == "mxfp8_floor" else "rceil"))
    out = _round_once(q(x2) @ q(w).t(), x2.dtype)
    if b is not None:
        out = out + b.to(out.dtype)
    gi = _round_once(q(go2) @ q(w.t()).t(), x2.dtype)
    gw = _round_once(q(go2.t()) @ q(x2.t()).t(), w.dtype)
    gb = None if b is None else go2.sum(0).to(b.dtype)
    return out, gi, gw, gb


# --------------------------------------------------------------------------- cases
def _mk(shape, dtype, layout, gen):
    if layout == "transposed" and len(shape) == 2:
        base = torch.randn(shape[1], shape[0], generator=gen).to(dtype)
        return base.t()
    if layout == "sliced":
        base = torch.randn(*shape[:-1], 2 * shape[-1], generator=gen).to(dtype)
        return base[..., ::2]
    return torch.randn(*shape, generator=gen).to(dtype)


def make_case(tokens, recipe, form, seed=0):
    tokens = set(tokens)
    M, K, N = (64, 96, 160) if "K != N" in tokens else (128, 128, 128)
    gen = torch.Generator().manual_seed(1000 + seed)
    xd = torch.float32 if "fp32 input" in tokens else torch.bfloat16
    wd = torch.float32 if "fp32 weight" in tokens else torch.bfloat16
    nd = "N-D input" in tokens and form != "function"
    xshape = (2, M // 2, K) if nd else (M, K)
    x = _mk(xshape, xd, "transposed" if "non-contiguous input" in tokens else "contiguous", gen)
    w = _mk((N, K), wd, "transposed" if "non-contiguous weight" in tokens else "contiguous", gen) * 0.1
    go = _mk(xshape[:-1] + (N,), xd, "transposed" if "non-contiguous grad_output" in tokens else "contiguous", gen)
    if "sliced input" in tokens:
        x = _mk(xshape, xd, "sliced", gen)
    if "data:zeros" in tokens:
        x, w, go = x * 0, w * 0, go * 0
    if "data:zero_rows" in tokens:
        x = x.clone(); x[..., 3, :] = 0; x[..., 40 % x.shape[-2], :] = 0; x[..., :, 7] = 0
    if "data:nan" in tokens:
        x = x.clone(); x.view(-1, K)[5, 9] = math.nan
    if "data:large" in tokens:
        x = x * 1000
    if "data:tiny" in tokens:
        mag = torch.exp2(-10 - 20 * torch.rand(x.shape, generator=gen))
        x = (torch.sign(x.float()) * mag).to(xd)
    if "data:outlier_row" in tokens:
        x = x.clone(); x[..., 7, :] *= 1e4
    bias = (torch.randn(N, generator=gen) * 0.5).to(wd)   # dropped for a function without a bias parameter
    if "data:zeros" in tokens:
        bias = bias * 0
    calls = 2 if "second call" in tokens else 1
    delta = (torch.randn(N, K, generator=gen) * 0.05).to(wd)
    go2 = (torch.randn(*go.shape, generator=gen) * 0.5).to(xd)
    return dict(x=x, w=w, go=go, bias=bias, calls=calls, delta=delta, go2=go2)


# --------------------------------------------------------------------------- running an implementation
def load(impl):
    path, name = impl.split(":")
    fname = os.path.join(HERE, os.path.basename(path))
    mod_name = "set19_" + os.path.basename(path)[:-3]
    spec = importlib.util.spec_from_file_location(mod_name, fname)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return getattr(mod, name)


def run_impl(obj, form, case):
    """Returns (results, logs, error): results per call {out, gi, gw, gb}; logs per call (list of GEMM records)."""
    x0, w0 = case["x"], case["w"]
    K, N = w0.shape[1], w0.shape[0]
    weight = nn.Parameter(w0.detach().clone() if w0.is_contiguous() else w0.detach().t().clone().t())
    if not w0.is_contiguous():
        assert not weight.is_contiguous()
    bias = None if case["bias"] is None else nn.Parameter(case["bias"].clone())
    if form == "function":
        takes_bias = "bias" in inspect.signature(obj).parameters
        if not takes_bias:
            bias = None
        layer = (lambda x: obj(x, weight, bias)) if takes_bias else (lambda x: obj(x, weight))
    else:
        lin = nn.Linear(K, N, bias=bias is not None, dtype=w0.dtype)
        lin.weight = weight
        if bias is not None:
            lin.bias = bias
        if form == "module":
            layer = obj.from_float(lin)
        else:
            model = obj(nn.Sequential(lin))
            layer = model
    results, logs = [], []
    for call in range(case["calls"]):
        start = len(LOG)
        res = {}
        results.append(res)
        logs.append(LOG[start:])
        x = case["x"].detach().clone() if case["x"].is_contiguous() else case["x"]
        x = x.detach().requires_grad_(True)
        go = case["go"] if call == 0 else case["go2"]
        weight.grad = None
        if bias is not None:
            bias.grad = None
        try:
            out = layer(x)
            res["out"] = out.detach().clone()
            logs[-1] = LOG[start:]
            out.backward(go)
            logs[-1] = LOG[start:]
            res["gi"], res["gw"] = x.grad, weight.grad
            res["gb"] = None if bias is None else bias.grad
        except Exception as exc:  # noqa: BLE001
            logs[-1] = LOG[start:]
            return results, logs, (call, len(LOG) - start, exc)
        with torch.no_grad():
            weight.add_(case["delta"])
    return results, logs, None


def same(a, b):
    if a is None or b is None:
        return a is None and b is None
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    a64, b64 = a.double(), b.double()
    return bool(((a64 == b64) | (torch.isnan(a64) & torch.isnan(b64))).all())


def ref_for(recipe, form, obj, case, results):
    """Reference for each call of a correct implementation."""
    refs = []
    w_cur = case["w"].detach().clone()
    takes_bias = form != "function" or "bias" in inspect.signature(obj).parameters
    b = case["bias"] if takes_bias else None
    for call in range(case["calls"]):
        go = case["go"] if call == 0 else case["go2"]
        K, N = w_cur.shape[1], w_cur.shape[0]
        x2 = case["x"].reshape(-1, K)
        go2 = go.reshape(-1, N)
        out, gi, gw, gb = reference(recipe, x2, w_cur, go2, b)
        refs.append({"out": out.reshape(*case["x"].shape[:-1], N), "gi": gi.reshape(case["x"].shape),
                     "gw": gw, "gb": gb})
        w_cur = w_cur + case["delta"]
    return refs


# --------------------------------------------------------------------------- checks
def main():
    torch.nn.functional.scaled_mm = emulated_scaled_mm
    torch.manual_seed(0)
    manifest = json.load(open(os.path.join(HERE, "manifest.json")))
    by_name = {}
    problems = []
    correct = [e for e in manifest if e["category"] == "none"]
    bugs = [e for e in manifest if e["category"] != "none"]
    for e in correct:
        by_name[e["impl"].split(":")[1]] = e
    case_tokens = [[], ["K != N"], ["N-D input"], ["fp32 input"], ["fp32 weight"], ["second call"],
                   ["non-contiguous input"], ["non-contiguous weight"], ["non-contiguous grad_output"],
                   ["sliced input"], ["data:zeros"], ["data:zero_rows"], ["data:nan"], ["data:large"],
                   ["data:tiny"], ["data:outlier_row"], ["K != N", "fp32 weight", "non-contiguous input"]]
    for e in correct:
        obj = load(e["impl"])
        for toks in case_tokens:
            if "N-D input" in toks and e["form"] == "function":
                continue
            case = make_case(toks, e["recipe"], e["form"])
            n0 = len(LOG)
            res, logs, err = run_impl(obj, e["form"], case)
            if err:
                problems.append(f"{e['name']} {toks}: raised {err[2]!r}")
                continue
            if len(LOG) - n0 != 3 * case["calls"]:
                problems.append(f"{e['name']} {toks}: {len(LOG) - n0} scaled_mm calls")
            refs = ref_for(e["recipe"], e["form"], obj, case, res)
            for call, (r, f) in enumerate(zip(res, refs)):
                for k in ("out", "gi", "gw", "gb"):
                    if not same(r[k], f[k]):
                        problems.append(f"{e['name']} {toks} call {call}: {k} differs from the reference")
            xd, wd = case["x"].dtype, case["w"].dtype
            if res[0]["out"].dtype != xd or res[0]["gi"].dtype != xd or res[0]["gw"].dtype != wd:
                problems.append(f"{e['name']} {toks}: dtypes")
    print(f"correct: {len(correct)} files checked against the float64 reference")

    for e in bugs:
        twin_e = by_name[e["impl"].split(":")[1]]
        twin, bug = load(twin_e["impl"]), load(e["impl"])
        form, recipe = e["form"], e["recipe"]
        if e["form"] != twin_e["form"] or e["recipe"] != twin_e["recipe"]:
            problems.append(f"{e['name']}: form/recipe differ from twin")
        case = make_case(e["trigger"], recipe, form, seed=1)
        tres, tlogs, terr = run_impl(twin, form, case)
        bres, blogs, berr = run_impl(bug, form, case)
        if terr:
            problems.append(f"{e['name']}: twin raised {terr[2]!r}")
            continue
        label = e["gemm"]
        if e["category"] == "crash":
            if not berr:
                problems.append(f"{e['name']}: crash label but no exception")
            else:
                call, ncalls, exc = berr
                got = GEMMS[ncalls % 3]
                if got != label:
                    problems.append(f"{e['name']}: raised before GEMM {got}, labelled {label} ({exc!r})")
        else:
            first = None
            for call in range(case["calls"]):
                if call >= len(bres):
                    first = first or (call, "crash")
                    break
                for gi_, key in enumerate(("out", "gi", "gw")):
                    if key not in bres[call]:
                        first = (call, GEMMS[gi_] + "(raised)")
                        break
                    if not same(tres[call][key], bres[call][key]):
                        first = (call, GEMMS[gi_])
                        break
                if first:
                    break
                if not same(tres[call]["gb"], bres[call]["gb"]):
                    first = (call, None)
                    break
            if first is None:
                problems.append(f"{e['name']}: equals its twin on its trigger case {e['trigger']}")
            elif first[1] != label:
                problems.append(f"{e['name']}: first wrong GEMM {first[1]} (call {first[0]}), labelled {label}")
            elif label is not None:
                call, g = first
                idx = GEMMS.index(g)
                tl, bl = tlogs[call], blogs[call]
                if len(bl) <= idx:
                    diff = ["result"]
                else:
                    names = OPERANDS[g]
                    diff = [names[i] for i, k in enumerate(("A", "B")) if not same(tl[idx][k], bl[idx][k])]
                    if not diff:
                        diff = ["result"]
                if sorted(diff) != sorted(e["operands"]) or diff[0] != e["operand"]:
                    problems.append(f"{e['name']}: wrong operands {diff}, labelled {e['operand']} {e['operands']}")
        if e["trigger"]:
            pcase = make_case([], recipe, form, seed=2)
            t2, _, te = run_impl(twin, form, pcase)
            b2, _, be = run_impl(bug, form, pcase)
            if be:
                problems.append(f"{e['name']}: raises on the plain case ({be[2]!r})")
            elif any(not same(t2[c][k], b2[c][k]) for c in range(len(t2)) for k in ("out", "gi", "gw", "gb")):
                problems.append(f"{e['name']}: differs from its twin on the plain case")
    for p in problems:
        print("PROBLEM", p)
    print(f"verify: {len(correct)} correct, {len(bugs)} bugs, {len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
