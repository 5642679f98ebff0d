#!/usr/bin/env python3
"""Re-check every label of this held-out set on the CPU (frozen with the set; do not edit).

    python evals/heldout/set16/verify.py            (or set17/verify.py; the two copies are identical)

What it does
- Replaces torch.nn.functional.scaled_mm with its own emulation of the GEMM that MX-SPEC.md describes
  (MXFP8 BlockWise1x32 with e8m0 scales and NVFP4 BlockWise1x16 + TensorWise with e4m3 block scales, both
  in the SWIZZLE_32_4_4 layout). The emulation enforces the call contract that cuBLAS / torch enforce
  (2-D operands, fp8/fp4 element types, A row-major and B column-major, scale dtype, scale element count,
  swizzle type) and computes the dequantized product in float64, rounded once to output_dtype.
- Correct files: on every case of the set's recipe their output, grad_input and grad_weight equal, bit for
  bit (NaN matching NaN), this script's own float64 reference of the layer written from MX-SPEC.md (numpy,
  independent of the files); the emulated-GEMM file (no scaled_mm call) must match within fp32
  accumulation error. Output / gradient dtypes, shapes and output strides are those of nn.Linear, and a
  fwd+bwd makes exactly three scaled_mm calls (none for the emulated file).
- Planted bugs: against their correct twin (twins.json), on the stated trigger case (the plain case when the
  trigger list is empty): the GEMMs before the labelled one (order output, grad_input, grad_weight) are
  unchanged and the labelled one changes (values, dtype, shape or strides, or the run raises there); the
  labelled operands (the A or B side of that GEMM call: element bytes, strides or scales) are exactly the
  ones that differ ("result": skipped); a bug with a trigger shows no difference at all on the plain case.
  A bug whose devices are ["cuda"] only must raise under the strict (cuBLAS) contract and equal its twin
  under a lenient CPU-style contract.
Prints one line per manifest entry; exits 1 if any label fails.
"""
import importlib.util
import inspect
import json
import os
import sys
import traceback
import zlib

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", "..", ".."))

FP4 = torch.float4_e2m1fn_x2
FP8_TYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
GEMMS = ("output", "grad_input", "grad_weight")
RESULT_KEY = {"output": "out", "grad_input": "gx", "grad_weight": "gw"}
A_SIDE = {"output": "input", "grad_input": "grad_output", "grad_weight": "grad_output"}
B_SIDE = {"output": "weight", "grad_input": "weight", "grad_weight": "input"}


# ----------------------------------------------------------------------------------------------
# emulated F.scaled_mm
# ----------------------------------------------------------------------------------------------
class ContractError(RuntimeError):
    pass


STATE = {"strict": True, "calls": None}


def _ru(n, m):
    return -(-n // m) * m


def _as_list(v):
    if v is None:
        return []
    return list(v) if isinstance(v, (list, tuple)) else [v]


def _unblock(flat_u8, rows, cols):
    """Inverse of the 128x4-tile layout: flat bytes -> [rows, cols]."""
    R, C = _ru(rows, 128), _ru(cols, 4)
    t = flat_u8.reshape(R // 128, C // 4, 32, 4, 4).permute(0, 3, 2, 1, 4).reshape(R, C)
    return t[:rows, :cols]


_E2M1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=torch.float64)


def _fp4_rows(u8):
    """[r, c2] packed bytes (element 2j in the low nibble) -> float64 [r, 2*c2]."""
    u8 = u8.to(torch.int64)
    lo, hi = _E2M1[u8 & 0xF], _E2M1[u8 >> 4]
    return torch.stack([lo, hi], dim=-1).reshape(u8.shape[0], -1)


_E8M0 = torch.tensor([float(2.0 ** (i - 127)) for i in range(255)] + [float("nan")], dtype=torch.float64)


def _e8m0(u8):
    return _E8M0[u8.to(torch.int64)]


def _gemm64(A, B):
    return torch.matmul(A.contiguous(), B.contiguous())


def _side_record(t, scales, recipes, swizzles):
    return {
        "dtype": t.dtype,
        "shape": tuple(t.shape),
        "stride": tuple(t.stride()),
        "bytes": t.view(torch.uint8).clone(),
        "scales": [(s.dtype, tuple(s.shape), s.reshape(-1).view(torch.uint8).clone() if s.dtype != torch.float32
                    else s.reshape(-1).clone()) for s in scales],
        "recipes": [int(r.value) if hasattr(r, "value") else int(r) for r in recipes],
        "swizzles": [int(s.value) if hasattr(s, "value") else int(s) for s in swizzles],
    }


def _same_side(p, q):
    if (p["dtype"], p["shape"], p["stride"], p["recipes"], p["swizzles"]) != (
        q["dtype"], q["shape"], q["stride"], q["recipes"], q["swizzles"]):
        return False
    if not torch.equal(p["bytes"], q["bytes"]):
        return False
    if len(p["scales"]) != len(q["scales"]):
        return False
    for (d1, s1, b1), (d2, s2, b2) in zip(p["scales"], q["scales"]):
        if d1 != d2 or b1.shape != b2.shape or not torch.equal(b1, b2):
            return False
    return True


def emu_scaled_mm(mat_a, mat_b, scale_a, scale_recipe_a, scale_b, scale_recipe_b, swizzle_a=None,
                  swizzle_b=None, bias=None, output_dtype=torch.bfloat16, contraction_dim=(),
                  use_fast_accum=False):
    scale_a, scale_b = _as_list(scale_a), _as_list(scale_b)
    rec_a, rec_b = _as_list(scale_recipe_a), _as_list(scale_recipe_b)
    swz_a, swz_b = _as_list(swizzle_a), _as_list(swizzle_b)
    rec = {"A": _side_record(mat_a, scale_a, rec_a, swz_a), "B": _side_record(mat_b, scale_b, rec_b, swz_b),
           "output_dtype": output_dtype, "deqB": None}
    if STATE["calls"] is not None:
        STATE["calls"].append(rec)

    def need(cond, msg):
        if not cond:
            raise ContractError(msg)

    need(mat_a.dim() == 2 and mat_b.dim() == 2, "operands must be 2-D")
    fp4 = mat_a.dtype == FP4
    need((fp4 and mat_b.dtype == FP4) or (mat_a.dtype in FP8_TYPES and mat_b.dtype in FP8_TYPES),
         f"unsupported element types {mat_a.dtype} x {mat_b.dtype}")
    need(mat_a.shape[1] == mat_b.shape[0], f"inner dimensions differ: {tuple(mat_a.shape)} x {tuple(mat_b.shape)}")
    M, N = mat_a.shape[0], mat_b.shape[1]
    K = mat_a.shape[1] * (2 if fp4 else 1)
    if STATE["strict"]:
        sa, sb = mat_a.stride(), mat_b.stride()
        need(sa[1] == 1 and sa[0] >= max(1, mat_a.shape[1]), f"mat_a must be row-major, stride {sa}")
        need(sb[0] == 1 and sb[1] >= max(1, mat_b.shape[0]), f"mat_b must be column-major, stride {sb}")
    need(mat_a.shape[1] % 16 == 0 and mat_b.shape[0] % 16 == 0 and N % 16 == 0, "dimensions not multiples of 16")
    need(contraction_dim in ((), [], None), "contraction_dim is not part of the contract")
    need(bias is None, "bias inside the GEMM is not part of the contract")
    SW = F.SwizzleType.SWIZZLE_32_4_4.value
    if not fp4:
        need(rec["A"]["recipes"] == [F.ScalingType.BlockWise1x32.value] and
             rec["B"]["recipes"] == [F.ScalingType.BlockWise1x32.value], "MXFP8 needs BlockWise1x32 for A and B")
        need(len(scale_a) == 1 and len(scale_b) == 1, "one scale tensor per operand")
        sa_, sb_ = scale_a[0], scale_b[0]
        need(sa_.dtype == torch.float8_e8m0fnu and sb_.dtype == torch.float8_e8m0fnu, "MX scales must be e8m0")
        need(sa_.numel() == _ru(M, 128) * _ru(-(-K // 32), 4), f"scale_a has {sa_.numel()} elements")
        need(sb_.numel() == _ru(N, 128) * _ru(-(-K // 32), 4), f"scale_b has {sb_.numel()} elements")
        need(rec["A"]["swizzles"] == [SW] and rec["B"]["swizzles"] == [SW], "MX scales must be SWIZZLE_32_4_4")
        Sa = _e8m0(_unblock(sa_.contiguous().view(torch.uint8).reshape(-1), M, K // 32))
        Sb = _e8m0(_unblock(sb_.contiguous().view(torch.uint8).reshape(-1), N, K // 32))
        A = mat_a.to(torch.float64) * Sa.repeat_interleave(32, dim=1)
        B = mat_b.to(torch.float64) * Sb.t().repeat_interleave(32, dim=0)
        acc = _gemm64(A, B)
    else:
        need(rec["A"]["recipes"] == [F.ScalingType.BlockWise1x16.value, F.ScalingType.TensorWise.value] and
             rec["B"]["recipes"] == [F.ScalingType.BlockWise1x16.value, F.ScalingType.TensorWise.value],
             "NVFP4 needs [BlockWise1x16, TensorWise] for A and B")
        need(len(scale_a) == 2 and len(scale_b) == 2, "two scale tensors per operand")
        need(scale_a[0].dtype == torch.float8_e4m3fn and scale_b[0].dtype == torch.float8_e4m3fn,
             "NVFP4 block scales must be e4m3")
        need(scale_a[1].dtype == torch.float32 and scale_a[1].numel() == 1 and
             scale_b[1].dtype == torch.float32 and scale_b[1].numel() == 1, "NVFP4 globals must be fp32 scalars")
        need(scale_a[0].numel() == _ru(M, 128) * _ru(K // 16, 4), f"scale_a has {scale_a[0].numel()} elements")
        need(scale_b[0].numel() == _ru(N, 128) * _ru(K // 16, 4), f"scale_b has {scale_b[0].numel()} elements")
        need(rec["A"]["swizzles"][:1] == [SW] and rec["B"]["swizzles"][:1] == [SW],
             "NVFP4 block scales must be SWIZZLE_32_4_4")
        Sa = _unblock(scale_a[0].contiguous().view(torch.uint8).reshape(-1), M, K // 16)
        Sb = _unblock(scale_b[0].contiguous().view(torch.uint8).reshape(-1), N, K // 16)
        Sa = Sa.contiguous().view(torch.float8_e4m3fn).to(torch.float64)
        Sb = Sb.contiguous().view(torch.float8_e4m3fn).to(torch.float64)
        A = _fp4_rows(mat_a.view(torch.uint8)) * Sa.repeat_interleave(16, dim=1)
        B = (_fp4_rows(mat_b.view(torch.uint8).t()) * Sb.repeat_interleave(16, dim=1)).t()
        acc = _nv_finish(_gemm64(A, B), float(scale_a[1].item()), float(scale_b[1].item()))
    rec["deqB"] = B
    return acc.to(output_dtype if output_dtype is not None else torch.bfloat16)


def _nv_finish(acc, ga, gb):
    return acc * (ga * gb)


# ----------------------------------------------------------------------------------------------
# float64 reference of the layer, from MX-SPEC.md (numpy; element rounding written out by hand)
# ----------------------------------------------------------------------------------------------
def _np(t):
    return t.detach().float().cpu().numpy().astype(np.float64)


def ref_e4m3(y):
    a = np.abs(y)
    with np.errstate(all="ignore"):
        _, ex = np.frexp(a)
        E = np.maximum(ex - 1, -6)
        ulp = np.ldexp(1.0, E - 3)
        q = np.minimum(np.round(a / ulp) * ulp, 448.0)
    return np.copysign(q, y)


def ref_e2m1(y):
    a = np.abs(y)
    with np.errstate(all="ignore"):
        _, ex = np.frexp(a)
        E = np.clip(ex - 1, 0, 2)
        ulp = np.ldexp(1.0, E - 1)
        q = np.minimum(np.round(a / ulp) * ulp, 6.0)
    return np.copysign(q, y)


def ref_mx_deq(t, rule):
    """Quantize-dequantize a 2-D tensor with blocks of 32 along dim 1 (MX-SPEC.md, MXFP8)."""
    v = _np(t)
    r, c = v.shape
    b = v.reshape(r, c // 32, 32)
    with np.errstate(all="ignore"):
        amax = np.max(np.abs(b), axis=-1)
        special = ~np.isfinite(amax)
        if rule == "rceil":
            ratio = (amax.astype(np.float32) / np.float32(448.0)).astype(np.float64)
            m, ex = np.frexp(ratio)
            e = np.where(m == 0.5, ex - 1, ex)
        else:
            _, ex = np.frexp(amax)
            e = ex - 1 - 8
        e = np.where(amax == 0, -127, e)
        e = np.where(special, 0, np.clip(e, -127, 127))
        p = np.ldexp(1.0, e)[..., None]
        y = (b / p).astype(np.float32).astype(np.float64)
        deq = ref_e4m3(y) * p
        deq = np.where(special[..., None], np.nan, deq)
    return torch.from_numpy(deq.reshape(r, c))


def ref_nv_deq(t):
    """NVFP4 two-level quantization of a 2-D tensor along dim 1 -> (q * s float64, global)."""
    v = t.detach().float().cpu().numpy()
    r, c = v.shape
    amax_t = np.float32(np.max(np.abs(v)))
    g = np.float32(amax_t / np.float32(2688.0)) if amax_t > 0 else np.float32(1.0)
    b = v.reshape(r, c // 16, 16)
    amax_b = np.max(np.abs(b), axis=-1).astype(np.float32)
    s_pre = (amax_b / np.float32(6.0)) / g
    s = ref_e4m3(s_pre.astype(np.float64))
    d = (s.astype(np.float32) * g).astype(np.float32)
    with np.errstate(all="ignore"):
        y = np.where(d[..., None] > 0, b / np.where(d > 0, d, np.float32(1.0))[..., None], np.float32(0.0))
    q = ref_e2m1(y.astype(np.float32).astype(np.float64))
    return torch.from_numpy((q * s[..., None]).reshape(r, c)), float(g)


def ref_layer(recipe, x2d, w, go2d):
    """float64 results of the three GEMMs, each with the float64 |A|@|B| bound for accumulation error."""
    res = {}
    pairs = {"output": (x2d, w), "grad_input": (go2d, w.t()), "grad_weight": (go2d.t(), x2d.t())}
    for name, (a, bt) in pairs.items():
        if recipe == "nvfp4":
            A, ga = ref_nv_deq(a)
            Bt, gb = ref_nv_deq(bt)
            acc = _nv_finish(_gemm64(A, Bt.t()), ga, gb)
            mag = _nv_finish(_gemm64(A.abs(), Bt.t().abs()), ga, gb)
        else:
            rule = "floor" if recipe == "mxfp8_floor" else "rceil"
            A, Bt = ref_mx_deq(a, rule), ref_mx_deq(bt, rule)
            acc = _gemm64(A, Bt.t())
            mag = _gemm64(A.abs(), Bt.t().abs())
        res[name] = (acc, mag, A.shape[1])
    return res


# ----------------------------------------------------------------------------------------------
# cases
# ----------------------------------------------------------------------------------------------
KNOWN_TRIGGERS = {
    "rows not multiple of 128": "M = 160 tokens (K = N = 128)",
    "K != N": "N = 256 (M = K = 128)",
    "M,K,N=256": "M = K = N = 256 (more than one 128x4 scale tile in both directions)",
    "dtype:float32": "input, weight, bias and grad_output in float32",
    "data:zero block": "a 32x32 all-zero tile at [0:32, 0:32] of input, weight and grad_output",
    "data:nan": "input[3, 5] = NaN and grad_output[7, 9] = NaN",
    "data:inf": "input[3, 5] = +Inf",
    "data:large": "input multiplied by 1024 (|x| well above 448)",
    "data:zero grad_output": "grad_output all zero",
    "N-D input": "input [2, 64, K] (module and converter forms)",
    "second call": "a second fwd+bwd after weight.add_(delta) under torch.no_grad()",
}


def make_case(triggers):
    c = {"M": 128, "K": 128, "N": 128, "dtype": torch.bfloat16, "nd": False, "second": False, "mods": []}
    for t in triggers:
        if t not in KNOWN_TRIGGERS:
            raise ValueError(f"unknown trigger {t!r}")
        if t == "rows not multiple of 128":
            c["M"] = 160
        elif t == "K != N":
            c["N"] = 256
        elif t == "M,K,N=256":
            c["M"] = c["K"] = c["N"] = 256
        elif t == "dtype:float32":
            c["dtype"] = torch.float32
        elif t == "N-D input":
            c["nd"] = True
        elif t == "second call":
            c["second"] = True
        else:
            c["mods"].append(t)
    g = torch.Generator().manual_seed(20261207 + zlib.crc32(repr((c["M"], c["K"], c["N"])).encode()) % 1000)
    M, K, N, dt = c["M"], c["K"], c["N"], c["dtype"]
    X = torch.randn(M, K, generator=g)
    W = torch.randn(N, K, generator=g) * K ** -0.5
    GO = torch.randn(M, N, generator=g)
    BIAS = torch.randn(N, generator=g) * 0.1
    DELTA = torch.randn(N, K, generator=g) * K ** -0.5
    X, W, GO, BIAS, DELTA = (t.to(dt) for t in (X, W, GO, BIAS, DELTA))
    for m in c["mods"]:
        if m == "data:zero block":
            X[:32, :32] = 0
            W[:32, :32] = 0
            GO[:32, :32] = 0
        elif m == "data:nan":
            X[3, 5] = float("nan")
            GO[7, 9] = float("nan")
        elif m == "data:inf":
            X[3, 5] = float("inf")
        elif m == "data:large":
            X = X * 1024
        elif m == "data:zero grad_output":
            GO = torch.zeros_like(GO)
    c.update(X=X, W=W, GO=GO, BIAS=BIAS, DELTA=DELTA)
    return c


_LOADED = [0]


def load_attr(impl):
    path, attr = impl.rsplit(":", 1)
    _LOADED[0] += 1
    spec = importlib.util.spec_from_file_location(f"_heldout_impl_{_LOADED[0]}", os.path.join(REPO, path))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    obj = mod
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def run(entry, case, strict=True):
    """One (or two, for 'second call') fwd+bwd of the implementation on the case, on the CPU."""
    STATE["strict"] = strict
    obj = load_attr(entry["impl"])
    M, K, N, dt = case["M"], case["K"], case["N"], case["dtype"]
    lin = nn.Linear(K, N, bias=True, dtype=dt)
    with torch.no_grad():
        lin.weight.copy_(case["W"])
        lin.bias.copy_(case["BIAS"])
    form = entry["form"]
    if form == "function":
        takes_bias = "bias" in inspect.signature(obj).parameters
        fwd = (lambda x: obj(x, lin.weight, lin.bias)) if takes_bias else (lambda x: obj(x, lin.weight))
        bias_used = takes_bias
    elif form == "converter":
        model = obj(nn.Sequential(lin))
        fwd, bias_used = model, True
    else:
        fwd, bias_used = obj.from_float(lin), True
    out = {"err": None, "bias_used": bias_used}
    n_calls = 2 if case["second"] else 1
    for call in range(n_calls):
        if call == 1:
            with torch.no_grad():
                lin.weight.add_(case["DELTA"])
            lin.weight.grad = None
            lin.bias.grad = None
        xs = case["X"].reshape(2, M // 2, K) if case["nd"] else case["X"]
        x = xs.clone().requires_grad_(True)
        out.update(out_t=None, gx=None, gw=None, gb=None, calls_f=[], calls_b=[], err=None,
                   w_used=lin.weight.detach().clone(), x_shape=tuple(x.shape))
        try:
            STATE["calls"] = out["calls_f"]
            y = fwd(x)
            STATE["calls"] = None
            out["out_t"] = y.detach().clone()
            out["out_strides"] = tuple(y.stride())
        except Exception as e:  # noqa: BLE001
            STATE["calls"] = None
            out["err"] = ("forward", f"{type(e).__name__}: {e}")
            return out
        go = case["GO"].reshape(y.shape) if y.numel() == case["GO"].numel() else None
        try:
            STATE["calls"] = out["calls_b"]
            y.backward(go.to(y.dtype))
            STATE["calls"] = None
        except Exception as e:  # noqa: BLE001
            STATE["calls"] = None
            out["err"] = ("backward", f"{type(e).__name__}: {e}")
            return out
        out["gx"] = None if x.grad is None else x.grad.detach().clone()
        out["gw"] = None if lin.weight.grad is None else lin.weight.grad.detach().clone()
        out["gb"] = None if (lin.bias.grad is None or not bias_used) else lin.bias.grad.detach().clone()
    return out


# ----------------------------------------------------------------------------------------------
# comparisons
# ----------------------------------------------------------------------------------------------
def same_tensor(a, b, strides=False):
    if a is None or b is None:
        return a is None and b is None
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if strides and a.stride() != b.stride():
        return False
    eq = (a == b) | (torch.isnan(a) & torch.isnan(b))
    return bool(eq.all())


def n_diff(a, b):
    if a is None or b is None or a.shape != b.shape:
        return -1
    a, b = a.float(), b.float()
    return int((~((a == b) | (torch.isnan(a) & torch.isnan(b)))).sum())


def gemm_same(r1, r2, gemm):
    if gemm == "output":
        return same_tensor(r1["out_t"], r2["out_t"]) and r1.get("out_strides") == r2.get("out_strides")
    return same_tensor(r1[RESULT_KEY[gemm]], r2[RESULT_KEY[gemm]])


def all_same(r1, r2):
    return (r1["err"] is None and r2["err"] is None and all(gemm_same(r1, r2, g) for g in GEMMS)
            and same_tensor(r1["gb"], r2["gb"]))


def classify_backward(res, case):
    """Map the twin's backward calls to GEMM names by the dequantized B operand."""
    Wd = case["W"].double() if not case["second"] else res["w_used"].double()
    Xd = case["X"].double().reshape(-1, case["K"])
    names = []
    for c in res["calls_b"]:
        B = c["deqB"]
        best, name = -2.0, None
        for cand, nm in ((Wd, "grad_input"), (Xd, "grad_weight")):
            if B is None or B.shape != cand.shape:
                continue
            ok = torch.isfinite(B) & torch.isfinite(cand)
            u, v = torch.where(ok, B, 0.0).flatten(), torch.where(ok, cand, 0.0).flatten()
            cs = float(u @ v / (u.norm() * v.norm() + 1e-300))
            if cs > best:
                best, name = cs, nm
        names.append(name)
    return names


def gemm_call(res, gemm, bwd_names):
    if gemm == "output":
        return res["calls_f"][0] if res["calls_f"] else None
    if gemm in bwd_names:
        i = bwd_names.index(gemm)
        return res["calls_b"][i] if i < len(res["calls_b"]) else None
    return None


def close_to_ref(val, acc, mag, kc, dtype):
    """|val - ref| within one ulp of the output dtype plus the fp32 accumulation bound kc * 2^-23 * |A||B|."""
    ref = acc.to(dtype).double()
    v = val.double()
    nan_ok = torch.equal(torch.isnan(v), torch.isnan(ref))
    rel = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -22
    tol = rel * ref.abs() + kc * 2.0 ** -23 * mag + 1e-30
    fin = ~torch.isnan(ref)
    return nan_ok and bool(((v - ref).abs()[fin] <= tol[fin]).all())


# ----------------------------------------------------------------------------------------------
# checks
# ----------------------------------------------------------------------------------------------
CORRECT_CASES = {
    "mx": [[], ["dtype:float32"], ["rows not multiple of 128"], ["K != N"], ["M,K,N=256"], ["data:zero block"],
           ["data:nan"], ["data:inf"], ["data:large"], ["second call"], ["N-D input"],
           ["rows not multiple of 128", "dtype:float32"]],
    "nv": [[], ["dtype:float32"], ["rows not multiple of 128"], ["K != N"], ["M,K,N=256"], ["data:zero block"],
           ["data:large"], ["data:zero grad_output"], ["second call"], ["N-D input"]],
}


def check_correct(entry):
    fam = "nv" if entry["recipe"] == "nvfp4" else "mx"
    emulated = entry.get("emulated_gemm", False)
    notes = []
    for trig in CORRECT_CASES[fam]:
        if "N-D input" in trig and entry["form"] == "function":
            continue
        case = make_case(trig)
        r = run(entry, case)
        tag = "+".join(trig) or "plain"
        if r["err"]:
            return False, f"{tag}: raised in {r['err'][0]}: {r['err'][1][:200]}"
        x2d = case["X"].reshape(-1, case["K"])
        go2d = case["GO"]
        ref = ref_layer(entry["recipe"], x2d, r["w_used"], go2d)
        dt = case["dtype"]
        want = {"out": ref["output"], "gx": ref["grad_input"], "gw": ref["grad_weight"]}
        got = {"out": r["out_t"].reshape(-1, case["N"]), "gx": r["gx"].reshape(-1, case["K"]), "gw": r["gw"]}
        for key in ("out", "gx", "gw"):
            acc, mag, kc = want[key]
            rv = acc.to(dt)
            if key == "out" and r["bias_used"]:
                rv = rv + case["BIAS"].to(dt)
                acc = acc + case["BIAS"].double()
            if got[key].dtype != dt:
                return False, f"{tag}: {key} dtype {got[key].dtype}, want {dt}"
            if emulated:
                if not close_to_ref(got[key], acc, mag, kc, dt):
                    return False, f"{tag}: {key} beyond fp32-accumulation tolerance ({n_diff(got[key], rv)} el.)"
            elif not same_tensor(got[key], rv):
                return False, f"{tag}: {key} differs from the float64 reference in {n_diff(got[key], rv)} elements"
        if r["out_t"].shape != tuple(case["X"].shape[:-1]) + (case["N"],) and not case["nd"]:
            return False, f"{tag}: output shape {tuple(r['out_t'].shape)}"
        if case["nd"] and tuple(r["out_t"].shape) != (2, case["M"] // 2, case["N"]):
            return False, f"{tag}: output shape {tuple(r['out_t'].shape)}"
        if not r["out_t"].is_contiguous() or tuple(r["gx"].shape) != r["x_shape"]:
            return False, f"{tag}: output strides or grad_input shape differ from nn.Linear's"
        if r["bias_used"]:
            gb_ref = go2d.double().sum(0)
            tol = 2.0 ** -6 * go2d.double().abs().sum(0) + 1e-6
            gbv = None if r["gb"] is None else r["gb"].double()
            if gbv is None or not bool((((gbv - gb_ref).abs() <= tol) | (gbv.isnan() & gb_ref.isnan())).all()):
                return False, f"{tag}: bias gradient missing or wrong"
        ncalls = (len(r["calls_f"]), len(r["calls_b"]))
        if ncalls != ((0, 0) if emulated else (1, 2)):
            return False, f"{tag}: scaled_mm calls (fwd, bwd) = {ncalls}"
        if not emulated:
            names = classify_backward(r, case)
            if sorted(names) != ["grad_input", "grad_weight"]:
                return False, f"{tag}: backward GEMMs not recognised: {names}"
    notes.append(f"{len([t for t in CORRECT_CASES[fam] if not ('N-D input' in t and entry['form'] == 'function')])} cases")
    return True, ("matches the float64 reference " + ("within fp32 accumulation, " if emulated else "bit for bit, ")
                  + ", ".join(notes))


def check_bug(entry, twin):
    gemm, operand, trig = entry["gemm"], entry["operand"], entry["trigger"]
    plain = make_case([])
    devices = entry["devices"]
    if devices == ["cuda"]:
        # contract-only bug: cuBLAS (strict) rejects it, a lenient CPU path computes the twin's values
        rb, rt = run(entry, plain, strict=True), run(twin, plain, strict=True)
        if rt["err"]:
            return False, f"twin raised: {rt['err']}"
        phase = "forward" if gemm == "output" else "backward"
        if not (rb["err"] and rb["err"][0] == phase and "ContractError" in rb["err"][1]):
            return False, f"strict contract did not reject it in the {phase}: {rb['err']}"
        lb, lt = run(entry, plain, strict=False), run(twin, plain, strict=False)
        if not all_same(lb, lt):
            return False, "lenient (CPU-style) run differs from the twin"
        return True, f"strict: {rb['err'][1][:90]}; lenient: equal to twin"
    if trig:
        rb, rt = run(entry, plain), run(twin, plain)
        if rt["err"]:
            return False, f"twin raised on plain: {rt['err']}"
        if not all_same(rb, rt):
            return False, "differs from the twin on the plain case although it has a trigger"
    case = make_case(trig)
    rb, rt = run(entry, case), run(twin, case)
    if rt["err"]:
        return False, f"twin raised on the trigger case: {rt['err']}"
    order = list(GEMMS)
    if gemm is None:
        if rb["err"] or not all(gemm_same(rb, rt, g) for g in GEMMS):
            return False, "a GEMM result changed although gemm is null"
        if same_tensor(rb["gb"], rt["gb"]):
            return False, "no difference outside the GEMMs"
        return True, f"GEMMs unchanged; bias grad {'missing' if rb['gb'] is None else 'differs'}"
    idx = order.index(gemm)
    err_phase = rb["err"][0] if rb["err"] else None
    for g in order[:idx]:
        if g == "output" and err_phase == "forward":
            return False, f"raised in the forward: {rb['err'][1][:120]}"
        if not gemm_same(rb, rt, g):
            return False, f"{g} already differs ({n_diff(rb[RESULT_KEY[g]] if g != 'output' else rb['out_t'], rt[RESULT_KEY[g]] if g != 'output' else rt['out_t'])} el.)"
    key = "out_t" if gemm == "output" else RESULT_KEY[gemm]
    if err_phase is not None:
        want_phase = "forward" if gemm == "output" else "backward"
        if err_phase != want_phase:
            return False, f"raised in the {err_phase}, label says {gemm}"
        how = f"raises in the {err_phase}: {rb['err'][1][:100]}"
    else:
        if gemm_same(rb, rt, gemm):
            return False, f"{gemm} does not differ on the trigger case"
        a, b = rb[key], rt[key]
        if a.dtype != b.dtype:
            how = f"{gemm} dtype {a.dtype} vs {b.dtype}"
        elif a.shape != b.shape:
            how = f"{gemm} shape {tuple(a.shape)} vs {tuple(b.shape)}"
        elif gemm == "output" and rb["out_strides"] != rt["out_strides"] and same_tensor(a, b):
            how = f"output strides {rb['out_strides']} vs {rt['out_strides']}"
        else:
            nd = n_diff(a, b)
            how = f"{gemm}: {nd}/{b.numel()} elements differ"
    if operand not in (None, "result"):
        names = classify_backward(rt, case)
        cb, ct = gemm_call(rb, gemm, names), gemm_call(rt, gemm, names)
        if ct is None:
            return False, "twin call for the labelled GEMM not found"
        if cb is None:
            return False, "bug made no call for the labelled GEMM"
        differ = set()
        if not _same_side(cb["A"], ct["A"]):
            differ.add(A_SIDE[gemm])
        if not _same_side(cb["B"], ct["B"]):
            differ.add(B_SIDE[gemm])
        want = set(entry.get("operands", [operand]))
        if operand not in want or differ != want:
            return False, f"operands differing in {gemm}: {sorted(differ)}, label {sorted(want)}"
        how += f"; operands changed: {', '.join(sorted(differ))}"
    return True, how


def main():
    man = json.load(open(os.path.join(HERE, "manifest.json")))
    twins = json.load(open(os.path.join(HERE, "twins.json")))
    by_name = {e["name"]: e for e in man}
    F.scaled_mm = emu_scaled_mm  # the harness-served GEMM for this run
    failures = 0
    for e in man:
        try:
            path = os.path.join(REPO, e["impl"].split(":")[0])
            doc = open(path).read().lstrip()
            head = doc[3:].lstrip() if doc.startswith('"""') else ""
            is_bug = e["category"] != "none"
            if is_bug != head.startswith("[planted bug:") or (not is_bug and not head.startswith("[correct:")):
                ok, msg = False, "docstring tag does not match the label"
            elif not is_bug:
                ok, msg = check_correct(e)
            else:
                ok, msg = check_bug(e, by_name[twins[e["name"]]])
        except Exception as ex:  # noqa: BLE001
            ok, msg = False, "verify error: " + "".join(traceback.format_exception_only(type(ex), ex)).strip()
        failures += not ok
        lab = f"{e['category']}/{e['detail']} {e['gemm']}/{e['operand']} trigger={e['trigger']}"
        print(f"{'PASS' if ok else 'FAIL'} {e['name']:8s} {lab} :: {msg}", flush=True)
    print(f"{len(man) - failures}/{len(man)} labels hold")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
