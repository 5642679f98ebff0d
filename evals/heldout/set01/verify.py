#!/usr/bin/env python
"""Checks the held-out set by execution, on CPU.

Standalone: imports torch, torchao and this folder's files only (never the project's
`parity` package). Run from anywhere:

    .venv/bin/python property_tests/heldout/verify.py [-v] [--only NAME ...]

1. The correct tensorwise / rowwise / rowwise_with_gw_hp implementations must be bitwise
   equal to torchao 0.18's Float8Linear (convert_to_float8_training with
   Float8LinearConfig.from_recipe_name(recipe)) for output, grad_input and grad_weight on a
   few bf16, contiguous, 2-D cases. The correct blockwise one is checked against an
   independent loop-based dequantization and by its SQNR against fp64.
2. Every entry of manifest.json is run, together with the correct function of its recipe,
   on a plain case and on a case that satisfies its trigger tokens. For each GEMM
   (output, grad_input, grad_weight) a difference is: values (bitwise, NaN-aware), dtype,
   shape or strides of the tensor, a crash in that phase, or a torch._scaled_mm call of
   that GEMM that breaks the SM90 layout rules (A row-major, B column-major, dims % 16,
   not two e5m2 operands). The first differing GEMM must be the manifest's "gemm";
   correct entries must not differ; an entry with triggers should not differ on the plain
   case (reported, not fatal). Entries whose devices lack "cpu" cannot be checked here:
   they are reported as skipped (and run to show they are equal on CPU).
Exit status 0 when every check passes.
"""
import argparse
import copy
import importlib.util
import json
import math
import pathlib
import sys
import traceback
import warnings

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

warnings.filterwarnings("ignore")
HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent.parent
GEMMS = ("output", "grad_input", "grad_weight")


# ----------------------------------------------------------------------------- loading
def load_module(path):
    path = (ROOT / path).resolve()
    key = "heldout_" + path.stem
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[key] = mod
        spec.loader.exec_module(mod)
    return sys.modules[key]


def load_impl(spec):
    path, attr = spec.rsplit(":", 1)
    return getattr(load_module(path), attr)


CORRECT_FN = {
    "tensorwise": "property_tests/heldout/correct_tensorwise.py:fp8_linear",
    "rowwise": "property_tests/heldout/correct_rowwise.py:fp8_linear",
    "rowwise_with_gw_hp": "property_tests/heldout/correct_rowwise_with_gw_hp.py:fp8_linear",
    "blockwise": "property_tests/heldout/correct_blockwise.py:fp8_linear",
}


# ----------------------------------------------------------------------------- cases
def make_case(recipe, triggers, seed=0):
    blockwise = recipe == "blockwise"
    if blockwise:
        M, K, N = 160, 256, 384
        if "K == N" in triggers:
            K = N = 256
    else:
        M, K, N = 64, 96, 48
        if "K == N" in triggers:
            K = N = 48
    g = torch.Generator().manual_seed(seed)
    x_dtype = (torch.float32 if "fp32 input" in triggers
               else torch.float16 if "fp16 input" in triggers else torch.bfloat16)
    w_dtype = torch.float32 if "fp32 weight" in triggers else torch.bfloat16

    x = torch.randn(M, K, generator=g)
    if "data:zeros" in triggers:
        x = torch.zeros(M, K)
    if "data:nearmax" in triggers:
        x = torch.sign(torch.randn(M, K, generator=g)) * (400 + 48 * torch.rand(M, K, generator=g))
    if "data:tiny" in triggers:
        x = torch.sign(torch.randn(M, K, generator=g)) * torch.exp2(-10 - 20 * torch.rand(M, K, generator=g))
    if "data:outlier" in triggers:
        x[:, 3] *= 100
    if "data:zero_rows" in triggers:
        x[[0, 5, 17]] = 0
    w = torch.randn(N, K, generator=g) * 0.05
    b = torch.randn(N, generator=g) * 0.5 if "bias" in triggers else None
    go = torch.randn(M, N, generator=g)
    lead = (2, M // 2) if "N-D input" in triggers else (M,)
    return dict(x=x.to(x_dtype).reshape(*lead, K), w=w.to(w_dtype), b=None if b is None else b.to(w_dtype),
                go=go.reshape(*lead, N), triggers=list(triggers), M=M, K=K, N=N)


NONCONTIG = {"kind": "T"}  # T: stored transposed, S: column slice of a wider NaN buffer, P: rows with NaN gaps


def _noncontig(t):
    kind = NONCONTIG["kind"]
    if kind == "T":
        return t.transpose(-1, -2).contiguous().transpose(-1, -2)
    if kind == "S":
        big = torch.full((*t.shape[:-1], t.shape[-1] + 16), float("nan"), dtype=t.dtype)
        big[..., 8:8 + t.shape[-1]] = t
        return big[..., 8:8 + t.shape[-1]]
    big = torch.full((t.shape[0] * 2, *t.shape[1:]), float("nan"), dtype=t.dtype)
    big[::2] = t
    return big[::2]


# ----------------------------------------------------------------------------- _scaled_mm lint
class ScaledMMRecorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = []
        self.phase = "output"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._scaled_mm.default:
            a, b = args[0], args[1]
            problems = []
            if a.dim() != 2 or b.dim() != 2:
                problems.append("operand not 2-D")
            else:
                if not (a.stride(1) == 1 and a.stride(0) >= a.shape[1]):
                    problems.append(f"A not row-major {tuple(a.shape)} {a.stride()}")
                if not (b.stride(0) == 1 and b.stride(1) >= b.shape[0]):
                    problems.append(f"B not column-major {tuple(b.shape)} {b.stride()}")
                if a.shape[1] % 16 or b.shape[0] % 16 or b.shape[1] % 16:
                    problems.append("dimension not a multiple of 16")
                if a.dtype == b.dtype == torch.float8_e5m2:
                    problems.append("two e5m2 operands")
            self.calls.append((self.phase, tuple(a.shape), tuple(b.shape), problems))
        return func(*args, **kwargs)


def gemm_of_call(call, M, K, N):
    phase, ashape, bshape, _ = call
    if phase == "output":
        return "output"
    out = (ashape[0], bshape[1]) if len(ashape) == 2 and len(bshape) == 2 else None
    if out == (N, K) and M != N:
        return "grad_weight"
    if out == (M, K):
        return "grad_input"
    return "grad_weight"  # per-token-block pieces of a grad_weight GEMM ([N,128] x [128,K])


# ----------------------------------------------------------------------------- running one implementation
def run_impl(form, impl, case, second_call):
    """Returns dict with out/grad_input/grad_weight/grad_bias (or 'crash' info) and lint calls."""
    trig = case["triggers"]
    x0, w0, b0, go0 = case["x"], case["w"], case["b"], case["go"]
    # fresh storage for every run (the second call updates the weight in place)
    weight = nn.Parameter(_noncontig(w0.clone()) if "non-contiguous weight" in trig else w0.clone())
    bias = None if b0 is None else nn.Parameter(b0.clone())
    K, N = case["K"], case["N"]

    if form == "function":
        fn = impl

        def call(x):
            y = fn(x.reshape(-1, K), weight)
            if bias is not None:
                y = y + bias.to(y.dtype)
            return y.reshape(*x.shape[:-1], y.shape[-1])
    else:
        lin = nn.Linear(K, N, bias=bias is not None, device="meta")
        lin.weight = weight
        lin.bias = bias
        if form == "module":
            mod = impl.from_float(lin)
        else:
            mod = impl(nn.Sequential(lin))
        call = mod

    def one_pass():
        res = {"crash": None}
        rec = ScaledMMRecorder()
        x = x0.clone() if "non-contiguous input" not in trig else _noncontig(x0.clone())
        x = x.detach().requires_grad_(True)
        weight.grad = None
        if bias is not None:
            bias.grad = None
        try:
            with rec:
                out = call(x)
        except Exception as e:  # noqa: BLE001
            res["crash"] = ("output", f"{type(e).__name__}: {str(e).splitlines()[0][:120]}")
            res["calls"] = rec.calls
            return res
        res["out"] = out.detach()
        go = go0.to(out.dtype) if go0.shape == out.shape else go0.reshape(out.shape).to(out.dtype)
        if "non-contiguous grad_output" in trig:
            go = _noncontig(go)
        try:
            rec.phase = "backward"
            with rec:
                out.backward(go)
        except Exception as e:  # noqa: BLE001
            res["crash"] = ("backward", f"{type(e).__name__}: {str(e).splitlines()[0][:120]}")
            res["calls"] = rec.calls
            return res
        res["grad_input"] = None if x.grad is None else x.grad.detach()
        res["grad_weight"] = None if weight.grad is None else weight.grad.detach()
        res["grad_bias"] = None if bias is None or bias.grad is None else bias.grad.detach()
        res["calls"] = rec.calls
        return res

    first = one_pass()
    if not second_call:
        return first
    with torch.no_grad():
        g = torch.Generator().manual_seed(123)
        weight.mul_(1.5).add_(torch.randn(weight.shape, generator=g).to(weight.dtype) * 0.02)
    second = one_pass()
    second["first_call"] = first
    return second


# ----------------------------------------------------------------------------- comparison
def tensor_diff(a, b):
    """'' when identical (values NaN-aware, dtype, shape, strides); else a short reason."""
    if a is None and b is None:
        return ""
    if a is None or b is None:
        return "missing" if a is None else "unexpected"
    if a.shape != b.shape:
        return f"shape {tuple(a.shape)} vs {tuple(b.shape)}"
    if a.dtype != b.dtype:
        return f"dtype {a.dtype} vs {b.dtype}"
    an, bn = torch.isnan(a), torch.isnan(b)
    if not torch.equal(an, bn):
        return f"NaN pattern ({int(an.sum())} vs {int(bn.sum())} NaN)"
    av, bv = a[~an], b[~bn]
    if not torch.equal(av, bv):
        d = (av.double() - bv.double()).abs()
        scale = bv.double().abs().max().item() if bv.numel() else 0.0
        return (f"values ({int((d > 0).sum())}/{av.numel()} differ, max |diff| {d.max().item():.3g}"
                f" = {d.max().item() / max(scale, 1e-300):.2g} x max|ref|)")
    if a.stride() != b.stride():
        return f"strides {a.stride()} vs {b.stride()}"
    return ""


def per_gemm(cand, ref, case):
    """dict gemm -> reason ('' = same)."""
    M, K, N = case["M"], case["K"], case["N"]
    reasons = {}
    if cand["crash"] is not None and ref["crash"] is None:
        stage, msg = cand["crash"]
        if stage == "output":
            return {"output": "crash " + msg, "grad_input": "-", "grad_weight": "-"}
        reasons["output"] = tensor_diff(cand["out"], ref["out"])
        reasons["grad_input"] = "crash (backward) " + msg
        reasons["grad_weight"] = "crash (backward)"
        return reasons
    if ref["crash"] is not None:
        return {g: "reference crashed: " + ref["crash"][1] for g in GEMMS}
    reasons["output"] = tensor_diff(cand["out"], ref["out"])
    reasons["grad_input"] = tensor_diff(cand["grad_input"], ref["grad_input"])
    reasons["grad_weight"] = tensor_diff(cand["grad_weight"], ref["grad_weight"])
    for call in cand["calls"]:
        if call[3]:
            gname = gemm_of_call(call, M, K, N)
            if not reasons[gname]:
                reasons[gname] = "_scaled_mm rule: " + "; ".join(call[3])
    return reasons


def first_diff(reasons):
    for g in GEMMS:
        if reasons.get(g):
            return g
    return None


# ----------------------------------------------------------------------------- checks
def sqnr(x, ref):
    return 20 * math.log10(ref.norm().item() / max((x.double() - ref).norm().item(), 1e-300))


def check_torchao_bitwise(verbose):
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    ok = True
    print("== correct implementations vs torchao 0.18 Float8Linear (bf16, contiguous, 2-D) ==")
    for recipe in ("tensorwise", "rowwise", "rowwise_with_gw_hp"):
        fn = load_impl(CORRECT_FN[recipe])
        for (M, K, N), with_bias in (((32, 64, 48), False), ((64, 128, 96), False), ((48, 32, 64), True)):
            torch.manual_seed(M + K + N)
            lin = nn.Linear(K, N, bias=with_bias).to(torch.bfloat16)
            x = torch.randn(M, K, dtype=torch.bfloat16)
            go = torch.randn(M, N, dtype=torch.bfloat16)
            ref = convert_to_float8_training(copy.deepcopy(nn.Sequential(lin)),
                                             config=Float8LinearConfig.from_recipe_name(recipe))
            x1 = x.clone().requires_grad_()
            o1 = ref(x1)
            o1.backward(go)
            w2 = nn.Parameter(lin.weight.detach().clone())
            b2 = nn.Parameter(lin.bias.detach().clone()) if with_bias else None
            x2 = x.clone().requires_grad_()
            o2 = fn(x2, w2)
            if with_bias:
                o2 = o2 + b2.to(o2.dtype)
            o2.backward(go)
            res = {"output": tensor_diff(o2, o1), "grad_input": tensor_diff(x2.grad, x1.grad),
                   "grad_weight": tensor_diff(w2.grad, ref[0].weight.grad)}
            if with_bias:
                res["grad_bias"] = tensor_diff(b2.grad, ref[0].bias.grad)
            good = not any(res.values())
            ok &= good
            print(f"  {recipe:20s} M{M}K{K}N{N}{' bias' if with_bias else ''}: "
                  + ("bitwise equal (output, grad_input, grad_weight" + (", grad_bias" if with_bias else "") + ")"
                     if good else "DIFFERS " + str(res)))
    return ok


ALL_TOKENS = ["non-contiguous input", "non-contiguous weight", "non-contiguous grad_output", "K == N",
              "N-D input", "fp32 input", "fp16 input", "fp32 weight", "second call", "bias", "data:zeros",
              "data:nearmax", "data:tiny", "data:outlier", "data:zero_rows"]


def check_torchao_conditions(verbose):
    """Informational: the correct functions vs torchao's Float8Linear on one case per trigger token."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    print("== (info) correct functions vs torchao Float8Linear, one case per trigger token ==")
    for recipe in ("tensorwise", "rowwise", "rowwise_with_gw_hp"):
        fn = load_impl(CORRECT_FN[recipe])
        def conv(m, r=recipe):
            return convert_to_float8_training(m, config=Float8LinearConfig.from_recipe_name(r))
        same, notes = [], []
        for tok in ALL_TOKENS:
            case = make_case(recipe, [tok], seed=2)
            two = tok == "second call"
            mine = run_impl("function", fn, case, two)
            tao = run_impl("converter", conv, case, two)
            if tao["crash"] is not None:
                notes.append(f"{tok}: torchao raises ({tao['crash'][1][:70]})")
                continue
            r = per_gemm(mine, tao, case)
            gb = "" if mine["crash"] else tensor_diff(mine.get("grad_bias"), tao.get("grad_bias"))
            bad = {g: v for g, v in r.items() if v}
            if gb:
                bad["grad_bias"] = gb
            (notes.append(f"{tok}: {bad}") if bad else same.append(tok))
        print(f"  {recipe}: bitwise equal under {len(same)}/{len(ALL_TOKENS)} tokens")
        for n in notes:
            print(f"      {n}")
    return True


def check_blockwise_reference(verbose):
    print("== correct blockwise: independent dequantization check and SQNR vs fp64 ==")
    mod = load_module("property_tests/heldout/correct_blockwise.py")
    ok = True
    for M, K, N in ((64, 128, 256), (160, 256, 128), (256, 256, 384)):
        torch.manual_seed(M * 7 + K + N)
        x = torch.randn(M, K, dtype=torch.bfloat16)
        w = (torch.randn(N, K) * 0.05).to(torch.bfloat16)
        go = torch.randn(M, N, dtype=torch.bfloat16)

        def dq_tiles(t):  # 1x128 along dim 1, explicit loops, float64
            out = torch.empty(t.shape, dtype=torch.float64)
            for r in range(t.shape[0]):
                for c0 in range(0, t.shape[1], 128):
                    seg = t[r, c0:c0 + 128].double()
                    s = torch.tensor(448.0 / max(seg.abs().max().item(), 1e-12), dtype=torch.float64).float()
                    q = (seg.float() * s).clamp(-448, 448).to(torch.float8_e4m3fn)
                    out[r, c0:c0 + 128] = q.double() * (1.0 / s).double()
            return out

        def dq_blocks(t):
            out = torch.empty(t.shape, dtype=torch.float64)
            for r0 in range(0, t.shape[0], 128):
                for c0 in range(0, t.shape[1], 128):
                    blk = t[r0:r0 + 128, c0:c0 + 128]
                    s = torch.tensor(448.0 / max(blk.double().abs().max().item(), 1e-12), dtype=torch.float64).float()
                    q = (blk.float() * s).clamp(-448, 448).to(torch.float8_e4m3fn)
                    out[r0:r0 + 128, c0:c0 + 128] = q.double() * (1.0 / s).double()
            return out

        xr = x.clone().requires_grad_()
        wr = nn.Parameter(w.clone())
        o = mod.fp8_linear(xr, wr)
        o.backward(go)
        ind_out = (dq_tiles(x) @ dq_blocks(w).t()).to(torch.bfloat16)
        ind_gi = (dq_tiles(go) @ dq_blocks(w)).to(torch.bfloat16)
        ind_gw = (dq_tiles(go.t()) @ dq_tiles(x.t()).t()).to(torch.bfloat16)   # partial last tile, no padding
        xd = x.double().requires_grad_()
        wd = w.double().requires_grad_()
        (xd @ wd.t()).backward(go.double())
        od = (x.double() @ w.double().t())
        for name, got, ind, ref64 in (("output", o, ind_out, od), ("grad_input", xr.grad, ind_gi, xd.grad),
                                      ("grad_weight", wr.grad, ind_gw, wd.grad)):
            mism = (got.float() != ind.float()).float().mean().item()
            rel = ((got.double() - ind.double()).abs().max() / ind.double().abs().max()).item()
            s = sqnr(got, ref64)
            good = rel < 2 ** -7 and s > 25
            ok &= good
            print(f"  M{M}K{K}N{N} {name:11s}: vs independent dequant {mism * 100:5.2f}% elements differ "
                  f"(max rel {rel:.1e}, bf16 ulp-level), SQNR vs fp64 {s:5.2f} dB {'ok' if good else 'FAIL'}")
    return ok


def check_entries(manifest, only, verbose):
    print("== entries: first differing GEMM on CPU (candidate vs the correct function of its recipe) ==")
    all_ok = True
    rows = []
    for e in manifest:
        if only and e["name"] not in only:
            continue
        impl = load_impl(e["impl"])
        ref_fn = load_impl(CORRECT_FN[e["recipe"]])
        trig = [t for t in e["trigger"] if t != "gpu only"]
        second = "second call" in trig
        results = {}
        for label, tr in (("plain", []), ("trigger", trig)):
            if label == "trigger" and not trig:
                results["trigger"] = results["plain"]
                continue
            case = make_case(e["recipe"], tr, seed=1)
            two_calls = second and label == "trigger"
            try:
                cand = run_impl(e["form"], impl, case, two_calls)
                ref = run_impl("function", ref_fn, case, two_calls)
                reasons = per_gemm(cand, ref, case)
                crashed = cand.get("crash") or ref.get("crash")
                gb = "" if crashed else tensor_diff(cand.get("grad_bias"), ref.get("grad_bias"))
                first_call = ""
                if two_calls and "first_call" in cand:
                    r1 = per_gemm(cand["first_call"], ref["first_call"], case)
                    first_call = first_diff(r1) or ""
            except Exception:  # noqa: BLE001
                traceback.print_exc()
                reasons, gb, first_call = {g: "verify error" for g in GEMMS}, "", ""
            results[label] = (reasons, gb, first_call)

        if e["category"] == "none":  # correct entries: also one case per trigger token
            for tok in ALL_TOKENS:
                case = make_case(e["recipe"], [tok], seed=3)
                two = tok == "second call"
                r = per_gemm(run_impl(e["form"], impl, case, two), run_impl("function", ref_fn, case, two), case)
                if first_diff(r):
                    results["plain"] = (r, results["plain"][1], "")
                    print(f"      {e['name']} differs under '{tok}': {r}")
                    break
        plain_first = first_diff(results["plain"][0])
        trig_first = first_diff(results["trigger"][0])
        if e["category"] == "none":
            status = "ok" if plain_first is None and not results["plain"][1] else "FAIL (correct entry differs)"
        elif "cpu" not in e["devices"]:
            status = "skipped: cuda-only" + (" (equal on CPU, as expected)" if trig_first is None
                                             else " (DIFFERS on CPU?)")
        else:
            reasons_t = results["trigger"][0]
            backward_crash = str(reasons_t.get("grad_input", "")).startswith("crash (backward)")
            if trig_first == e["gemm"]:
                status = "ok"
            elif backward_crash and e["gemm"] in ("grad_input", "grad_weight"):
                status = "ok (crash in backward; which backward GEMM is not resolvable by execution)"
            else:
                status = f"FAIL (first differing GEMM {trig_first}, manifest {e['gemm']})"
            if trig and plain_first is not None:
                status += f"; note: plain case also differs at {plain_first}"
            if second and results["trigger"][2]:
                status += f"; note: first call differs at {results['trigger'][2]}"
        if status.startswith("FAIL"):
            all_ok = False
        reasons = results["trigger"][0]
        detail = "; ".join(f"{g}: {reasons[g]}" for g in GEMMS if reasons.get(g) and reasons[g] != "-")
        if results["trigger"][1]:
            detail += f"; grad_bias: {results['trigger'][1]}"
        print(f"  {e['name']:28s} {e['recipe']:18s} {e['category']:12s} manifest={str(e['gemm']):11s} "
              f"trigger={trig or '[]'} -> first={trig_first} plain_first={plain_first}  [{status}]")
        if verbose or status.startswith("FAIL"):
            print(f"      {detail or 'no difference'}")
        rows.append((e["name"], status))
    return all_ok


def check_layout_kinds(manifest):
    """Informational: entries triggered by a non-contiguous token, and the correct entries,
    under the three non-contiguous layouts (T transposed, S sliced, P padded rows with NaN gaps)."""
    print("== (info) non-contiguous layouts T / S / P ==")
    toks = ["non-contiguous input", "non-contiguous weight", "non-contiguous grad_output"]
    for e in manifest:
        mine = [t for t in e["trigger"] if t in toks]
        if not mine and e["category"] != "none":
            continue
        impl, ref_fn = load_impl(e["impl"]), load_impl(CORRECT_FN[e["recipe"]])
        out = []
        for kind in "TSP":
            NONCONTIG["kind"] = kind
            firsts = []
            for tok in (mine or toks):
                case = make_case(e["recipe"], [tok], seed=7)
                firsts.append(first_diff(per_gemm(run_impl(e["form"], impl, case, False),
                                                  run_impl("function", ref_fn, case, False), case)))
            out.append(f"{kind}: {firsts[0] if mine else ('equal' if not any(firsts) else firsts)}")
        NONCONTIG["kind"] = "T"
        print(f"  {e['name']:34s} {('/'.join(mine) or 'all three tokens'):28s} " + ", ".join(out))


def check_shape_sensitivity(manifest):
    """Informational: entries with trigger [] at other plain shapes (K == N, one 128-block)."""
    print("== (info) trigger-free entries at other plain shapes ==")
    for e in manifest:
        if e["trigger"] or e["category"] == "none":
            continue
        impl, ref_fn = load_impl(e["impl"]), load_impl(CORRECT_FN[e["recipe"]])
        if e["recipe"] == "blockwise":
            shapes = [(128, 128, 128), (128, 256, 128), (128, 128, 256)]
        else:
            shapes = [(32, 64, 64), (48, 32, 16)]
        out = []
        for M, K, N in shapes:
            case = make_case(e["recipe"], [], seed=4)
            g = torch.Generator().manual_seed(5)
            case.update(M=M, K=K, N=N, x=torch.randn(M, K, generator=g).to(torch.bfloat16),
                        w=(torch.randn(N, K, generator=g) * 0.05).to(torch.bfloat16),
                        go=torch.randn(M, N, generator=g))
            r = per_gemm(run_impl(e["form"], impl, case, False), run_impl("function", ref_fn, case, False), case)
            out.append(f"M{M}K{K}N{N}: {first_diff(r)}")
        print(f"  {e['name']:28s} gemm={e['gemm']:11s} " + ", ".join(out))


def sweep_tokens(manifest, only):
    """Informational (--sweep): every buggy entry under one case per trigger token, to show
    that no token produces a different first GEMM or an unintended crash."""
    print("== (info, --sweep) buggy entries under each single trigger token ==")
    for e in manifest:
        if e["category"] == "none" or (only and e["name"] not in only):
            continue
        impl, ref_fn = load_impl(e["impl"]), load_impl(CORRECT_FN[e["recipe"]])
        seen = {}
        for tok in ALL_TOKENS:
            case = make_case(e["recipe"], [tok], seed=6)
            two = tok == "second call"
            cand = run_impl(e["form"], impl, case, two)
            r = per_gemm(cand, run_impl("function", ref_fn, case, two), case)
            f = first_diff(r)
            key = f"{f}" + (" (crash)" if cand["crash"] else "")
            seen.setdefault(key, []).append(tok)
        print(f"  {e['name']:28s} manifest={e['gemm']}: " + " | ".join(f"{k}: {v}" for k, v in seen.items()))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("-v", "--verbose", action="store_true")
    ap.add_argument("--only", nargs="*")
    ap.add_argument("--skip-reference-checks", action="store_true")
    ap.add_argument("--sweep", action="store_true", help="also run every buggy entry under each trigger token")
    args = ap.parse_args()
    torch.manual_seed(0)
    manifest = json.loads((HERE / "manifest.json").read_text())
    ok = True
    if not args.skip_reference_checks:
        ok &= check_torchao_bitwise(args.verbose)
        ok &= check_blockwise_reference(args.verbose)
        check_torchao_conditions(args.verbose)
    ok &= check_entries(manifest, set(args.only or []), args.verbose)
    if not args.only:
        check_layout_kinds(manifest)
        check_shape_sensitivity(manifest)
    if args.sweep:
        sweep_tokens(manifest, set(args.only or []))
    print("ALL CHECKS PASSED" if ok else "SOME CHECKS FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
