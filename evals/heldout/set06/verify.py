"""Self-check of the heldout6 set (CPU, torch + torchao only).

    cd /work/main && OMP_NUM_THREADS=2 .venv/bin/python property_tests/heldout6/verify.py

1. correct tensorwise / rowwise / rowwise_with_gw_hp implementations are bitwise
   equal to torchao 0.18 Float8Linear of the recipe (output, grad_input,
   grad_weight, grad_bias: values, dtype, shape, strides) on 14 cases each;
2. correct blockwise implementations are within a stated bound of an independent
   float64 emulation (and equal to each other bitwise);
3. every correct implementation respects the SM90 _scaled_mm layout contract
   (A row-major, B column-major, fast accumulation only in the output GEMM);
4. every buggy entry is run beside its correct twin on a case built from its
   trigger: the GEMMs before the manifest's gemm are identical and that GEMM
   differs (values, NaN, dtype, shape, strides) or raises; "gpu only" entries are
   checked through the recorded _scaled_mm calls instead. Each triggered entry is
   rerun with the trigger removed, and whether it still shows is reported.
"""
import importlib.util
import json
import os
import sys
import time
import traceback

os.environ.setdefault("OMP_NUM_THREADS", "2")
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
GEMMS = ("output", "grad_input", "grad_weight")

# --------------------------------------------------------------------------- loading

_loaded = {}


def load(impl):
    path, attr = impl.rsplit(":", 1)
    if path not in _loaded:
        name = "heldout6_" + os.path.splitext(os.path.basename(path))[0]
        spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, path))
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        _loaded[path] = mod
    return getattr(_loaded[path], attr)


def torchao_module(recipe):
    from torchao.float8.config import Float8LinearConfig
    from torchao.float8.float8_linear import Float8Linear
    cfg = Float8LinearConfig.from_recipe_name(recipe)
    return lambda lin: Float8Linear.from_float(lin, config=cfg)


# --------------------------------------------------------------------------- recording

class Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._scaled_mm.default:
            a, b = args[0], args[1]
            fast = kwargs.get("use_fast_accum", args[7] if len(args) > 7 else False)
            self.calls.append(dict(a_shape=tuple(a.shape), a_stride=a.stride(),
                                   b_shape=tuple(b.shape), b_stride=b.stride(), fast=bool(fast)))
        return func(*args, **kwargs)


def contract_violations(call, gemm):
    out = []
    if len(call["a_shape"]) != 2 or len(call["b_shape"]) != 2:
        return ["operand not 2-D: %s x %s" % (call["a_shape"], call["b_shape"])]
    (m, k), (k2, n) = call["a_shape"], call["b_shape"]
    sa, sb = call["a_stride"], call["b_stride"]
    if not (sa[1] == 1 and sa[0] >= max(k, 1)):
        out.append("A not row-major")
    if not (sb[0] == 1 and sb[1] >= max(k2, 1)):
        out.append("B not column-major")
    if k % 16 or n % 16:
        out.append("K or N not divisible by 16")
    if call["fast"] != (gemm == "output"):
        out.append("use_fast_accum=%s in %s" % (call["fast"], gemm))
    return out


# --------------------------------------------------------------------------- cases

BASE = {
    "tensorwise": dict(M=32, K=64, N=48),
    "rowwise": dict(M=32, K=64, N=48),
    "rowwise_with_gw_hp": dict(M=32, K=64, N=48),
    "blockwise": dict(M=256, K=256, N=384),
}

DT = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}


def make_case(recipe, tokens=(), seed=0):
    c = dict(BASE[recipe])
    c.update(recipe=recipe, xdt="bf16", wdt="bf16", nc_x=False, nc_w=False, nc_g=False,
             bias=False, nd=False, data=None, twice=False, seed=seed)
    for t in tokens:
        if t == "non-contiguous input":
            c["nc_x"] = True
        elif t == "non-contiguous weight":
            c["nc_w"] = True
        elif t == "non-contiguous grad_output":
            c["nc_g"] = True
        elif t == "K == N":
            c["N"] = c["K"]
        elif t == "N-D input":
            c["nd"] = True
        elif t == "fp32 input":
            c["xdt"] = c["wdt"] = "fp32"
        elif t == "fp16 input":
            c["xdt"] = c["wdt"] = "fp16"
        elif t == "fp32 weight":
            c["wdt"] = "fp32"
        elif t == "second call":
            c["twice"] = True
        elif t == "bias":
            c["bias"] = True
        elif t == "gpu only":
            pass
        elif t.startswith("data:"):
            c["data"] = t[5:]
        else:
            raise ValueError("unknown trigger token %r" % t)
    return c


def _apply_data(x, kind):
    if kind is None:
        return x
    if kind == "zero_rows":
        x[0] = 0
        x[5] = 0
    elif kind == "tiny":                    # amax far below the 1e-12 amax floor
        x.mul_(1e-14)
    elif kind == "outlier":                 # one token 1000x larger
        x[3].mul_(1000.0)
    elif kind == "large":                   # magnitudes well above 448 before scaling
        x.mul_(1000.0)
    elif kind in ("negative_peak", "positive_peak"):
        peak = 1.5 * x.abs().max()
        x[1, 2] = -peak if kind == "negative_peak" else peak
    else:
        raise ValueError(kind)
    return x


def tensors(c, call=0):
    """Data for one call of a case (call 1 = the second call)."""
    g = torch.Generator().manual_seed(1000 * c["seed"] + 17 * call + 1)
    M, K, N = c["M"], c["K"], c["N"]
    x = _apply_data(torch.randn(M, K, generator=g), c["data"])
    go = torch.randn(M, N, generator=g)
    xdt, wdt = DT[c["xdt"]], DT[c["wdt"]]
    x = x.to(xdt)
    if c["nc_x"]:
        x = x.t().contiguous().t()
    go = go.to(xdt)
    if c["nc_g"]:
        go = go.t().contiguous().t()
    if c["nd"]:
        x = x.reshape(2, M // 2, K)
        go = go.reshape(2, M // 2, N)
    return x, go


def params(c):
    g = torch.Generator().manual_seed(1000 * c["seed"] + 7)
    M, K, N = c["M"], c["K"], c["N"]
    w = (torch.randn(N, K, generator=g) / K ** 0.5).to(DT[c["wdt"]])
    if c["nc_w"]:
        w = w.t().contiguous().t()
    b = (torch.randn(N, generator=g) * 0.1).to(DT[c["wdt"]]) if c["bias"] else None
    dw = (torch.randn(N, K, generator=g) / K ** 0.5).to(DT[c["wdt"]])
    return w, b, dw


# --------------------------------------------------------------------------- running

def build(impl, form, w, b):
    """Return (callable(x) -> y, weight parameter, bias parameter)."""
    N, K = w.shape
    with torch.device("meta"):
        lin = nn.Linear(K, N, bias=b is not None)
    lin.weight = nn.Parameter(w)
    lin.bias = nn.Parameter(b) if b is not None else None
    if form == "function":
        fn = load(impl) if isinstance(impl, str) else impl
        return (lambda x: fn(x, lin.weight, lin.bias)), lin.weight, lin.bias
    if form == "module":
        make = (lambda l: load(impl).from_float(l)) if isinstance(impl, str) else impl
        m = make(lin)
        return m, m.weight, m.bias
    if form == "converter":
        conv = load(impl)
        root = conv(nn.Sequential(lin))
        return root, lin.weight, lin.bias
    raise ValueError(form)


def _exc(e):
    return "%s: %s" % (type(e).__name__, str(e).splitlines()[0][:120] if str(e) else "")


def run(impl, form, c, drive):
    """drive: 'full' (everything requires grad), 'gi' (only input) or 'gw' (only weight).

    Returns (list over calls of {gemm: tensor | ('raise', msg)}, recorded calls per call).
    """
    w, b, dw = params(c)
    results, records = [], []
    try:
        f, wp, bp = build(impl, form, w.clone(), None if b is None else b.clone())
    except Exception as e:  # noqa: BLE001
        r = {k: ("raise", _exc(e)) for k in GEMMS + ("grad_bias",)}
        return [r] * (2 if c["twice"] else 1), [[]]
    wp.requires_grad_(drive in ("full", "gw"))
    if bp is not None:
        bp.requires_grad_(drive == "full")
    for call in range(2 if c["twice"] else 1):
        if call == 1:
            with torch.no_grad():
                wp.add_(dw)
        x, go = tensors(c, call)
        x = x.detach().clone()
        x.requires_grad_(drive in ("full", "gi"))
        r = {}
        rec = Recorder()
        with rec:
            try:
                y = f(x)
                r["output"] = y.detach()
            except Exception as e:  # noqa: BLE001
                r = {k: ("raise", _exc(e)) for k in GEMMS + ("grad_bias",)}
                results.append(r)
                records.append(rec.calls)
                continue
            inputs, names = [], []
            if x.requires_grad:
                inputs.append(x)
                names.append("grad_input")
            if wp.requires_grad:
                inputs.append(wp)
                names.append("grad_weight")
            if bp is not None and bp.requires_grad:
                inputs.append(bp)
                names.append("grad_bias")
            try:
                if y.shape != go.shape:
                    raise RuntimeError("output shape %s != %s" % (tuple(y.shape), tuple(go.shape)))
                grads = torch.autograd.grad(y, inputs, grad_outputs=go.to(y.dtype))
                for n_, g_ in zip(names, grads):
                    r[n_] = g_
            except Exception as e:  # noqa: BLE001
                for n_ in names:
                    r[n_] = ("raise", _exc(e))
        results.append(r)
        records.append(rec.calls)
    return results, records


def same(a, b):
    """(equal?, reason)"""
    ra, rb = isinstance(a, tuple), isinstance(b, tuple)
    if ra or rb:
        if ra and rb:
            return True, "both raise"
        return False, "raises: " + (a[1] if ra else b[1])
    if a.dtype != b.dtype:
        return False, "dtype %s vs %s" % (a.dtype, b.dtype)
    if a.shape != b.shape:
        return False, "shape %s vs %s" % (tuple(a.shape), tuple(b.shape))
    if a.stride() != b.stride():
        return False, "strides %s vs %s" % (a.stride(), b.stride())
    na, nb = torch.isnan(a), torch.isnan(b)
    if not torch.equal(na, nb):
        return False, "NaN pattern differs (%d vs %d NaN)" % (int(na.sum()), int(nb.sum()))
    if not torch.equal(a[~na], b[~nb]):
        d = (a[~na].double() - b[~nb].double()).abs()
        return False, "values differ (%d elements, max abs %.3g)" % (int((d > 0).sum()), float(d.max()))
    return True, "equal"


# --------------------------------------------------------------------------- checks

PASS = FAIL = 0
LOG = []


def check(ok, msg):
    global PASS, FAIL
    if ok:
        PASS += 1
    else:
        FAIL += 1
    LOG.append(("ok  " if ok else "FAIL") + " " + msg)
    print(("ok  " if ok else "FAIL") + " " + msg, flush=True)


REF_CASES = [
    [], ["fp32 input"], ["fp16 input"], ["fp32 weight", "bias"], ["non-contiguous input"],
    ["non-contiguous weight"], ["non-contiguous grad_output"], ["K == N", "bias"],
    ["data:zero_rows"], ["data:outlier"], ["N-D input", "bias"], ["data:tiny"],
    ["N-D input", "fp32 weight"], ["fp16 input", "fp32 weight", "bias"],
]


def check_contract(name, recs_by_drive):
    bad = []
    for drive, recs in recs_by_drive.items():
        for calls in recs:
            labels = ["output"] + (["grad_input"] if drive in ("full", "gi") else []) + \
                     (["grad_weight"] if drive in ("full", "gw") else [])
            for call, gemm in zip(calls, labels):
                v = contract_violations(call, gemm)
                if v:
                    bad.append("%s/%s: %s" % (drive, gemm, ", ".join(v)))
    return bad


def check_correct_vs_torchao(entry):
    recipe = entry["recipe"]
    ref = torchao_module(recipe)
    for i, toks in enumerate(REF_CASES):
        c = make_case(recipe, toks, seed=i)
        got, recs = run(entry["impl"], entry["form"], c, "full")
        exp, _ = run(ref, "module", c, "full")
        reasons = []
        for k in GEMMS + ("grad_bias",):
            if k not in exp[0] and k not in got[0]:
                continue
            ok, why = same(got[0].get(k), exp[0].get(k)) if k in got[0] and k in exp[0] else (False, "missing")
            if not ok:
                reasons.append("%s: %s" % (k, why))
        bad = check_contract(entry["name"], {"full": recs})
        check(not reasons and not bad, "%s == torchao:%s on %s%s" % (
            entry["name"], recipe, toks or ["base"], ("  <- " + "; ".join(reasons + bad)) if reasons or bad else ""))


# independent float64 emulation of the blockwise recipe --------------------------------

def _q_tiles64(t, tr, tc):
    """quantize [R, C] in (tr, tc) tiles as the recipe says (fp32 scale 448/amax, amax
    floored at 1e-12, saturating e4m3 cast); return the dequantized values in fp64."""
    R, C = t.shape
    tiles = t.to(torch.float32).unfold(0, tr, tr).unfold(1, tc, tc)      # [R/tr, C/tc, tr, tc]
    amax = tiles.abs().flatten(2).max(dim=2).values.to(torch.float64)
    s = (448.0 / torch.where(amax > 1e-12, amax, torch.full_like(amax, 1e-12))).to(torch.float32)
    q = (tiles * s[:, :, None, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    deq = q.to(torch.float64) * s.reciprocal().to(torch.float64)[:, :, None, None]
    return deq.permute(0, 2, 1, 3).reshape(R, C)


def blockwise_oracle(x2, w, go2):
    xd = _q_tiles64(x2, 1, 128)
    wd = _q_tiles64(w, 128, 128)
    gd = _q_tiles64(go2, 1, 128)
    gtd = _q_tiles64(go2.t(), 1, 128)       # tiles along M for grad_weight
    xcd = _q_tiles64(x2, 128, 1)
    out = xd @ wd.t()
    gi = gd @ wd
    gw = gtd @ xcd
    mag = dict(output=xd.abs() @ wd.abs().t(), grad_input=gd.abs() @ wd.abs(), grad_weight=gtd.abs() @ xcd.abs())
    return dict(output=out, grad_input=gi, grad_weight=gw), mag


def check_correct_blockwise(entry, twin_results):
    cases = [[], ["bias"], ["non-contiguous input"], ["non-contiguous weight"],
             ["non-contiguous grad_output"], ["K == N"], ["data:zero_rows"], ["data:outlier"],
             ["fp32 weight", "bias"], ["fp32 input"]]
    if entry["form"] != "function":
        cases.append(["N-D input", "bias"])
    for i, toks in enumerate(cases):
        c = make_case("blockwise", toks, seed=i)
        got, recs = run(entry["impl"], entry["form"], c, "full")
        g = got[0]
        x, go = tensors(c)
        w, b, _ = params(c)
        K, N = c["K"], c["N"]
        ref, mag = blockwise_oracle(x.reshape(-1, K), w, go.reshape(-1, N))
        extra = {k: 0.0 for k in GEMMS}
        if b is not None:
            # the bias is added after the bf16 rounding of the GEMM: one more rounding
            ref["output"] = ref["output"] + b.to(x.dtype).double()
            extra["output"] = 2.0 ** -8 * (ref["output"].abs() + (ref["output"] - b.to(x.dtype).double()).abs())
        reasons = []
        expect_dtype = dict(output=x.dtype, grad_input=x.dtype, grad_weight=w.dtype)
        expect_shape = dict(output=tuple(x.shape[:-1]) + (N,), grad_input=tuple(x.shape), grad_weight=tuple(w.shape))
        for k in GEMMS:
            t = g.get(k)
            if isinstance(t, tuple) or t is None:
                reasons.append("%s raised %s" % (k, t))
                continue
            if t.dtype != expect_dtype[k] or tuple(t.shape) != expect_shape[k] or not t.is_contiguous():
                reasons.append("%s contract: %s %s %s" % (k, t.dtype, tuple(t.shape), t.stride()))
            r = ref[k]
            err = (t.double().reshape(r.shape) - r).abs()
            # bound: bf16 rounding of the result (2^-8 relative) + fp32 accumulation
            # (1e-5 of sum |a||b|) + with a bias, one more rounding of the sum
            bound = 2.0 ** -8 * r.abs() + 1e-5 * mag[k] + extra[k] + 1e-30
            if not bool((err <= bound).all()) or bool(torch.isnan(t).any()):
                reasons.append("%s: max err/bound %.3g" % (k, float((err / bound).max())))
        if b is not None and isinstance(g.get("grad_bias"), torch.Tensor):
            gb = g["grad_bias"]
            if gb.dtype != b.dtype or gb.shape != b.shape:
                reasons.append("grad_bias contract")
        key = tuple(toks)
        if key in twin_results:
            for k in GEMMS:
                ok, why = same(g.get(k), twin_results[key].get(k))
                if not ok:
                    reasons.append("%s differs from the other blockwise implementation: %s" % (k, why))
        else:
            twin_results[key] = g
        check(not reasons, "%s within the fp64 emulation bound on %s%s" % (
            entry["name"], toks or ["base"], ("  <- " + "; ".join(reasons)) if reasons else ""))


# buggy entries --------------------------------------------------------------------------

_TWIN_CACHE = {}


def _results_per_gemm(impl, form, c, cache=False):
    """Per call: {gemm: value} from two isolated drives (only the input, only the weight
    requires grad). Correct twins are deterministic, so their results are cached."""
    key = (impl, form, tuple(sorted(c.items())))
    if cache and key in _TWIN_CACHE:
        return _TWIN_CACHE[key]
    rgi, rec_gi = run(impl, form, c, "gi")
    rgw, rec_gw = run(impl, form, c, "gw")
    calls = []
    for a, b_ in zip(rgi, rgw):
        calls.append(dict(output=a["output"], grad_input=a.get("grad_input"), grad_weight=b_.get("grad_weight")))
    if cache:
        _TWIN_CACHE[key] = (calls, {"gi": rec_gi, "gw": rec_gw})
    return calls, {"gi": rec_gi, "gw": rec_gw}


def compare_bug(entry, twin, c):
    """Return (first differing gemm or None, reasons dict, contract violations bug-only)."""
    bug_calls, bug_recs = _results_per_gemm(entry["impl"], entry["form"], c)
    ok_calls, ok_recs = _results_per_gemm(twin["impl"], twin["form"], c, cache=True)
    first, reasons = None, {}
    for ci, (bc, oc) in enumerate(zip(bug_calls, ok_calls)):
        for k in GEMMS:
            eq, why = same(bc[k], oc[k])
            if not eq:
                reasons["call%d/%s" % (ci + 1, k)] = why
                if first is None:
                    first = (ci + 1, k)
    vb = check_contract(entry["name"], bug_recs)
    vo = check_contract(twin["name"], ok_recs)
    return first, reasons, [v for v in vb if v not in vo]


def check_bug(entry, twin):
    tokens = entry["trigger"]
    gpu_only = "gpu only" in tokens
    c_on = make_case(entry["recipe"], tokens, seed=3)
    first, reasons, extra_viol = compare_bug(entry, twin, c_on)
    label = entry["gemm"]
    if gpu_only:
        want = [v for v in extra_viol if v.split(":")[0].split("/")[1] == label]
        earlier = [v for v in extra_viol if GEMMS.index(v.split(":")[0].split("/")[1]) < GEMMS.index(label)]
        ok = bool(want) and not earlier
        check(ok, "%s: on the CPU values %s; GPU contract broken in %s: %s" % (
            entry["name"], "identical" if first is None else "differ first in %s" % (first,),
            label, want or extra_viol or "nothing"))
    else:
        ok = first is not None and first[1] == label
        if ok and c_on["twice"]:
            ok = first[0] == 2
        detail = "; ".join("%s %s" % kv for kv in list(reasons.items())[:3])
        check(ok, "%s: first wrong %s (label %s, trigger %s) %s" % (
            entry["name"], first, label, tokens or "none", detail))
    if tokens:
        off = [t for t in tokens if t not in ("gpu only",)]
        removed = []
        for t in off:
            removed.append("data:positive_peak" if t == "data:negative_peak" else None)
        c_off = make_case(entry["recipe"], [r for r in removed if r], seed=3)
        first_off, reasons_off, viol_off = compare_bug(entry, twin, c_off)
        # on the CPU a "gpu only" entry shows through its values; with its other
        # conditions removed it must not break the GPU contract either
        shows = first_off is not None or (gpu_only and len(off) > 0 and bool(viol_off))
        check(not shows, "%s: trigger removed -> %s" % (
            entry["name"], "still shows (%s)" % (first_off or viol_off,) if shows else "hidden"))


def main():
    t0 = time.time()
    manifest = json.load(open(os.path.join(HERE, "manifest.json")))
    by_name = {e["name"]: e for e in manifest}
    for e in manifest:
        mod_path = os.path.join(ROOT, e["impl"].rsplit(":", 1)[0])
        check(os.path.exists(mod_path), "%s file exists" % e["name"])
    twin_results = {}
    for e in manifest:
        if e["category"] != "none":
            continue
        try:
            if e["recipe"] == "blockwise":
                check_correct_blockwise(e, twin_results)
            else:
                check_correct_vs_torchao(e)
        except Exception:  # noqa: BLE001
            check(False, "%s crashed the check:\n%s" % (e["name"], traceback.format_exc()))
    for e in manifest:
        if e["category"] == "none":
            continue
        try:
            check_bug(e, by_name[e["twin"]])
        except Exception:  # noqa: BLE001
            check(False, "%s crashed the check:\n%s" % (e["name"], traceback.format_exc()))
    print("TOTAL: %d passed, %d failed, %d checks (%.0f s)" % (PASS, FAIL, PASS + FAIL, time.time() - t0))
    return 1 if FAIL else 0


if __name__ == "__main__":
    sys.exit(main())
