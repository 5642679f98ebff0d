"""Self-check of the frozen heldout13 set (CPU only).

Run from /work/main:
    OMP_NUM_THREADS=2 /work/main/.venv/bin/python property_tests/heldout13/verify.py

1. Every correct tensorwise / rowwise / rowwise_with_gw_hp file is bitwise equal to
   torchao 0.18 Float8Linear (output, grad_input, grad_weight, grad_bias) on CPU for
   bf16 and fp32 inputs, mixed weight dtype, bias, N-D and non-contiguous layouts, and
   a second call after an in-place weight update.
2. Every correct blockwise file is within a stated bound of a float64 emulation of the
   recipe, on its CPU path and on its CUDA code path (run on CPU through a stand-in for
   torch.nn.functional.scaled_mm that enforces cuBLASLt's layout rules).
3. Every correct file's recorded GEMM calls obey the SM90 _scaled_mm contract.
4. Every planted bug differs from its twin with its trigger (or raises, for crash bugs),
   first in the GEMM its manifest names, and does not differ without the trigger.
   Bugs marked devices ["cuda"] must be identical on CPU and instead be caught by the
   recorded-call contract check (layout, fast accumulation, dtype pairing).
"""
import contextlib
import importlib.util
import inspect
import json
import os
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "2")
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

torch.set_num_threads(2)
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
GEMMS = ("output", "grad_input", "grad_weight")
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
DT = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}

# ----------------------------------------------------------------------------- loading
_MODS = {}


def load(impl):
    path, attr = impl.rsplit(":", 1)
    if path not in _MODS:
        name = "h13_" + os.path.basename(path)[:-3]
        spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, path))
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        _MODS[path] = mod
    return _MODS[path], getattr(_MODS[path], attr)


# ----------------------------------------------------------------------------- cases
def base_case(recipe):
    if recipe == "blockwise":
        return dict(M=256, K=256, N=384, x="bf16", w="bf16", xl="C", wl="C", gl="C",
                    nd=False, bias=False, dist="normal", steps=1, seed=0)
    return dict(M=64, K=64, N=48, x="bf16", w="bf16", xl="C", wl="C", gl="C",
                nd=False, bias=False, dist="normal", steps=1, seed=0)


def apply_trigger(case, tok):
    c = dict(case)
    if tok == "non-contiguous input":
        c["xl"] = "T"
    elif tok == "non-contiguous weight":
        c["wl"] = "T"
    elif tok == "non-contiguous grad_output":
        c["gl"] = "T"
    elif tok == "K == N":
        c["N"] = c["K"]
    elif tok == "N-D input":
        c["nd"] = True
    elif tok == "fp32 input":
        c["x"] = "fp32"
    elif tok == "fp16 input":
        c["x"] = "fp16"
    elif tok == "fp32 weight":
        c["w"] = "fp32"
    elif tok == "second call":
        c["steps"] = 2
    elif tok == "bias":
        c["bias"] = True
    elif tok.startswith("data:"):
        c["dist"] = tok[5:]
    elif tok == "gpu only":
        pass
    else:
        raise ValueError(tok)
    return c


def _store(t, layout):
    """Same logical values, other storage: T = transposed storage (last two dims)."""
    if layout == "C":
        return t.contiguous()
    return t.transpose(-1, -2).contiguous().transpose(-1, -2)


def make_data(c, call):
    g = torch.Generator().manual_seed(1000 * c["seed"] + 17 * call + 3)
    M, K, N = c["M"], c["K"], c["N"]
    x = torch.randn(M, K, generator=g)
    d = c["dist"]
    if d == "zero_rows":
        x[: M // 4] = 0
        x[:, : K // 4] = 0
    elif d == "zeros":
        x.zero_()
    elif d == "tiny_amax":
        x = x * 1e-30
    elif d == "small_amax":
        x = x * 2.0 ** -16
    elif d == "large":
        x = x * 1000.0
    elif d == "outlier":
        x[:, 3] *= 100.0
    elif d == "outlier_row":
        x[5] *= 1e4
    w = torch.randn(N, K, generator=g) * K ** -0.5
    go = torch.randn(M, N, generator=g)
    b = torch.randn(N, generator=g)
    return x, w, go, b


def build(c):
    x, w, go, b = make_data(c, 0)
    lin = nn.Linear(c["K"], c["N"], bias=c["bias"], dtype=DT[c["w"]])
    with torch.no_grad():
        lin.weight = nn.Parameter(_store(w.to(DT[c["w"]]), c["wl"]))
        if c["bias"]:
            lin.bias = nn.Parameter(b.to(DT[c["w"]]))
    return lin


def _input(c, call):
    x, _, go, _ = make_data(c, call)
    xd = DT[c["x"]]
    x = x.to(xd)
    go = go.to(xd)
    if c["nd"]:
        x = x.reshape(2, c["M"] // 2, c["K"])
        go = go.reshape(2, c["M"] // 2, c["N"])
    x = _store(x, c["xl"]).requires_grad_()
    go = _store(go, c["gl"])
    return x, go


def make_runner(form, attr):
    """Return run(lin, x) -> output for the three plug-in forms."""
    if form == "function":
        has_bias = "bias" in inspect.signature(attr).parameters

        def run_fn(lin, x):
            x2 = x.reshape(-1, x.shape[-1])
            if has_bias:
                y = attr(x2, lin.weight, bias=lin.bias)
            else:
                y = attr(x2, lin.weight)
                if lin.bias is not None:
                    y = y + lin.bias.to(y.dtype)
            return y.reshape(*x.shape[:-1], y.shape[-1])
        return lambda lin: (lambda x: run_fn(lin, x))
    if form == "module":
        return lambda lin: attr.from_float(lin)
    if form == "converter":
        return lambda lin: attr(lin)
    if form == "torchao":
        from torchao.float8.config import Float8LinearConfig
        from torchao.float8.float8_linear import Float8Linear
        cfg = Float8LinearConfig.from_recipe_name(attr)
        return lambda lin: Float8Linear.from_float(lin, config=cfg)
    raise ValueError(form)


def WEIGHT_UPDATE(w):
    """In-place update between the two calls of a "second call" case."""
    w.mul_(1.5).add_(0.02)


def execute(form, attr, c):
    """Forward + backward (steps calls, in-place weight update between them).

    Returns dict(output, grad_input, grad_weight, grad_bias) of the last call, or
    dict(error=..., phase=forward|backward)."""
    torch.manual_seed(0)
    lin = build(c)
    layer = make_runner(form, attr)(lin)
    res = None
    for step in range(c["steps"]):
        if step:
            with torch.no_grad():
                WEIGHT_UPDATE(lin.weight)
        lin.weight.grad = None
        if lin.bias is not None:
            lin.bias.grad = None
        x, go = _input(c, step)
        try:
            y = layer(x)
        except Exception as e:  # noqa: BLE001
            return dict(error=f"{type(e).__name__}: {e}", phase="forward")
        try:
            y.backward(go)
        except Exception as e:  # noqa: BLE001
            return dict(error=f"{type(e).__name__}: {e}", phase="backward", output=y.detach(),
                        grad_input=None, grad_weight=None, grad_bias=None)
        res = dict(output=y.detach(), grad_input=x.grad, grad_weight=lin.weight.grad,
                   grad_bias=None if lin.bias is None else lin.bias.grad)
    return res


def same(a, b):
    if a is None or b is None:
        return a is None and b is None
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def first_diff(r1, r2):
    for k in GEMMS + ("grad_bias",):
        if not same(r1[k], r2[k]):
            return k
    return None


# ----------------------------------------------------------------------------- GPU contract
class Recorder(TorchDispatchMode):
    """Records aten._scaled_mm calls and checks them against the SM90 cuBLASLt rules."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._scaled_mm.default:
            names = [a.name for a in func._schema.arguments]
            full = dict(zip(names, args))
            full.update(kwargs)
            self.calls.append(dict(problems=_rules(full), fast=bool(full.get("use_fast_accum", False)),
                                   dtypes=(full["self"].dtype, full["mat2"].dtype)))
        return func(*args, **kwargs)


def _row_major(t):
    return t.dim() == 2 and t.stride(1) == 1 and t.stride(0) >= max(1, t.size(1))


def _col_major(t):
    return t.dim() == 2 and t.stride(0) == 1 and t.stride(1) >= max(1, t.size(0))


def _rules(a):
    p = []
    A, Bm, sa, sb = a["self"], a["mat2"], a["scale_a"], a["scale_b"]
    if not _row_major(A):
        p.append("A not row-major")
    if not _col_major(Bm):
        p.append("B not column-major")
    if A.size(1) % 16 or Bm.size(0) % 16 or Bm.size(1) % 16:
        p.append("dims not multiple of 16")
    if A.dtype not in (E4M3, E5M2) or Bm.dtype not in (E4M3, E5M2):
        p.append("fp8 format not supported by cuBLASLt on CUDA")
    if A.dtype == E5M2 and Bm.dtype == E5M2:
        p.append("e5m2 x e5m2")
    if a.get("out_dtype") is None:
        p.append("out_dtype not passed")
    if sa.dtype != torch.float32 or sb.dtype != torch.float32:
        p.append("scales not fp32")
    M, N = A.size(0), Bm.size(1)
    if not (sa.numel() == 1 and sb.numel() == 1):
        if tuple(sa.shape) != (M, 1) or tuple(sb.shape) != (1, N):
            p.append("bad rowwise scale shapes")
        elif not (sa.is_contiguous() and sb.is_contiguous()):
            p.append("rowwise scales not contiguous")
    if a.get("bias") is not None and a.get("out_dtype") == torch.float32:
        p.append("bias with fp32 output")
    return p


_FAKE_CALLS = []


def _fake_scaled_mm(mat_a, mat_b, scale_a, scale_recipe_a, scale_b, scale_recipe_b,
                    swizzle_a=None, swizzle_b=None, bias=None, output_dtype=torch.bfloat16,
                    contraction_dim=(), use_fast_accum=False):
    """CPU stand-in for F.scaled_mm (torch 2.11 CUDA, blockwise): checks the
    _scaled_mm_v2 layout rules, then emulates the block GEMM in fp32."""
    ST = F.ScalingType
    p = []
    M, K = mat_a.shape
    N = mat_b.shape[1]
    L4 = (K // 128 + 3) // 4 * 4
    if not _row_major(mat_a):
        p.append("A not row-major")
    if not _col_major(mat_b):
        p.append("B not column-major")
    if mat_a.dtype != E4M3 or mat_b.dtype != E4M3:
        p.append("blockwise needs e4m3 operands")
    if K % 128 or N % 128 or M % 128:
        p.append("dims not multiple of 128")
    sa, sb = scale_a, scale_b
    if scale_recipe_a != ST.BlockWise1x128:
        p.append("A recipe")
    if not (sa.shape == (M, K // 128) and sa.stride(0) == 1 and (sa.stride(1) == M or sa.shape[1] == 1)):
        p.append(f"scale_a layout {tuple(sa.shape)} {sa.stride()}")
    if scale_recipe_b == ST.BlockWise128x128:
        if not (sb.shape == (L4, N // 128) and sb.stride(0) == 1 and (sb.stride(1) == L4 or sb.shape[1] == 1)):
            p.append(f"scale_b layout {tuple(sb.shape)} {sb.stride()}")
        sbn = sb[: K // 128].repeat_interleave(128, dim=1)
    elif scale_recipe_b == ST.BlockWise1x128:
        if not (sb.shape == (N, K // 128) and sb.stride(0) == 1 and (sb.stride(1) == N or sb.shape[1] == 1)):
            p.append(f"scale_b layout {tuple(sb.shape)} {sb.stride()}")
        sbn = sb.t()
    else:
        p.append("B recipe")
        sbn = None
    if sa.dtype != torch.float32 or sb.dtype != torch.float32:
        p.append("scales not fp32")
    _FAKE_CALLS.append(dict(problems=p, fast=bool(use_fast_accum), dtypes=(mat_a.dtype, mat_b.dtype)))
    acc = torch.zeros(M, N)
    for kb in range(K // 128):
        ks = slice(kb * 128, (kb + 1) * 128)
        acc += (mat_a[:, ks].float() @ mat_b[ks].float()) * sa[:, kb:kb + 1] * sbn[kb:kb + 1]
    return acc.to(output_dtype)


@contextlib.contextmanager
def fake_cuda_path(mod):
    """Route a blockwise file's GEMMs through its CUDA branch with the stand-in above."""
    old_use, old_mm = mod._use_cublas, F.scaled_mm
    mod._use_cublas = lambda t: True
    F.scaled_mm = _fake_scaled_mm
    _FAKE_CALLS.clear()
    try:
        yield _FAKE_CALLS
    finally:
        mod._use_cublas, F.scaled_mm = old_use, old_mm


def recorded(entry, c):
    """Run once on CPU, recording GEMM calls (the CUDA branch for blockwise files)."""
    mod, attr = load(entry["impl"])
    if entry["recipe"] == "blockwise":
        with fake_cuda_path(mod) as calls:
            res = execute(entry["form"], attr, c)
            calls = list(calls)
    else:
        rec = Recorder()
        with rec:
            res = execute(entry["form"], attr, c)
        calls = rec.calls
    return res, calls


def contract_findings(calls):
    out = []
    for i, cl in enumerate(calls):
        gemm = GEMMS[i % 3] if i < 3 else f"call{i}"
        for p in cl["problems"]:
            out.append((gemm, p))
    return out


# ----------------------------------------------------------------------------- blockwise oracle
def _q64(v, gr, gc):
    """Recipe quantisation, written independently: values in float64 after dequantisation."""
    v = v.double()
    r, c = v.shape
    blk = v.reshape(r // gr, gr, c // gc, gc)
    amax = blk.abs().amax(dim=(1, 3), keepdim=True).clamp(min=1e-12)
    s32 = (448.0 / amax).float()                    # fp32 scale, division in float64
    q = (blk.float() * s32).clamp(-448, 448).to(E4M3).double()
    inv = (1.0 / s32).double()                      # fp32 reciprocal, as handed to the GEMM
    return (q * inv).reshape(r, c)


def blockwise_oracle(c):
    """float64 emulation of the recipe: returns (refs, absolute-product magnitudes)."""
    assert c["steps"] == 1 and not c["bias"]
    x, w, go, _ = make_data(c, 0)
    xd, wd = DT[c["x"]], DT[c["w"]]
    w = w.to(wd)
    x = x.to(xd).float()
    go = go.to(xd).float()
    w = w.float()
    xq = _q64(x, 1, 128)
    wq = _q64(w, 128, 128)
    gq = _q64(go, 1, 128)
    gtq = _q64(go.t().contiguous(), 1, 128)
    xmq = _q64(x, 128, 1)
    refs = dict(output=xq @ wq.t(), grad_input=gq @ wq, grad_weight=gtq @ xmq)
    mags = dict(output=xq.abs() @ wq.abs().t(), grad_input=gq.abs() @ wq.abs(),
                grad_weight=gtq.abs() @ xmq.abs())
    return refs, mags


def within_bound(got, ref, mag):
    """|got - ref| <= 2^-8 |ref| + 2^-12 (|A| @ |B|): one bf16 rounding of the result
    (unit roundoff 2^-9) and fp32 accumulation over K (K * 2^-24 <= 2^-14 for K <= 1024),
    with a factor-2/4 margin."""
    d = (got.double().reshape(ref.shape) - ref).abs()
    return bool((d <= 2.0 ** -8 * ref.abs() + 2.0 ** -12 * mag).all()), float(d.max())


# ----------------------------------------------------------------------------- checks
FAILS = []


def check(ok, msg):
    if not ok:
        FAILS.append(msg)
        print("  FAIL", msg)
    return ok


def check_correct(entry):
    mod, attr = load(entry["impl"])
    rec = entry["recipe"]
    base = base_case(rec)
    if rec != "blockwise":
        variants = [
            dict(),
            dict(x="fp32", w="fp32", bias=True),
            dict(bias=True, xl="T"),
            dict(nd=True, bias=True, gl="T"),
            dict(w="fp32", dist="outlier"),
            dict(x="fp32", wl="T", steps=2),
            dict(steps=2, bias=True, dist="zero_rows"),
        ]
        n = 0
        for v in variants:
            c = dict(base, **v)
            mine = execute(entry["form"], attr, c)
            ref = execute("torchao", rec, c)
            check("error" not in mine, f"{entry['name']} raised on {v}: {mine.get('error')}")
            if "error" in mine or "error" in ref:
                check("error" not in ref, f"torchao raised on {v}: {ref.get('error')}")
                continue
            d = first_diff(mine, ref)
            check(d is None, f"{entry['name']} != torchao {rec} in {d} for {v}")
            n += 1
        _, calls = recorded(entry, dict(base, bias=True, xl="T", wl="T", gl="T"))
        f = contract_findings(calls)
        check(not f and len(calls) == (2 if rec == "rowwise_with_gw_hp" else 3),
              f"{entry['name']} GPU contract: {f} ({len(calls)} calls)")
        fast = [cl["fast"] for cl in calls]
        check(fast[:1] == [True] and not any(fast[1:]), f"{entry['name']} fast-accum pattern {fast}")
        print(f"  {entry['name']}: bitwise equal to torchao on {n} cases, GPU contract clean")
        return
    # blockwise
    variants = [dict(), dict(x="fp32", w="fp32"), dict(nd=True, xl="T", gl="T"), dict(w="fp32", dist="outlier")]
    worst = 0.0
    for v in variants:
        c = dict(base, **v)
        for path in ("cpu", "cuda-branch"):
            if path == "cpu":
                res = execute(entry["form"], attr, c)
                calls = []
            else:
                res, calls = recorded(entry, c)
            if not check("error" not in res, f"{entry['name']} raised ({path}) {v}: {res.get('error')}"):
                continue
            refs, mags = blockwise_oracle(c)
            for g in GEMMS:
                ok, dmax = within_bound(res[g], refs[g], mags[g])
                worst = max(worst, dmax)
                check(ok, f"{entry['name']} {g} outside bound ({path}) {v}: {dmax}")
            check(res["output"].dtype == DT[c["x"]], f"{entry['name']} output dtype {res['output'].dtype}")
            f = contract_findings(calls)
            check(not f, f"{entry['name']} cuda-branch contract: {f}")
    # bias + second call run end to end and match the plain run's bias handling
    c = dict(base, bias=True, steps=2)
    res = execute(entry["form"], attr, c)
    check("error" not in res, f"{entry['name']} bias/second call raised")
    print(f"  {entry['name']}: within bound of the float64 emulation (max |diff| {worst:.3g}), "
          f"CPU and CUDA-branch paths, CUDA-branch contract clean")


def check_bug(entry, twin):
    mod, attr = load(entry["impl"])
    tmod, tattr = load(twin["impl"])
    base = base_case(entry["recipe"])
    trig = [t for t in entry["trigger"]]
    ct = base
    for t in trig:
        ct = apply_trigger(ct, t)
    cuda_only = entry["devices"] == ["cuda"]
    name = entry["name"]
    extra_fp32 = []
    if "fp32 input" in trig and "fp32 weight" not in trig:
        extra_fp32 = [dict(ct, w="fp32")]
    if cuda_only:
        check("gpu only" in trig, f"{name}: cuda-only bug without 'gpu only' trigger")
        rb = execute(entry["form"], attr, ct)
        rt = execute(twin["form"], tattr, ct)
        check("error" not in rb and "error" not in rt and first_diff(rb, rt) is None,
              f"{name}: cuda-only bug differs or raises on CPU")
        _, cb = recorded(entry, ct)
        _, ctw = recorded(twin, ct)
        fb, ftw = contract_findings(cb), contract_findings(ctw)
        fastb, fastt = [c["fast"] for c in cb], [c["fast"] for c in ctw]
        gemm = None
        if fb:
            gemm = fb[0][0]
        elif fastb != fastt:
            gemm = GEMMS[[i for i in range(len(fastb)) if fastb[i] != fastt[i]][0]]
        check(not ftw, f"{name}: twin has contract findings {ftw}")
        check(gemm is not None, f"{name}: cuda-only bug not caught by the call contract")
        check(gemm == entry["gemm"], f"{name}: contract finding in {gemm}, manifest says {entry['gemm']}")
        non_gpu = [t for t in trig if t != "gpu only"]
        if non_gpu:
            _, cb0 = recorded(entry, base)
            _, ct0 = recorded(twin, base)
            check(not contract_findings(cb0) and [c["fast"] for c in cb0] == [c["fast"] for c in ct0],
                  f"{name}: contract finding without its trigger {non_gpu}")
        return f"cuda-only, caught by call contract in {gemm}: {fb[:1] or 'fast-accum ' + str(fastb)}"
    for cc in [ct] + extra_fp32:
        rb = execute(entry["form"], attr, cc)
        rt = execute(twin["form"], tattr, cc)
        check("error" not in rt, f"{name}: twin raised with trigger: {rt.get('error')}")
        if entry["category"] == "crash":
            ok = check("error" in rb, f"{name}: crash bug did not raise with trigger")
            if ok:
                want = "forward" if entry["gemm"] == "output" else "backward"
                check(rb["phase"] == want, f"{name}: raised in {rb['phase']}, manifest gemm {entry['gemm']}")
            what = rb.get("error", "")[:70]
        else:
            if "error" in rt or ("error" in rb and "output" not in rb):
                check(False, f"{name}: raised with trigger: {rb.get('error')}")
                continue
            d = first_diff(rb, rt)
            if "error" in rb:   # backward refused a malformed forward result: output must differ
                check(d == "output", f"{name}: raised in backward ({rb['error'][:60]}) with a correct output")
            check(d is not None, f"{name}: no difference with trigger {trig} ({cc['x']}/{cc['w']})")
            check(d == entry["gemm"], f"{name}: first difference in {d}, manifest says {entry['gemm']}")
            what = f"first diff {d}"
    if trig:
        rb = execute(entry["form"], attr, base)
        rt = execute(twin["form"], tattr, base)
        check("error" not in rb and first_diff(rb, rt) is None, f"{name}: differs without its trigger")
        if len(trig) > 1:
            for t in trig:
                c1 = apply_trigger(base, t)
                rb = execute(entry["form"], attr, c1)
                rt = execute(twin["form"], tattr, c1)
                check("error" not in rb and first_diff(rb, rt) is None,
                      f"{name}: differs with only {t!r} of its triggers")
    return what


def main():
    t0 = time.time()
    man = json.load(open(os.path.join(HERE, "manifest.json")))
    twins = json.load(open(os.path.join(HERE, "twins.json")))
    by = {e["name"]: e for e in man}
    only = set(sys.argv[1:])
    print("== correct implementations")
    for e in man:
        if e["category"] == "none" and (not only or e["name"] in only):
            check_correct(e)
    print("== planted bugs")
    nb = 0
    for e in man:
        if e["category"] == "none" or (only and e["name"] not in only):
            continue
        check(twins.get(e["name"]) in by, f"{e['name']}: no twin")
        what = check_bug(e, by[twins[e["name"]]])
        nb += 1
        print(f"  {e['name']:<28} {e['category']:<13} trigger={e['trigger']} -> {what}")
    ncor = sum(e["category"] == "none" for e in man)
    print(f"== {ncor} correct, {nb} bugs checked, {len(FAILS)} failures, {time.time() - t0:.0f}s")
    if FAILS:
        sys.exit(1)
    print("ALL OK")


if __name__ == "__main__":
    main()
