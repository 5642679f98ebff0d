"""Verify the heldout8 labels on CPU (torch + torchao only).

(1) correct tensorwise / rowwise / rowwise_with_gw_hp implementations: bitwise equal to torchao
    0.18 Float8Linear(Float8LinearConfig.from_recipe_name(recipe)) for output, grad_input,
    grad_weight, grad_bias; blockwise ones within BOUND of a float64 emulation:
        |y - y64| <= u_out * |y64| + 2 * inner * 2^-24 * (|A_q| @ |B_q|)  (with a bias: the
    bound times (1 + u_out) plus u_out * |y64 + bias|)
    (y64: the exactly dequantized fp8 operands multiplied in float64; u_out the unit roundoff
    of the output dtype: 2^-8 bf16, 2^-11 fp16, 2^-24 fp32).
(2) each bug beside its twin on a case built from its trigger: GEMMs before the labelled one
    identical, the labelled one differs or raises; with each trigger token removed the bug
    vanishes. "gpu only" bugs: CPU results identical, recorded torch._scaled_mm calls break the
    H100 rule (A row-major, B column-major) in the labelled GEMM only.
Run: cd /work/main && OMP_NUM_THREADS=2 .venv/bin/python property_tests/heldout8/verify.py
"""
import importlib.util
import json
import os
import sys
import time
import traceback

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
GEMMS = ["output", "grad_input", "grad_weight"]
DT = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}
_mods = {}


def load(impl):
    # a fresh module object per run, so that module-level caches never leak between runs
    path, attr = impl.rsplit(":", 1)
    if True:
        spec = importlib.util.spec_from_file_location("h8_" + os.path.basename(path)[:-3],
                                                      os.path.join(ROOT, path))
        m = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(m)
        _mods[path] = m
    return getattr(_mods[path], attr)


class Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten._scaled_mm.default,):
            a, b = args[0], args[1]
            self.calls.append((tuple(a.shape), a.stride(), tuple(b.shape), b.stride()))
        return func(*args, **(kwargs or {}))


def h100_ok(call):
    (ash, ast, bsh, bst) = call
    a_row = ast[1] == 1 and ast[0] >= max(1, ash[1])
    b_col = bst[0] == 1 and bst[1] >= max(1, bsh[0])
    div = all(d % 16 == 0 for d in (ash[1], bsh[1]))
    return a_row and b_col and div


# ---------------------------------------------------------------- cases
def default_case(recipe):
    bw = recipe == "blockwise"
    return dict(M=128 if bw else 32, K=256 if bw else 64, N=128 if bw else 48, nd=False,
                x="bf16", w="bf16", nc_in=False, nc_w=False, nc_go=False, bias=False,
                data="gaussian", steps=1, seed=0)


def apply_tokens(case, tokens):
    c = dict(case)
    for t in tokens:
        if t == "non-contiguous input": c["nc_in"] = True
        elif t == "non-contiguous weight": c["nc_w"] = True
        elif t == "non-contiguous grad_output": c["nc_go"] = True
        elif t == "K == N": c["N"] = c["K"]
        elif t == "N-D input": c["nd"] = True
        elif t == "fp32 input": c["x"] = "fp32"
        elif t == "fp16 input": c["x"] = "fp16"
        elif t == "fp32 weight": c["w"] = "fp32"
        elif t == "second call": c["steps"] = 2
        elif t == "bias": c["bias"] = True
        elif t == "gpu only": pass
        elif t.startswith("data:"): c["data"] = t[5:]
        else: raise ValueError(t)
    return c


def make_data(c, step):
    g = torch.Generator().manual_seed(1000 * c["seed"] + step)
    M, K, N = c["M"], c["K"], c["N"]
    lead = (2, M // 2) if c["nd"] else (M,)
    base = torch.randn(M, K, generator=g)
    d = c["data"]
    if d == "large": base = base * 1e3
    elif d == "zeros": base = base * 0
    elif d == "zero_rows": base[::2] = 0
    elif d == "tiny_amax": base = base * 1e-30 / base.abs().max()
    elif d == "small_amax": base = base * 5e-5 / base.abs().max()
    elif d == "outlier": base[:, 3] *= 300
    elif d == "outlier_row": base[5] *= 1e4
    elif d == "negative": base = -base.abs()
    elif d != "gaussian": raise ValueError(d)
    x = base.reshape(*lead, K).to(DT[c["x"]])
    if c["nc_in"]:
        x = x.transpose(-1, -2).contiguous().transpose(-1, -2)  # each sample stored transposed
    go = torch.randn(M, N, generator=g).reshape(*lead, N).to(DT[c["x"]])
    if c["nc_go"]:
        go = go.transpose(-1, -2).contiguous().transpose(-1, -2)
    return x, go


def make_params(c):
    g = torch.Generator().manual_seed(77 + c["seed"])
    w = (torch.randn(c["N"], c["K"], generator=g) * 0.1).to(DT[c["w"]])
    if c["nc_w"]:
        w = w.t().contiguous().t()
    b = (torch.randn(c["N"], generator=g) * 0.1).to(DT[c["w"]]) if c["bias"] else None
    return w, b


def build(entry, c, w, b):
    form, impl = entry["form"], entry["impl"]
    lin = nn.Linear(c["K"], c["N"], bias=b is not None)
    lin.weight = nn.Parameter(w.clone())
    if b is not None:
        lin.bias = nn.Parameter(b.clone())
    if impl.startswith("torchao:"):
        from torchao.float8.config import Float8LinearConfig
        from torchao.float8.float8_linear import Float8Linear
        m = Float8Linear.from_float(lin, config=Float8LinearConfig.from_recipe_name(
            impl.split(":")[1]))
        return m, lin
    obj = load(impl)
    if form == "function":
        wp, bp = lin.weight, lin.bias
        if bp is None:
            return (lambda x: obj(x, wp)), lin
        return (lambda x: obj(x, wp, bias=bp)), lin
    if form == "module":
        return obj.from_float(lin), lin
    return obj(nn.Sequential(lin))[0], lin


def run(entry, c):
    """Returns dict gemm -> tensor, or ('raise', stage, msg); plus recorded calls."""
    torch.manual_seed(0)
    w, b = make_params(c)
    layer, lin = build(entry, c, w, b)
    rec = Recorder()
    res = {}
    stage = "output"
    try:
        with rec:
            for step in range(c["steps"]):
                if step > 0:
                    with torch.no_grad():
                        lin.weight.mul_(3.0).add_(0.01)
                x, go = make_data(c, step)
                x = x.detach().requires_grad_(True)
                lin.weight.grad = None
                if lin.bias is not None:
                    lin.bias.grad = None
                rec.calls.clear()
                stage = "output"
                out = layer(x)
                stage = "grad_input"
                out.backward(go if go.shape == out.shape else torch.ones_like(out))
        res["output"] = out.detach()
        res["grad_input"] = x.grad
        res["grad_weight"] = lin.weight.grad
        res["grad_bias"] = lin.bias.grad if lin.bias is not None else None
        res["input_after"] = x.detach()
    except Exception as e:  # noqa: BLE001
        return ("raise", stage, f"{type(e).__name__}: {str(e)[:80]}"), rec.calls
    return res, rec.calls


def same(a, b):
    if a is None or b is None:
        return a is None and b is None
    if a.dtype != b.dtype or a.shape != b.shape or a.stride() != b.stride():
        return False
    if a.dtype.is_floating_point:
        ib = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        return torch.equal(a.contiguous().view(ib), b.contiguous().view(ib))
    return torch.equal(a, b)


def first_diff(ra, rb):
    """First GEMM where ra (bug) differs from rb (twin), or None."""
    if isinstance(ra, tuple):
        return ra[1], "raises " + ra[2]
    if isinstance(rb, tuple):
        return "twin-raises", rb[2]
    for gname in GEMMS:
        if not same(ra[gname], rb[gname]):
            a, b = ra[gname], rb[gname]
            why = "values"
            if a is None or b is None: why = "missing"
            elif a.dtype != b.dtype: why = f"dtype {a.dtype} vs {b.dtype}"
            elif a.shape != b.shape: why = f"shape {tuple(a.shape)} vs {tuple(b.shape)}"
            elif a.stride() != b.stride(): why = f"strides {a.stride()} vs {b.stride()}"
            elif a.isnan().any(): why = "NaN"
            return gname, why
    if not same(ra["grad_bias"], rb["grad_bias"]):
        return "grad_bias", "values"
    return None


def viol(calls):
    names = GEMMS[:len(calls)] if len(calls) <= 3 else [f"call{i}" for i in range(len(calls))]
    return [n for n, cl in zip(names, calls) if not h100_ok(cl)]


# ---------------------------------------------------------------- blockwise emulation
def emu_q(t, dims):
    t = t.double().float() if t.dtype != torch.float32 else t
    a = t.abs().amax(dim=dims, keepdim=True).double()
    s = (448.0 / a.clamp(min=1e-12)).float()
    q = (t.float() * s).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q.double() / s.double()


def q_tiles(t):  # 1x128 along last dim of 2-D
    r, c = t.shape
    return emu_q(t.reshape(r, c // 128, 128), (2,)).reshape(r, c)


def q_blocks(w):
    n, k = w.shape
    return emu_q(w.reshape(n // 128, 128, k // 128, 128), (1, 3)).reshape(n, k)


def within(y, a, b, dt, bias=None):
    y64 = a @ b
    u = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11, torch.float32: 2.0 ** -24}[dt]
    bound = u * y64.abs() + 2 * a.shape[1] * 2.0 ** -24 * (a.abs() @ b.abs())
    if bias is not None:  # the bias add rounds once more
        y64 = y64 + bias.double()
        bound = bound * (1 + u) + u * y64.abs()
    err = (y.double() - y64).abs()
    return bool((err <= bound).all()) and y.dtype == dt, float((err / bound.clamp(min=1e-300)).max())


def check_blockwise(entry, c):
    res, _ = run(entry, c)
    if isinstance(res, tuple):
        return False, res[2]
    w, b = make_params(c)
    if c["steps"] == 2:
        w = w.clone()
        b = None if b is None else b.clone()
        w.mul_(3.0).add_(0.01)
    x, go = make_data(c, c["steps"] - 1)
    K, N = c["K"], c["N"]
    x2, g2 = x.reshape(-1, K), go.reshape(-1, N)
    dt = x.dtype
    ok1, r1 = within(res["output"].reshape(-1, N), q_tiles(x2), q_blocks(w).t(), dt, b)
    ok2, r2 = within(res["grad_input"].reshape(-1, K), q_tiles(g2), q_blocks(w), dt)
    ok3, r3 = within(res["grad_weight"].to(dt), q_tiles(g2.t()), q_tiles(x2.t()).t(), dt)
    shapes = res["output"].shape == (*x.shape[:-1], N) and res["output"].dtype == dt
    return ok1 and ok2 and ok3 and shapes, f"max err/bound {max(r1, r2, r3):.3f}"


# ---------------------------------------------------------------- main
CORRECT_CASES = [
    {}, {"bias": True}, {"x": "fp32", "w": "fp32", "bias": True}, {"nd": True},
    {"nd": True, "x": "fp32", "w": "fp32", "bias": True}, {"w": "fp32"},
    {"nc_in": True}, {"nc_w": True, "bias": True}, {"nc_go": True},
    {"x": "fp16", "w": "fp16"}, {"N": "K", "bias": True}, {"nd": True, "nc_in": True},
    {"steps": 2, "bias": True}, {"data": "outlier", "nd": True}, {"M": 48, "K": 32, "N": 16},
]


def correct_cases(recipe):
    for i, mod in enumerate(CORRECT_CASES):
        c = default_case(recipe)
        c["seed"] = i
        for k, v in mod.items():
            c[k] = c["K"] if v == "K" else v
        if recipe == "blockwise" and any(c[d] % 128 for d in ("M", "K", "N")):
            continue
        yield c


def main():
    t0 = time.time()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    man = json.load(open(os.path.join(HERE, "manifest.json")))
    by_name = {e["name"]: e for e in man}
    bad = 0
    n_ok = 0
    for e in man:
        if e["category"] != "none":
            continue
        msgs = []
        good = True
        for c in correct_cases(e["recipe"]):
            if e["recipe"] == "blockwise":
                ok, why = check_blockwise(e, c)
                good &= ok
                msgs.append(why) if not ok else None
                continue
            if e["recipe"] != "tensorwise" and c["nd"] and c["nc_in"]:
                continue  # torchao 0.18 rowwise raises on a transposed 3-D input
            ref, _ = run({"form": "module", "impl": "torchao:" + e["recipe"]}, c)
            got, _ = run(e, c)
            d = first_diff(got, ref)
            if d is not None or not same(got["grad_bias"], ref["grad_bias"]):
                good = False
                msgs.append(f"{c} -> {d}")
        tag = "bitwise = torchao" if e["recipe"] != "blockwise" else "within bound of fp64 emulation"
        print(f"{'OK ' if good else 'BAD'} {e['name']:<14} correct {e['recipe']:<18} {tag} "
              + ("" if good else "; ".join(msgs[:2])), flush=True)
        bad += not good
        n_ok += good
    n_bug_ok = 0
    for e in man:
        if e["category"] == "none":
            continue
        twin = by_name[e["twin"]]
        trig = e["trigger"]
        gpu = "gpu only" in trig
        problems = []
        c = apply_tokens(default_case(e["recipe"]), trig)
        rb, cb = run(e, c)
        rt, ct = run(twin, c)
        d = first_diff(rb, rt)
        if gpu:
            v, vt = viol(cb), viol(ct)
            if d is not None:
                problems.append(f"CPU results differ ({d})")
            if vt:
                problems.append(f"twin violates {vt}")
            if not v or v[0] != e["gemm"]:
                problems.append(f"violations {v} (want first {e['gemm']})")
            shown = f"H100 rule broken in {v}"
        else:
            if d is None:
                problems.append("no difference on trigger case")
            elif d[0] != e["gemm"]:
                problems.append(f"first difference at {d[0]} ({d[1]}), labelled {e['gemm']}")
            shown = f"{d[0]}: {d[1]}" if d else "-"
        for tok in trig:
            c2 = apply_tokens(default_case(e["recipe"]), [t for t in trig if t != tok])
            rb2, cb2 = run(e, c2)
            rt2, _ = run(twin, c2)
            d2 = first_diff(rb2, rt2)
            if d2 is not None or (gpu and tok != "gpu only" and viol(cb2)):
                problems.append(f"still shows without '{tok}' ({d2 or 'H100 rule'})")
        ok = not problems
        bad += not ok
        n_bug_ok += ok
        print(f"{'OK ' if ok else 'BAD'} {e['name']:<14} {e['recipe']:<18} {e['category']:<12} "
              f"{e['gemm']:<11} trigger={trig} -> {shown}"
              + ("" if ok else "  PROBLEMS: " + "; ".join(problems)), flush=True)
    n_bug = sum(e["category"] != "none" for e in man)
    n_cor = len(man) - n_bug
    print(f"SUMMARY: correct {n_ok}/{n_cor} verified, bugs {n_bug_ok}/{n_bug} verified, "
          f"{bad} wrong label(s), {time.time() - t0:.0f}s")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
