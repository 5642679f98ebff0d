"""Self-check of the heldout4 set (CPU only; uses only torch and torchao).

Run from the repository root:
    .venv/bin/python property_tests/heldout4/verify.py

1. Every correct entry of tensorwise / rowwise / rowwise_with_gw_hp must be
   bitwise equal (values, dtype, shape, strides) to torchao 0.18's Float8Linear
   of its recipe, forward and backward (output, grad_input, grad_weight,
   grad_bias), on a list of cases (dtypes, bias, N-D, layouts, K == N, second
   call, zero rows).
2. Every correct blockwise entry must match a float64 reference (written here,
   independently of the implementations) within
       |impl - ref| <= 2**-7 * |ref| + 1e-3 * max|ref|
   and have nn.Linear's dtypes/shapes (output contiguous).
3. Every buggy entry is run beside its correct twin (the file it was copied
   from, see TWIN below): under the manifest trigger, the GEMMs
   before the labelled one must be identical and the labelled one must differ
   (or raise, for category crash). Without the trigger (base case: 2-D,
   contiguous, bf16 input and weight, no bias, K != N, Gaussian data, one call)
   all GEMMs must be identical. Entries with devices == ["cuda"] are skipped.
"""
import importlib.util
import json
import os
import sys
import time
import warnings

import torch
from torch import nn

warnings.filterwarnings("ignore")
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
GEMMS = ("output", "grad_input", "grad_weight")
FIELD = {"output": "out", "grad_input": "gx", "grad_weight": "gw"}
# the correct file each buggy file was copied from (kept here, not in the buggy files)
TWIN = {
    'bug_a_tw_go_dtype_fp32': 'correct_a_tensorwise',
    'bug_a_tw_square_orient': 'correct_a_tensorwise',
    'bug_a_tw_go_clamp448': 'correct_a_tensorwise',
    'bug_a_tw_gw_scale_swap': 'correct_a_tensorwise',
    'bug_a_tw_go_asstrided': 'correct_a_tensorwise',
    'bug_b_tw_scale_lowprec': 'correct_b_tensorwise',
    'bug_b_tw_stale_input_scale': 'correct_b_tensorwise',
    'bug_b_tw_fused_bias': 'correct_b_tensorwise',
    'bug_b_tw_zero_shortcut': 'correct_b_tensorwise',
    'bug_b_tw_rowmajor_b': 'correct_b_tensorwise',
    'bug_a_rw_zero_row_nan': 'correct_a_rowwise',
    'bug_a_rw_pow2_round': 'correct_a_rowwise',
    'bug_a_rw_nd_crash': 'correct_a_rowwise',
    'bug_a_rw_bias_promote': 'correct_a_rowwise',
    'bug_a_rw_stale_gw_input': 'correct_a_rowwise',
    'bug_c_rw_go_e5m2': 'correct_c_rowwise',
    'bug_c_rw_fp16_out': 'correct_c_rowwise',
    'bug_c_rw_gw_view': 'correct_c_rowwise',
    'bug_c_rw_gi_fastaccum': 'correct_c_rowwise',
    'bug_c_rw_input_asstrided': 'correct_c_rowwise',
    'bug_c_rw_weight_clamp240': 'correct_c_rowwise',
    'bug_b_gwhp_gw_fp8': 'correct_b_gwhp',
    'bug_b_gwhp_gi_no_pow2': 'correct_b_gwhp',
    'bug_b_gwhp_fp32_inplace': 'correct_b_gwhp',
    'bug_c_gwhp_gw_bf16': 'correct_c_gwhp',
    'bug_c_gwhp_stale_go': 'correct_c_gwhp',
    'bug_c_gwhp_mixed_mm': 'correct_c_gwhp',
    'bug_c_gwhp_gw_reshape': 'correct_c_gwhp',
    'bug_a_bw_zero_tile_nan': 'correct_a_blockwise',
    'bug_a_bw_gw_tile_axis': 'correct_a_blockwise',
    'bug_b_bw_weight_e5m2': 'correct_b_blockwise',
    'bug_b_bw_dequant_bf16': 'correct_b_blockwise',
    'bug_d_bw_fp32_shadow': 'correct_d_blockwise',
    'bug_d_bw_view_input': 'correct_d_blockwise',
}

_loaded = {}


def load(impl):
    path, attr = impl.rsplit(":", 1)
    if path not in _loaded:
        name = "heldout4_" + os.path.splitext(os.path.basename(path))[0]
        spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, path))
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        _loaded[path] = mod
    return getattr(_loaded[path], attr)


# ---------------------------------------------------------------- cases
def base_case(recipe):
    if recipe == "blockwise":
        return dict(M=256, K=256, N=384, xdt=torch.bfloat16, wdt=torch.bfloat16, bias=False,
                    nd=False, nc_x=False, nc_w=False, nc_g=False, data="gauss", calls=1, seed=0)
    return dict(M=32, K=48, N=64, xdt=torch.bfloat16, wdt=torch.bfloat16, bias=False,
                nd=False, nc_x=False, nc_w=False, nc_g=False, data="gauss", calls=1, seed=0)


def apply_trigger(case, tokens):
    c = dict(case)
    for t in tokens:
        if t == "fp32 input":
            c["xdt"] = torch.float32
        elif t == "fp16 input":
            c["xdt"] = torch.float16
        elif t == "fp32 weight":
            c["wdt"] = torch.float32
        elif t == "bias":
            c["bias"] = True
        elif t == "N-D input":
            c["nd"] = True
        elif t == "non-contiguous input":
            c["nc_x"] = True
        elif t == "non-contiguous weight":
            c["nc_w"] = True
        elif t == "non-contiguous grad_output":
            c["nc_g"] = True
        elif t == "K == N":
            c["N"] = c["K"]
        elif t == "second call":
            c["calls"] = 2
        elif t == "data:zeros":
            c["data"] = "zeros"
        elif t == "data:zero_rows":
            c["data"] = "zero_rows"
        else:
            raise ValueError(f"trigger {t!r} has no CPU construction here")
    return c


def _stored(shape, dtype, transposed, gen):
    """A tensor of logical `shape`; stored with its last two dims swapped when `transposed`."""
    if transposed:
        s = list(shape)
        s[-1], s[-2] = s[-2], s[-1]
        return torch.randn(s, generator=gen).to(dtype).transpose(-1, -2)
    return torch.randn(shape, generator=gen).to(dtype)


def make_linear(c, form):
    gen = torch.Generator().manual_seed(1000 + c["seed"])
    lin = nn.Linear(c["K"], c["N"], bias=c["bias"] and form != "function")
    with torch.no_grad():
        w = _stored((c["N"], c["K"]), c["wdt"], c["nc_w"], gen) * 0.2
        lin.weight = nn.Parameter(w)
        if lin.bias is not None:
            lin.bias = nn.Parameter(torch.randn(c["N"], generator=gen).to(c["wdt"]))
    return lin


def make_inputs(c, call):
    gen = torch.Generator().manual_seed(2000 + 17 * call + c["seed"])
    lead = (2, c["M"] // 2) if c["nd"] else (c["M"],)
    x = _stored(lead + (c["K"],), c["xdt"], c["nc_x"], gen) * (1.0 + 2.5 * call)
    if c["data"] == "zeros":
        x = torch.zeros_like(x)
    elif c["data"] == "zero_rows":
        x = x.clone()
        x.view(-1, c["K"])[::4] = 0
    g = _stored(lead + (c["N"],), c["xdt"], c["nc_g"], gen) * (0.5 + call)
    return x, g


def build(entry, lin):
    fn = load(entry["impl"])
    form = entry["form"]
    if form == "function":
        w = lin.weight
        return (lambda x: fn(x, w)), lin
    if form == "module":
        return fn.from_float(lin), lin
    root = nn.Sequential(lin)
    conv = fn(root)
    return conv, lin


def run(entry, c):
    """Returns a list (one dict per call) of out / gx / gw / gb, or an exception at a stage."""
    lin = make_linear(c, entry["form"])
    model, lin = build(entry, lin)
    results = []
    for call in range(c["calls"]):
        x, g = make_inputs(c, call)
        x = x.detach().requires_grad_(True)
        lin.weight.grad = None
        if lin.bias is not None:
            lin.bias.grad = None
        rec = {}
        x_before, w_before = x.detach().clone(), lin.weight.detach().clone()
        try:
            out = model(x)
        except Exception as e:  # noqa: BLE001
            rec["error"] = ("output", e)
            results.append(rec)
            return results
        rec["out"] = out.detach().clone()
        rec["mutated"] = not (same(x.detach(), x_before) and same(lin.weight.detach(), w_before))
        try:
            out.backward(g)
        except Exception as e:  # noqa: BLE001
            rec["error"] = (backward_stage(e), e)
            results.append(rec)
            return results
        rec["gx"] = x.grad
        rec["gw"] = lin.weight.grad
        rec["gb"] = None if lin.bias is None else lin.bias.grad
        results.append(rec)
    return results


def backward_stage(exc):
    """Which backward GEMM raised: read the statement of the innermost frame in this folder."""
    import traceback
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if os.path.dirname(os.path.abspath(f.filename)) == HERE]
    line = (frames[-1].line or "") if frames else ""
    lhs = line.split("=")[0].strip() if "=" in line else ""
    if lhs in ("gw", "grad_w", "dw"):
        return "grad_weight"
    if lhs in ("gx", "grad_x", "dx"):
        return "grad_input"
    return "backward"


def same(a, b):
    if a is None or b is None:
        return a is None and b is None
    if a.dtype != b.dtype or a.shape != b.shape or a.stride() != b.stride():
        return False
    return bool(torch.equal(torch.nan_to_num(a.double(), nan=7.25), torch.nan_to_num(b.double(), nan=7.25))
                and torch.equal(a.isnan(), b.isnan()))


# ---------------------------------------------------------------- torchao reference
def run_torchao(recipe, form, c):
    from torchao.float8 import Float8LinearConfig
    from torchao.float8.float8_linear import Float8Linear
    cfg = Float8LinearConfig.from_recipe_name(recipe)
    lin = make_linear(c, form)
    mod = Float8Linear.from_float(lin, config=cfg)
    results = []
    for call in range(c["calls"]):
        x, g = make_inputs(c, call)
        x = x.detach().requires_grad_(True)
        lin.weight.grad = None
        if lin.bias is not None:
            lin.bias.grad = None
        out = mod(x)
        rec = {"out": out.detach().clone()}
        out.backward(g)
        rec.update(gx=x.grad, gw=lin.weight.grad, gb=None if lin.bias is None else lin.bias.grad)
        results.append(rec)
    return results


CORRECT_TOKENS = [[], ["fp32 input"], ["fp16 input"], ["fp32 weight"], ["non-contiguous input"],
                  ["non-contiguous weight"], ["non-contiguous grad_output"], ["K == N"],
                  ["second call"], ["data:zero_rows"], ["data:zeros"],
                  ["bias"], ["N-D input"], ["bias", "fp32 weight", "N-D input"], ["fp16 input", "bias"]]


def correct_cases(entry):
    for toks in CORRECT_TOKENS:
        if entry["form"] == "function" and ({"bias", "N-D input"} & set(toks)):
            continue
        yield toks, apply_trigger(base_case(entry["recipe"]), toks)


def check_correct_torchao(entry):
    n = 0
    for toks, c in correct_cases(entry):
        mine = run(entry, c)
        ref = run_torchao(entry["recipe"], entry["form"], c)
        for i, (a, b) in enumerate(zip(mine, ref)):
            if "error" in a:
                return False, f"raised at {a['error'][0]} under {toks}: {a['error'][1]!r}"
            if a["mutated"]:
                return False, f"modified its input or weight in place under {toks}"
            for k in ("out", "gx", "gw", "gb"):
                if not same(a[k], b[k]):
                    return False, f"{k} differs from torchao under {toks} (call {i + 1})"
        n += 1
    return True, f"bitwise equal to torchao {entry['recipe']} on {n} cases"


# ---------------------------------------------------------------- blockwise float64 reference
def _ref_q(t, rows, cols):
    """Independent fp64 model of the tile quantization: returns dequantized fp64 values."""
    t = t.detach()
    R, C = t.shape
    out = torch.empty(R, C, dtype=torch.float64)
    for i in range(0, R, rows):
        for j in range(0, C, cols):
            tile = t[i:i + rows, j:j + cols]
            amax = max(float(tile.abs().max()), 1e-12)
            s = torch.tensor(448.0 / amax, dtype=torch.float64).float()
            q = (tile.float() * s).clamp(-448, 448).to(torch.float8_e4m3fn)
            out[i:i + rows, j:j + cols] = q.double() / s.double()
    return out


def blockwise_reference(x, w, g):
    K = x.shape[-1]
    N = w.shape[0]
    x2 = x.reshape(-1, K)
    g2 = g.reshape(-1, N)
    out = _ref_q(x2, 1, 128) @ _ref_q(w, 128, 128).t()
    gx = _ref_q(g2, 1, 128) @ _ref_q(w, 128, 128)
    gw = _ref_q(g2.t(), 1, 128) @ _ref_q(x2, 128, 1)
    return out, gx, gw


def close(a, ref):
    a = a.double()
    tol = 2.0 ** -7 * ref.abs() + 1e-3 * ref.abs().max()
    return bool(((a - ref).abs() <= tol).all())


def check_correct_blockwise(entry):
    n = 0
    for toks, c in correct_cases(entry):
        lin = make_linear(c, entry["form"])
        model, lin = build(entry, lin)
        for call in range(c["calls"]):
            x, g = make_inputs(c, call)
            x = x.detach().requires_grad_(True)
            lin.weight.grad = None
            out = model(x)
            out.backward(g)
            ro, rgx, rgw = blockwise_reference(x, lin.weight, g)
            if lin.bias is not None:
                ro = ro + lin.bias.detach().to(x.dtype).double()
            checks = [("out", out.detach().reshape(-1, c["N"]), ro), ("gx", x.grad.reshape(-1, c["K"]), rgx),
                      ("gw", lin.weight.grad, rgw)]
            for k, a, r in checks:
                if not close(a, r):
                    return False, f"{k} off the fp64 reference under {toks} (call {call + 1})"
            if out.dtype != x.dtype or x.grad.dtype != x.dtype or lin.weight.grad.dtype != lin.weight.dtype:
                return False, f"dtype contract broken under {toks}"
            if out.shape != x.shape[:-1] + (c["N"],) or not out.is_contiguous():
                return False, f"output shape/strides under {toks}"
            if lin.bias is not None:
                gb = g.double().reshape(-1, c["N"]).sum(0)
                if lin.bias.grad.dtype != lin.bias.dtype or not close(lin.bias.grad, gb):
                    return False, f"grad_bias under {toks}"
        n += 1
    return True, f"within tolerance of the fp64 blockwise reference on {n} cases"


# ---------------------------------------------------------------- buggy entries
def compare_runs(a_runs, b_runs):
    """Per GEMM verdict for the last call: 'same', 'differs', 'raises'."""
    a, b = a_runs[-1], b_runs[-1]
    if len(a_runs) != len(b_runs):
        # buggy run stopped early with an error at an earlier call
        return {g: "raises" for g in GEMMS}
    verdict = {}
    if "error" in b:
        raise RuntimeError(f"correct twin raised: {b['error']!r}")
    if "error" in a:
        stage = a["error"][0]
        if stage == "output":
            return {g: "raises" for g in GEMMS}
        verdict["output"] = "same" if same(a["out"], b["out"]) and not a["mutated"] else "differs"
        verdict["grad_input"] = verdict["grad_weight"] = "raises"
        if stage == "grad_weight":
            verdict["grad_input"] = "same"  # computed before the raise; not observable, taken as same
        return verdict
    for gname in GEMMS:
        verdict[gname] = "same" if same(a[FIELD[gname]], b[FIELD[gname]]) else "differs"
    if a["mutated"] and not b["mutated"]:
        verdict["output"] = "differs"  # an operand of the output GEMM was modified in place
    verdict["grad_bias"] = "same" if same(a["gb"], b["gb"]) else "differs"
    return verdict


def check_bug(entry, twin):
    recipe = entry["recipe"]
    trig = entry["trigger"]
    target = entry["gemm"]
    c = apply_trigger(base_case(recipe), trig)
    v = compare_runs(run(entry, c), run(twin, c))
    idx = GEMMS.index(target)
    for earlier in GEMMS[:idx]:
        if v[earlier] != "same":
            return False, f"{earlier} already {v[earlier]} (label says first wrong is {target})"
    if entry["category"] == "crash":
        if v[target] != "raises":
            return False, f"{target} {v[target]}, expected a raise"
    elif v[target] != "differs":
        return False, f"{target} is {v[target]} under trigger {trig}"
    msg = f"{target} {v[target]} under {trig or 'base case'}"
    if trig:
        vb = compare_runs(run(entry, base_case(recipe)), run(twin, base_case(recipe)))
        bad = [g for g in GEMMS if vb[g] != "same"]
        if bad:
            return False, f"also shows without its trigger ({bad})"
        msg += "; identical without it"
    return True, msg


def main():
    t0 = time.time()
    torch.manual_seed(0)
    with open(os.path.join(HERE, "manifest.json")) as f:
        manifest = json.load(f)
    by_name = {e["name"]: e for e in manifest}
    passed = failed = skipped = 0
    for e in manifest:
        try:
            if e["category"] == "none":
                if e["recipe"] == "blockwise":
                    ok, msg = check_correct_blockwise(e)
                else:
                    ok, msg = check_correct_torchao(e)
            elif e["devices"] == ["cuda"]:
                print(f"SKIP {e['name']:<34} cuda-only ({e['category']}, {e['gemm']})")
                skipped += 1
                continue
            else:
                ok, msg = check_bug(e, by_name[TWIN[e["name"]]])
        except Exception as ex:  # noqa: BLE001
            ok, msg = False, f"verify error: {ex!r}"
        print(f"{'PASS' if ok else 'FAIL'} {e['name']:<34} {msg}")
        passed += ok
        failed += not ok
    print(f"TOTAL {passed} passed, {failed} failed, {skipped} skipped (cuda-only) "
          f"of {len(manifest)} entries in {time.time() - t0:.0f}s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
