"""Self-check of the heldout5 set (CPU only, torch + torchao only).

Run from the repository root:
    /work/main/.venv/bin/python property_tests/heldout5/verify.py

1. Every correct implementation of the tensorwise, rowwise and rowwise_with_gw_hp recipes
   is compared BITWISE with torchao 0.18's Float8Linear of the same recipe (output,
   grad_input, grad_weight, grad_bias; dtype, shape and strides too) on a grid of small cases.
   Blockwise implementations are compared with a float64 emulation of the recipe written
   here: |impl - ref| <= 2^-7 * |ref| + 2^-12 * max|ref| elementwise (the result is rounded
   to bf16 once; the fp32 accumulation adds far less than the absolute term).
2. Every buggy entry is run beside its correct twin on a case built from its manifest
   trigger: the GEMMs before the manifest's `gemm` must be identical, and that GEMM must
   differ (values, NaN pattern, dtype, shape or strides) or the implementation must raise.
   Entries with devices == ["cuda"] are skipped (they cannot show on a CPU).
"""
import copy
import importlib.util
import json
import math
import os
import sys
import time
import warnings

import torch
import torch.nn as nn

warnings.filterwarnings("ignore")
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
GEMMS = ("output", "grad_input", "grad_weight")

# ----------------------------------------------------------------------------- loading


def load(impl):
    path, attr = impl.rsplit(":", 1)
    full = os.path.join(ROOT, path)
    name = "heldout5_" + os.path.splitext(os.path.basename(full))[0]
    spec = importlib.util.spec_from_file_location(name, full)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return getattr(mod, attr)


class Runner:
    """Builds the layer of one plug-in form around a given nn.Linear."""

    def __init__(self, obj, form):
        self.obj, self.form = obj, form

    def build(self, lin):
        if self.form == "function":
            f = self.obj
            return lambda x: f(x, lin.weight)
        if self.form == "module":
            return self.obj.from_float(lin)
        if self.form == "converter":
            root = nn.Sequential(lin)
            return self.obj(root)
        raise ValueError(self.form)


def torchao_runner(recipe):
    from torchao.float8 import Float8LinearConfig
    from torchao.float8.float8_linear import Float8Linear

    cfg = Float8LinearConfig.from_recipe_name(recipe)

    class _R:
        form = "module"

        def build(self, lin):
            return Float8Linear.from_float(lin, config=cfg)

    return _R()


# ----------------------------------------------------------------------------- cases

BASE = dict(M=32, K=64, N=48, lead=None, in_dtype=torch.bfloat16, w_dtype=torch.bfloat16,
            bias=False, nc_input=False, nc_weight=False, nc_go=False, data="normal", seed=0)
BLOCK = dict(M=256, K=256, N=128)


def make_case(**kw):
    c = dict(BASE)
    c.update(kw)
    return c


def _shaped(shape, dtype, noncontig, gen, scale=1.0):
    if not noncontig:
        t = torch.randn(*shape, generator=gen) * scale
        return t.to(dtype)
    # same logical shape, stored with the last two dims swapped
    sw = list(shape[:-2]) + [shape[-1], shape[-2]]
    t = (torch.randn(*sw, generator=gen) * scale).to(dtype)
    return t.transpose(-1, -2)


def make_tensors(c, call=0):
    gen = torch.Generator().manual_seed(1000 * c["seed"] + 17 * call + 1)
    M, K, N = c["M"], c["K"], c["N"]
    xshape = [M, K] if not c["lead"] else list(c["lead"]) + [K]
    x = _shaped(xshape, torch.float32, c["nc_input"], gen)
    d = c["data"]
    with torch.no_grad():
        if d == "zero_rows":
            for r in (1, 5):
                x[(r,) if x.dim() == 2 else (r % x.shape[0], r)] = 0
        elif d == "outlier_row":
            x[(3,) if x.dim() == 2 else (0, 3)] *= 1e4
        elif d == "zeros":
            x.zero_()
        elif d == "tiny":
            x.mul_(1e-7)
        elif d == "negative":
            x.copy_(-x.abs())
    x = x.to(c["in_dtype"]).detach().requires_grad_()
    w = _shaped([N, K], torch.float32, c["nc_weight"], gen, scale=K ** -0.5).to(c["w_dtype"])
    b = (torch.randn(N, generator=gen) * 0.1).to(c["w_dtype"]) if c["bias"] else None
    gshape = xshape[:-1] + [N]
    go = _shaped(gshape, torch.float32, c["nc_go"], gen).to(c["in_dtype"])
    return x, w, b, go


def make_linear(c, w, b):
    lin = nn.Linear(c["K"], c["N"], bias=b is not None)
    lin.weight = nn.Parameter(w.detach().clone() if not c["nc_weight"] else w.detach().clone().t().contiguous().t())
    if b is not None:
        lin.bias = nn.Parameter(b.detach().clone())
    return lin


def run_once(layer, lin, x, go):
    """Returns dict GEMM -> result, plus 'grad_bias'; an exception is stored as the value."""
    res = {}
    xx = x.detach().clone() if x.is_contiguous() else x.detach().clone().transpose(-1, -2).contiguous().transpose(-1, -2)
    xx.requires_grad_()
    try:
        out = layer(xx)
    except Exception as e:  # noqa: BLE001
        res["output"] = e
        return res
    res["output"] = out.detach().clone()
    lin.weight.grad = None
    if lin.bias is not None:
        lin.bias.grad = None
    try:
        out.backward(go)
    except Exception as e:  # noqa: BLE001
        res["grad_input"] = e
        return res
    res["grad_input"] = xx.grad
    res["grad_weight"] = lin.weight.grad
    res["grad_bias"] = None if lin.bias is None else lin.bias.grad
    res["input_after"] = xx.detach()
    return res


def run_case(runner, c, calls=1):
    x, w, b, go = make_tensors(c, 0)
    lin = make_linear(c, w, b)
    try:
        layer = runner.build(lin)
    except Exception as e:  # noqa: BLE001
        return {"output": e}
    res = run_once(layer, lin, x, go)
    for k in range(1, calls):
        with torch.no_grad():
            g = torch.Generator().manual_seed(99 + k)
            lin.weight.mul_(0.75).add_((torch.randn(lin.weight.shape, generator=g) * 0.05).to(lin.weight.dtype))
        x, _, _, go = make_tensors(c, k)
        res = run_once(layer, lin, x, go)
    return res


def same(a, b):
    if isinstance(a, Exception) or isinstance(b, Exception):
        return False
    if a is None or b is None:
        return a is None and b is None
    if a.dtype != b.dtype or a.shape != b.shape or a.stride() != b.stride():
        return False
    na, nb = torch.isnan(a), torch.isnan(b)
    if not torch.equal(na, nb):
        return False
    return torch.equal(a[~na], b[~nb])


def describe(a):
    if isinstance(a, Exception):
        return f"raised {type(a).__name__}"
    if a is None:
        return "missing"
    return f"{tuple(a.shape)} {str(a.dtype).replace('torch.', '')} stride={a.stride()}"


# ----------------------------------------------------------------------------- blockwise reference

FP8 = torch.float8_e4m3fn


def _q64(t, groups_view, amax_dims):
    """Quantize t (float64 view by groups) like the recipe; returns dequantized float64."""
    amax = t.abs().amax(dim=amax_dims, keepdim=True)
    s = (448.0 / amax.clamp(min=1e-12)).to(torch.float32).to(torch.float64)
    q = (t.to(torch.float32) * s.to(torch.float32)).clamp(-448, 448).to(FP8).to(torch.float64)
    return q / s


def tiles_1x128(t):  # quantize along the last dim in groups of 128
    R, C = t.shape
    v = t.reshape(R, C // 128, 128)
    return _q64(v, None, (2,)).reshape(R, C)


def blocks_128(t):
    R, C = t.shape
    v = t.reshape(R // 128, 128, C // 128, 128)
    return _q64(v, None, (1, 3)).reshape(R, C)


def block_reference(x, w, go):
    """float64 emulation of the blockwise recipe (before the bf16 rounding)."""
    K = x.shape[-1]
    N = w.shape[0]
    x2 = x.reshape(-1, K)
    g2 = go.reshape(-1, N)
    xd = tiles_1x128(x2.double())
    wd = blocks_128(w.double())
    gd = tiles_1x128(g2.double())
    out = xd @ wd.t()
    gi = gd @ wd
    gdt = tiles_1x128(g2.double().t().contiguous())
    xdt = tiles_1x128(x2.double().t().contiguous())
    gw = gdt @ xdt.t()
    return out.reshape(*x.shape[:-1], N), gi.reshape(x.shape), gw


def close_block(a, ref, bias=None):
    if isinstance(a, Exception):
        return False, describe(a)
    a64 = a.double()
    tol = 2 ** -7 * ref.abs() + 2 ** -12 * ref.abs().max()
    if bias is not None:
        tol = tol + 2 ** -7 * bias.abs()
        ref = ref + bias
    err = (a64 - ref).abs()
    ok = bool((err <= tol).all()) and not bool(torch.isnan(a64).any())
    return ok, f"max err/ref_max={float(err.max() / ref.abs().max()):.2e}"


def sqnr(a, ref):
    a = a.double()
    return float(20 * torch.log10(ref.norm() / (a - ref).norm()))


# ----------------------------------------------------------------------------- correct checks


def correct_cases(form, recipe):
    blk = recipe == "blockwise"
    dims = BLOCK if blk else {}
    cs = []
    dt = [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32),
          (torch.bfloat16, torch.float32), (torch.float16, torch.bfloat16)]
    for i, (di, dw) in enumerate(dt):
        cs.append(make_case(in_dtype=di, w_dtype=dw, seed=i, **dims))
    cs.append(make_case(nc_input=True, seed=5, **dims))
    cs.append(make_case(nc_weight=True, seed=6, **dims))
    cs.append(make_case(nc_go=True, seed=7, **dims))
    if blk:
        cs.append(make_case(M=128, K=128, N=128, seed=8))
        cs.append(make_case(data="zero_rows", seed=9, **dims))
    else:
        cs.append(make_case(K=48, N=48, seed=8))
        cs.append(make_case(data="zero_rows", seed=9))
        cs.append(make_case(data="outlier_row", seed=10))
    if form != "function":
        cs.append(make_case(bias=True, seed=11, **dims))
        cs.append(make_case(bias=True, in_dtype=torch.float32, w_dtype=torch.float32, seed=12, **dims))
        lead = (2, 64) if blk else (2, 16)
        c = make_case(lead=lead, seed=13, **dims)
        c["M"] = lead[0] * lead[1]
        cs.append(c)
        if recipe == "tensorwise" or blk:
            c = make_case(lead=lead, nc_input=True, seed=14, **dims)
            c["M"] = lead[0] * lead[1]
            cs.append(c)
    return cs


def check_correct(entry):
    runner = Runner(load(entry["impl"]), entry["form"])
    recipe = entry["recipe"]
    n = 0
    worst = []
    for c in correct_cases(entry["form"], recipe):
        got = run_case(runner, c)
        for k in GEMMS:
            if isinstance(got.get(k), Exception):
                return False, f"case {c} {k} {describe(got[k])}"
        if recipe == "blockwise":
            x, w, b, go = make_tensors(c)
            ref = block_reference(x.detach(), w, go)
            for k, r in zip(GEMMS, ref):
                tgt = {"output": x.dtype, "grad_input": x.dtype, "grad_weight": w.dtype}[k]
                g = got[k]
                like = {"output": None, "grad_input": x, "grad_weight": w}[k]
                want_stride = torch.empty(r.shape).stride() if like is None else torch.empty_like(like).stride()
                if g.dtype != tgt or g.shape != r.shape or g.stride() != want_stride:
                    return False, f"{k} contract {describe(g)}"
                ok, msg = close_block(g, r, b.double() if (b is not None and k == "output") else None)
                if not ok:
                    return False, f"{k} vs float64 reference: {msg} case={c}"
                if b is None or k != "output":
                    worst.append(sqnr(g, r))
            if b is not None:
                want = go.double().reshape(-1, c["N"]).sum(0)
                if got["grad_bias"].dtype != b.dtype or (got["grad_bias"].double() - want).abs().max() > 1e-2 * want.abs().max() + 1e-3:
                    return False, "grad_bias"
        else:
            if c["lead"] and c["nc_input"] and recipe != "tensorwise":
                continue
            want = run_case(torchao_runner(recipe), c)
            for k in GEMMS + ("grad_bias",):
                if not same(got.get(k), want.get(k)) and not (got.get(k) is None and want.get(k) is None):
                    return False, f"{k} differs from torchao: got {describe(got.get(k))} want {describe(want.get(k))} case={c}"
        n += 1
    extra = f", min agreement with fp64 emulation {min(worst):.1f} dB" if worst else ""
    ref = "float64 blockwise emulation (tolerance)" if recipe == "blockwise" else f"torchao {recipe} (bitwise)"
    return True, f"{n} cases equal to {ref}{extra}"


# ----------------------------------------------------------------------------- buggy checks

# buggy entry -> the correct implementation it is a copy of
TWINS = {
    'bug_tw_out_stale_wcache': 'correct_tw_quant',
    'bug_tw_out_bias_promote': 'correct_tw_wrap',
    'bug_tw_out_asstrided': 'correct_tw_wrap',
    'bug_tw_gi_go_e4m3': 'correct_tw_closure',
    'bug_tw_gi_go_clamp448': 'correct_tw_quant',
    'bug_tw_gi_nd_crash': 'correct_tw_wrap',
    'bug_tw_gw_view': 'correct_tw_closure',
    'bug_tw_gw_fastaccum': 'correct_tw_closure',
    'bug_tw_gw_scale_bf16': 'correct_tw_quant',
    'bug_rw_out_orient': 'correct_rw_table',
    'bug_rw_out_zero_nan': 'correct_rw_closure',
    'bug_rw_out_preclamp': 'correct_rw_table',
    'bug_rw_gi_fp16_acc': 'correct_rw_closure',
    'bug_rw_gi_view': 'correct_rw_table',
    'bug_rw_gi_fp32_bypass': 'correct_rw_closure',
    'bug_rw_gw_go_e5m2': 'correct_rw_table',
    'bug_rw_gw_inplace': 'correct_rw_closure',
    'bug_gwhp_out_nd_flat': 'correct_gwhp_wrap',
    'bug_gwhp_out_ndview': 'correct_gwhp_quant',
    'bug_gwhp_gi_w_asstrided': 'correct_gwhp_closure',
    'bug_gwhp_gi_pow2': 'correct_gwhp_quant',
    'bug_gwhp_gi_fp16_e5m2': 'correct_gwhp_wrap',
    'bug_gwhp_gi_stale': 'correct_gwhp_quant',
    'bug_gwhp_gw_fp8': 'correct_gwhp_closure',
    'bug_gwhp_gw_fp32_upcast': 'correct_gwhp_wrap',
    'bug_bw_out_partial_bf16': 'correct_bw_quant',
    'bug_bw_out_bias_assert': 'correct_bw_quant',
    'bug_bw_out_eps': 'correct_bw_table',
    'bug_bw_out_clamp240': 'correct_bw_table',
    'bug_bw_gi_view_not_t': 'correct_bw_quant',
    'bug_bw_gi_go_block': 'correct_bw_table',
    'bug_bw_gw_go_asstrided': 'correct_bw_table',
    'bug_bw_gw_stale': 'correct_bw_quant',
    'bug_bw_gw_hp': 'correct_bw_table',
}

TRIGGER_TO_CASE = {
    "non-contiguous input": dict(nc_input=True),
    "non-contiguous weight": dict(nc_weight=True),
    "non-contiguous grad_output": dict(nc_go=True),
    "fp32 input": dict(in_dtype=torch.float32),
    "fp16 input": dict(in_dtype=torch.float16),
    "fp32 weight": dict(w_dtype=torch.float32),
    "bias": dict(bias=True),
    "data:zeros": dict(data="zeros"),
    "data:zero_rows": dict(data="zero_rows"),
    "data:tiny": dict(data="tiny"),
    "data:outlier_row": dict(data="outlier_row"),
    "data:negative": dict(data="negative"),
}


def bug_case(entry):
    blk = entry["recipe"] == "blockwise"
    c = make_case(seed=3, **(BLOCK if blk else {}))
    for t in entry["trigger"]:
        if t in TRIGGER_TO_CASE:
            c.update(TRIGGER_TO_CASE[t])
        elif t == "K == N":
            c["K"] = c["N"] = 128 if blk else 48
        elif t == "N-D input":
            c["lead"] = (2, c["M"] // 2)
    return c


def check_bug(entry, twins):
    twin = twins[TWINS[entry["name"]]]
    c = bug_case(entry)
    calls = 2 if "second call" in entry["trigger"] else 1
    got = run_case(Runner(load(entry["impl"]), entry["form"]), c, calls)
    want = run_case(Runner(load(twin["impl"]), twin["form"]), c, calls)
    first = entry["gemm"]
    for k in GEMMS:
        w = want.get(k)
        if isinstance(w, Exception):
            return False, f"twin raised in {k}: {w}"
        g = got.get(k)
        if k == first:
            if isinstance(g, Exception) or (k not in got and any(isinstance(v, Exception) for v in got.values())):
                err = g if isinstance(g, Exception) else next(v for v in got.values() if isinstance(v, Exception))
                return True, f"{k}: raised {type(err).__name__}: {str(err).splitlines()[0][:60]}{untriggered(entry, twin)}"
            if same(g, w):
                return False, f"{k} identical to twin on case {c}"
            return True, f"{k} differs ({why(g, w)}){untriggered(entry, twin)}"
        if not same(g, w):
            return False, f"{k} (before {first}) differs: {describe(g)} vs {describe(w)}"
    return False, "no GEMM compared"


def untriggered(entry, twin):
    """Informational: does the entry also differ with its trigger removed, or with any one
    of several trigger tokens left out?"""
    trig = [t for t in entry["trigger"] if t != "second call"]
    if not trig and "second call" not in entry["trigger"]:
        return ""
    subsets = [[]] if len(trig) <= 1 else [[u for u in trig if u != t] for t in trig]
    hits = []
    for sub in subsets:
        e2 = dict(entry, trigger=sub)
        c = bug_case(e2)
        got = run_case(Runner(load(entry["impl"]), entry["form"]), c)
        want = run_case(Runner(load(twin["impl"]), twin["form"]), c)
        k = entry["gemm"]
        if any(isinstance(v, Exception) for v in got.values()) or not same(got.get(k), want.get(k)):
            hits.append("+".join(sub) or "plain case")
    if hits:
        return "; ALSO SHOWS WITH ONLY: " + ", ".join(hits)
    return "; not shown without the full trigger"


def why(g, w):
    if g.dtype != w.dtype:
        return f"dtype {g.dtype} vs {w.dtype}"
    if g.shape != w.shape:
        return f"shape {tuple(g.shape)} vs {tuple(w.shape)}"
    if g.stride() != w.stride():
        return f"strides {g.stride()} vs {w.stride()}"
    if torch.isnan(g).any() and not torch.isnan(w).any():
        return "NaN"
    d = (g.double() - w.double()).abs()
    return f"max abs diff {float(d.max()):.3g}, {int((d > 0).sum())} elements"


def main():
    t0 = time.time()
    entries = json.load(open(os.path.join(HERE, "manifest.json")))
    twins = {e["name"]: e for e in entries if e["category"] == "none"}
    passed = failed = skipped = 0
    for e in entries:
        try:
            if e["category"] == "none":
                ok, msg = check_correct(e)
            elif e["devices"] == ["cuda"]:
                print(f"SKIP {e['name']}: cuda-only ({e['category']}, {e['gemm']})")
                skipped += 1
                continue
            else:
                ok, msg = check_bug(e, twins)
        except Exception as ex:  # noqa: BLE001
            ok, msg = False, f"verify crashed: {type(ex).__name__}: {ex}"
        print(f"{'PASS' if ok else 'FAIL'} {e['name']}: {msg}", flush=True)
        passed += ok
        failed += not ok
    print(f"TOTAL: {passed} passed, {failed} failed, {skipped} skipped (cuda-only) of {len(entries)} entries in {time.time() - t0:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
