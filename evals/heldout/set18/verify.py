"""Check every label of this held-out set on the CPU (torch 2.13, under a minute).

torch.nn.functional.scaled_mm is replaced by an emulation of MX-SPEC's GEMM with strict call
contract checks; each correct file must equal, bit for bit, an independent float64 reference of
MX-SPEC's layer; each planted bug must differ from its twin exactly as manifest.json says.

    python evals/heldout/set18/verify.py          (prints one line per file and a final summary)
"""
import importlib.util
import inspect
import json
import math
import os
import sys
import traceback

import torch
from torch import nn

torch.set_num_threads(1)
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", "..", ".."))
F = torch.nn.functional
ST, SW = F.ScalingType, F.SwizzleType

# ----------------------------------------------------------------------------------------------
# exact rounding helpers (float64 in, float64 out)
_E4M3_POS = torch.arange(127, dtype=torch.uint8).view(torch.float8_e4m3fn).double()  # codes 0..126
_E2M1_POS = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)
_POW2 = torch.tensor([math.ldexp(1.0, k) if k < 1024 else math.inf for k in range(-1100, 1100)], dtype=torch.float64)


def pow2(e):
    return _POW2[(e.long() + 1100)]


def rne_table(v, table):
    """round |v| to the nearest entry of a sorted table (index parity = code parity), ties to the
    even index, saturating at the last entry; sign and NaN kept."""
    a = v.abs()
    n = table.numel()
    hi = torch.searchsorted(table, a.nan_to_num(0.0).contiguous()).clamp(max=n - 1)
    lo = (hi - 1).clamp(min=0)
    dlo, dhi = a - table[lo], table[hi] - a
    pick = torch.where(dhi < dlo, hi, torch.where(dlo < dhi, lo, torch.where(lo % 2 == 0, lo, hi)))
    pick = torch.where(a >= table[-1], torch.full_like(pick, n - 1), pick)
    r = table[pick] * torch.where(v < 0, -1.0, 1.0)
    return torch.where(v.isnan(), v, r)


def round_to(x, dtype):
    """one correct rounding of float64 x to dtype (torch's double->bf16 goes through float)."""
    if dtype == torch.float32:
        return x.float()
    assert dtype == torch.bfloat16
    _, e = torch.frexp(x)
    q = pow2(e.clamp(min=-125) - 8)
    r = torch.round(x / q) * q
    r = torch.where(r.abs() > 3.3895313892515355e38, r.sign() * math.inf, r)
    r = torch.where(x.isfinite(), r, x)
    return r.float().to(torch.bfloat16)


# ----------------------------------------------------------------------------------------------
# float64 reference of MX-SPEC (independent of the implementations under test)
def ref_mx_deq(t, rule):
    x = t.detach().double()
    R, C = x.shape
    b = x.reshape(R, C // 32, 32)
    amax = b.abs().amax(-1)
    bad = ~amax.isfinite()
    a0 = torch.where(bad, 0.0, amax)
    if rule == "floor":
        _, ex = torch.frexp(a0)
        e = ex - 1 - 8
    else:
        r = (a0.float() / 448.0).double()
        m, ex = torch.frexp(r)
        e = torch.where(m == 0.5, ex - 1, ex)
    e = torch.where(a0 == 0, -127, e).clamp(-127, 127)
    s = pow2(e)[..., None]
    deq = rne_table(b / s, _E4M3_POS) * s
    deq = torch.where(bad[..., None], math.nan, deq)
    return deq.reshape(R, C)


def ref_nv_deq(t):
    x = t.detach().float()
    R, C = x.shape
    amax_t = x.abs().max()
    glob = amax_t / 2688.0 if amax_t.item() != 0 else torch.tensor(1.0)
    b = x.reshape(R, C // 16, 16)
    s = rne_table(((b.abs().amax(-1) / 6.0) / glob).double(), _E4M3_POS).float()
    d = (s * glob)[..., None]
    y = torch.where(d == 0, 0.0, b / torch.where(d == 0, 1.0, d))
    deq = rne_table(y.double(), _E2M1_POS) * d.double()
    return deq.reshape(R, C)


def ref_gemm(recipe, a, bt, dtype):
    deq = ref_nv_deq if recipe == "nvfp4" else (lambda t: ref_mx_deq(t, "floor" if recipe == "mxfp8_floor" else "rceil"))
    return round_to(deq(a) @ deq(bt).t(), dtype)


def ref_layer(recipe, case, x, w, b, g):
    """returns (out, grad_input, grad_weight, grad_bias) of MX-SPEC's layer."""
    K, N = x.shape[-1], w.shape[0]
    x2, g2 = x.reshape(-1, K), g.reshape(-1, N)
    y = ref_gemm(recipe, x2, w, x.dtype).reshape(*x.shape[:-1], N)
    gb = None
    if b is not None:
        yy = y.clone().requires_grad_(True)
        bb = b.detach().clone().requires_grad_(True)
        o = yy + bb.to(yy.dtype)
        o.backward(g)
        y, gb = o.detach(), bb.grad
    gi = ref_gemm(recipe, g2, w.t(), x.dtype).reshape(x.shape)
    gw = ref_gemm(recipe, g2.t(), x2.t(), w.dtype)
    return [y, gi, gw, gb]


# ----------------------------------------------------------------------------------------------
# emulated torch.nn.functional.scaled_mm with strict contract checks
class ContractError(RuntimeError):
    pass


CALLS = []


def _req(cond, msg):
    if not cond:
        raise ContractError(msg)


def _lst(v):
    return list(v) if isinstance(v, (list, tuple)) else [v]


def _unswizzle(flat, rows, cols):
    R, C = -(-rows // 128) * 128, -(-cols // 4) * 4
    t = flat.reshape(R // 128, C // 4, 32, 4, 4)          # i, j, b, a, c
    t = t.permute(0, 3, 2, 1, 4).reshape(R, C)            # row 128 i + 32 a + b, col 4 j + c
    return t[:rows, :cols]


def _snap(t):
    raw = t.view(torch.uint8) if t.element_size() == 1 else t.reshape(-1).contiguous().view(torch.uint8)
    return (t.dtype, tuple(t.shape), tuple(t.stride()), raw.contiguous().clone())


def emulated_scaled_mm(mat_a, mat_b, scale_a, scale_recipe_a, scale_b, scale_recipe_b, swizzle_a=None,
                       swizzle_b=None, bias=None, output_dtype=torch.bfloat16, contraction_dim=(),
                       use_fast_accum=False):
    sa, sb, ra, rb = _lst(scale_a), _lst(scale_b), _lst(scale_recipe_a), _lst(scale_recipe_b)
    wa, wb = _lst(swizzle_a), _lst(swizzle_b)
    _req(mat_a.dim() == 2 and mat_b.dim() == 2, "operands must be 2-D")
    _req(mat_a.is_contiguous(), "A must be row-major (contiguous)")
    _req(mat_b.t().is_contiguous(), "B must be column-major (B.t() contiguous)")
    _req(mat_a.shape[1] == mat_b.shape[0], f"inner dims differ: {tuple(mat_a.shape)} x {tuple(mat_b.shape)}")
    _req(output_dtype in (torch.bfloat16, torch.float32), f"output_dtype {output_dtype}")
    _req(len(contraction_dim) == 0, "contraction_dim")
    m, n = mat_a.shape[0], mat_b.shape[1]
    bt = mat_b.t()
    if ra == [ST.BlockWise1x32] and rb == [ST.BlockWise1x32]:
        k = mat_a.shape[1]
        _req(k % 32 == 0, "K % 32")
        ok = (torch.float8_e4m3fn, torch.float8_e5m2)
        _req(mat_a.dtype in ok and mat_b.dtype in ok, f"MX element dtypes {mat_a.dtype} {mat_b.dtype}")
        deqs = []
        for q, s, rows, sw in ((mat_a, sa[0], m, wa), (bt, sb[0], n, wb)):
            _req(len(sa) == 1 and len(sb) == 1, "one MX scale tensor per operand")
            _req(s.dtype == torch.float8_e8m0fnu, f"MX scale dtype {s.dtype}")
            _req(s.is_contiguous(), "scale contiguous")
            _req(s.numel() == -(-rows // 128) * 128 * (-(-(k // 32) // 4) * 4), f"MX scale numel {s.numel()}")
            _req(sw == [SW.SWIZZLE_32_4_4], f"MX swizzle {sw}")
            byte = _unswizzle(s.reshape(-1).view(torch.uint8), rows, k // 32).long()
            sc = torch.where(byte == 255, math.nan, pow2(byte - 127))
            deqs.append((q.double().reshape(rows, k // 32, 32) * sc[..., None]).reshape(rows, k))
    elif ra == [ST.BlockWise1x16, ST.TensorWise] and rb == [ST.BlockWise1x16, ST.TensorWise]:
        k = mat_a.shape[1] * 2
        _req(k % 16 == 0, "K % 16")
        _req(mat_a.dtype == torch.float4_e2m1fn_x2 and mat_b.dtype == torch.float4_e2m1fn_x2, "NV element dtype")
        deqs = []
        for q, s, rows, sw in ((mat_a, sa, m, wa), (bt, sb, n, wb)):
            _req(len(s) == 2, "NV scales [block, global]")
            blk, gl = s
            _req(blk.dtype == torch.float8_e4m3fn and blk.is_contiguous(), f"NV block scale {blk.dtype}")
            _req(blk.numel() == -(-rows // 128) * 128 * (-(-(k // 16) // 4) * 4), f"NV scale numel {blk.numel()}")
            _req(gl.dtype == torch.float32 and gl.numel() == 1, "NV global scale fp32 scalar")
            _req(sw == [SW.SWIZZLE_32_4_4, SW.NO_SWIZZLE], f"NV swizzle {sw}")
            u = q.contiguous().view(torch.uint8)
            codes = torch.stack([u & 15, u >> 4], dim=-1).reshape(rows, k).long()
            val = _E2M1_POS[codes & 7] * torch.where(codes >= 8, -1.0, 1.0)
            bs = _unswizzle(blk.reshape(-1).view(torch.uint8), rows, k // 16).contiguous()
            dec = (bs.view(torch.float8_e4m3fn).float() * gl.reshape(())).double()
            deqs.append((val.reshape(rows, k // 16, 16) * dec[..., None]).reshape(rows, k))
    else:
        raise ContractError(f"scaling configuration {ra} {rb}")
    res = deqs[0] @ deqs[1].t()
    if bias is not None:
        res = res + bias.double()
    CALLS.append(dict(A=(_snap(mat_a), [_snap(t) for t in sa]), B=(_snap(mat_b), [_snap(t) for t in sb]),
                      dtype=output_dtype, bias=bias is not None))
    return round_to(res, output_dtype)


# ----------------------------------------------------------------------------------------------
# cases
MKN = 128


SEED = int(os.environ.get("SET18_SEED", "1234"))


def make_case(tokens, seed=None):
    """plain case: M = K = N = 128, bf16, Gaussian, one fwd+bwd; each token changes one thing.
    'K != N' (used for the correct files only) takes M, K, N = 96, 160, 64, so every scale matrix
    needs padding in both directions."""
    gen = torch.Generator().manual_seed(SEED if seed is None else seed)
    M, K, N = (96, 160, 64) if "K != N" in tokens else (MKN, MKN, MKN)
    rnd = lambda *s: torch.randn(*s, generator=gen)
    xd = torch.float32 if "fp32 input" in tokens else torch.bfloat16
    wd = torch.float32 if "fp32 weight" in tokens else torch.bfloat16
    shape = (2, M // 2, K) if "N-D input" in tokens else (M, K)

    def x_data():
        x = rnd(*shape)
        x2 = x.view(-1, K)
        if "data:zeros" in tokens:
            x.zero_()
        if "data:zero_rows" in tokens:
            x2[32:64] = 0
        if "data:large" in tokens:
            x *= 1000
        if "data:tiny" in tokens:
            x.copy_(torch.sign(x) * torch.exp2(-10 - 20 * torch.rand(*shape, generator=gen)))
        if "data:outlier_row" in tokens:
            x2[3] *= 1e4
        if "data:nan" in tokens:
            x2[5, 7] = math.nan
        return x.to(xd)

    def g_data():
        if "non-contiguous grad_output" in tokens:
            assert len(shape) == 2
            return rnd(N, M).t().to(xd)
        return rnd(*shape[:-1], N).to(xd)

    c = dict(tokens=tokens, w=rnd(N, K).to(wd), b=(rnd(N).to(wd) if "bias" in tokens else None),
             calls=[(x_data(), g_data())])
    if "second call" in tokens:
        c["dw"] = (0.05 * rnd(N, K)).to(wd)
        c["calls"].append((x_data(), g_data()))
    return c


# ----------------------------------------------------------------------------------------------
# running an implementation
_counter = [0]


def load(impl):
    path, name = impl.split(":")
    _counter[0] += 1
    spec = importlib.util.spec_from_file_location(f"_s18_mod{_counter[0]}", os.path.join(ROOT, path))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return getattr(mod, name)


def run(entry, case):
    """-> (results of the last call [out, gi, gw, gb], GEMM records of that call, exception or None, ncalls)."""
    obj = load(entry["impl"])
    lin = nn.Linear(case["w"].shape[1], case["w"].shape[0], bias=case["b"] is not None)
    with torch.no_grad():
        lin.weight = nn.Parameter(case["w"].clone())
        if case["b"] is not None:
            lin.bias = nn.Parameter(case["b"].clone())
    form = entry["form"]
    if form == "function":
        takes_bias = "bias" in inspect.signature(obj).parameters
        assert takes_bias or case["b"] is None, "function without bias parameter run on a bias case"
        fwd = (lambda x: obj(x, lin.weight, lin.bias)) if takes_bias else (lambda x: obj(x, lin.weight))
    elif form == "module":
        mod = obj.from_float(lin)
        fwd = mod
    else:
        model = obj(nn.Sequential(lin))
        fwd = model
    res, err = None, None
    for i, (x0, g) in enumerate(case["calls"]):
        if i > 0:
            with torch.no_grad():
                lin.weight.add_(case["dw"])
            lin.weight.grad = None
            if lin.bias is not None:
                lin.bias.grad = None
        del CALLS[:]
        x = x0.clone().requires_grad_(True)
        try:
            out = fwd(x)
        except Exception as e:  # noqa: BLE001
            return None, list(CALLS), e, len(CALLS)
        res = [out.detach(), None, None, None]
        try:
            out.backward(g)
        except Exception as e:  # noqa: BLE001
            err = e
        res[1:] = [x.grad, lin.weight.grad, None if lin.bias is None else lin.bias.grad]
        if err is not None:
            break
    return res, list(CALLS), err, len(CALLS)


def same(a, b):
    if a is None or b is None:
        return a is None and b is None
    if a.dtype != b.dtype or a.shape != b.shape or a.stride() != b.stride():
        return False
    bothnan = a.isnan() & b.isnan()
    ia = a.contiguous().view(torch.int16 if a.element_size() == 2 else torch.int32)
    ib = b.contiguous().view(torch.int16 if b.element_size() == 2 else torch.int32)
    return bool(((ia == ib) | bothnan).all())


def diff_operands(r1, r2):
    out = []
    for k in ("A", "B"):
        (d1, s1), (d2, s2) = r1[k], r2[k]
        eq = _snapeq(d1, d2) and len(s1) == len(s2) and all(_snapeq(p, q) for p, q in zip(s1, s2))
        if not eq:
            out.append(k)
    return out


def _snapeq(p, q):
    return p[:3] == q[:3] and p[3].shape == q[3].shape and torch.equal(p[3], q[3])


GEMMS = ["output", "grad_input", "grad_weight"]
CASES_FOR_CORRECT = [[], ["fp32 input"], ["fp32 weight"], ["bias"], ["second call"], ["N-D input"],
                     ["non-contiguous grad_output"], ["data:zeros"], ["data:zero_rows"], ["data:nan"],
                     ["data:large"], ["data:tiny"], ["data:outlier_row"], ["K != N"], ["K != N", "N-D input"],
                     ["K != N", "bias", "fp32 input"]]


def applicable(entry, tokens):
    if entry["form"] == "function" and "N-D input" in tokens:
        return False
    if "bias" in tokens and entry["form"] == "function" and "bias" not in inspect.signature(load(entry["impl"])).parameters:
        return False
    if entry["recipe"] == "nvfp4" and "data:nan" in tokens:
        return False  # MX-SPEC defines no NaN behaviour for NVFP4
    return True


def check_correct(entry):
    problems = []
    for tokens in CASES_FOR_CORRECT:
        if not applicable(entry, tokens):
            continue
        case = make_case(tokens)
        res, calls, err, ncalls = run(entry, case)
        if err is not None:
            problems.append(f"{tokens}: raised {err!r}")
            continue
        if ncalls != 3:
            problems.append(f"{tokens}: {ncalls} scaled_mm calls")
        x, g = case["calls"][-1]
        w = case["w"] + case["dw"] if "second call" in tokens else case["w"]
        ref = ref_layer(entry["recipe"], case, x, w, case["b"], g)
        for nm, a, b in zip(["output", "grad_input", "grad_weight", "grad_bias"], res, ref):
            if not same(a, b):
                problems.append(f"{tokens}: {nm} differs from the float64 reference")
    return problems


def first_diff(r1, r2):
    for i, nm in enumerate(GEMMS):
        if not same(r1[i], r2[i]):
            return nm
    return None


def check_bug(entry, twin):
    problems = []
    tokens = entry["trigger"]
    case = make_case(tokens)
    rt, ct, et, nt = run(twin, case)
    if et is not None:
        return [f"twin raised on the trigger case: {et!r}"]
    rb, cb, eb, nb = run(entry, case)
    if entry["category"] == "crash":
        if eb is None:
            problems.append("does not raise on its trigger case")
        elif GEMMS[nb] != entry["gemm"]:
            problems.append(f"raises before GEMM {GEMMS[nb]}, labelled {entry['gemm']}")
        else:
            for i in range(nb):
                if not same(rt[i], rb[i]) if rb else False:
                    problems.append("earlier GEMM result changed")
    else:
        if eb is not None and rb is None:
            return [f"raises in the forward: {eb!r}"]
        fd = first_diff(rt, rb)
        if fd != entry["gemm"]:
            problems.append(f"first differing GEMM {fd}, labelled {entry['gemm']}")
        if fd is None and same(rt[3], rb[3]):
            problems.append("no difference at all on the trigger case")
        if fd is not None:
            gi = GEMMS.index(fd)
            if gi < len(cb) and gi < len(ct):
                ops = diff_operands(ct[gi], cb[gi])
                if ops != sorted(entry["operands"]):
                    problems.append(f"differing operands {ops}, labelled {entry['operands']}")
            elif entry["operands"]:
                problems.append("labelled GEMM not called")
            op = entry["operand"]
            if entry["operands"] and op not in entry["operands"]:
                problems.append("operand not in operands")
            if not entry["operands"] and op != "result":
                problems.append("operand must be 'result' when no operand differs")
    if tokens:
        plain = make_case([])
        rt0, ct0, et0, _ = run(twin, plain)
        rb0, cb0, eb0, _ = run(entry, plain)
        if eb0 is not None:
            problems.append(f"raises on the plain case: {eb0!r}")
        elif not all(same(a, b) for a, b in zip(rt0, rb0)):
            problems.append("differs from its twin on the plain case although it has a trigger")
        elif len(ct0) != len(cb0) or any(diff_operands(p, q) for p, q in zip(ct0, cb0)):
            problems.append("GEMM operands differ on the plain case although it has a trigger")
    return problems


VOCAB = {"K == N", "K != N", "N-D input", "fp32 input", "fp32 weight", "second call", "bias",
         "non-contiguous input", "non-contiguous weight", "non-contiguous grad_output", "data:zeros",
         "data:zero_rows", "data:nan", "data:large", "data:tiny", "data:outlier_row"}


def main():
    F.scaled_mm = emulated_scaled_mm
    man = json.load(open(os.path.join(HERE, "manifest.json")))
    by = {e["name"]: e for e in man}
    bad = 0
    for e in man:
        try:
            assert set(e["trigger"]) <= VOCAB, "trigger token outside the vocabulary"
            if e["category"] == "none":
                probs = check_correct(e)
            else:
                probs = check_bug(e, by[e["twin"]])
        except Exception as ex:  # noqa: BLE001
            probs = [f"verify error: {ex!r}\n{traceback.format_exc()}"]
        bad += bool(probs)
        print(f"{'ok  ' if not probs else 'FAIL'} {e['name']:8s} {e['category']:12s} {e['gemm']!s:12s} {e['trigger']}"
              + ("" if not probs else "\n      " + "\n      ".join(probs)))
    n = len(man)
    print(f"verify: {n - bad}/{n} labels hold ({sum(e['category'] == 'none' for e in man)} correct, "
          f"{sum(e['category'] != 'none' for e in man)} bugs)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
