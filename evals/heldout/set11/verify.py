"""Verify the heldout11 set: correct implementations against torchao 0.18 (bitwise) or a
float64 emulation (blockwise), and each bug beside its twin with and without its trigger.
Run: OMP_NUM_THREADS=2 /work/main/.venv/bin/python property_tests/heldout11/verify.py"""
import copy, importlib.util, inspect, json, os, sys, time, traceback
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
DT = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}
GEMMS = ["output", "grad_input", "grad_weight"]


def load(impl):
    path, attr = impl.rsplit(":", 1)
    full = os.path.join(ROOT, path)
    name = "h11_" + os.path.basename(path)[:-3]
    spec = importlib.util.spec_from_file_location(name, full)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return getattr(mod, attr)


def gen(data, shape, g):
    x = torch.randn(shape, generator=g)
    if data == "uniform":
        x = torch.rand(shape, generator=g) * 2 - 1
    elif data == "heavy":
        x = x / (torch.rand(shape, generator=g).clamp_min(0.02)) ** 0.5
    elif data == "outlier":
        x[..., 1] *= 300.0
    elif data == "zeros":
        x = torch.zeros(shape)
    elif data == "nearmax":
        x = torch.sign(x) * (400 + 48 * torch.rand(shape, generator=g))
    elif data == "tiny":
        x = x * 2.0 ** -12
    elif data == "negative":
        x = -x.abs() * 2 + 0.1 * x
    elif data == "zero_rows":
        x2 = x.reshape(-1, shape[-1])
        x2[: x2.shape[0] // 4] = 0
        x2[:, : shape[-1] // 4] = 0
        x = x2.reshape(shape)
    elif data == "outlier_row":
        x.reshape(-1, shape[-1])[3] *= 1e4
    elif data == "tiny_amax":
        x = x * 1e-30
    elif data == "small_amax":
        x = x * 2.0 ** -16
    elif data == "large":
        x = x * 1000
    return x


def tstore(t):
    return t.transpose(-1, -2).contiguous().transpose(-1, -2)


def make_case(recipe, trig, seed=0, base=None):
    c = dict(lead=(32,), K=32, N=48, in_dt="bf16", w_dt="bf16", in_T=False, w_T=False,
             go_T=False, bias=False, data="normal", steps=1)
    if recipe == "blockwise":
        c.update(lead=(128,), K=128, N=256)
    if base:
        c.update(base)
    for t in trig:
        if t == "non-contiguous input": c["in_T"] = True
        elif t == "non-contiguous weight": c["w_T"] = True
        elif t == "non-contiguous grad_output": c["go_T"] = True
        elif t == "K == N": c["N"] = c["K"]
        elif t == "N-D input": c["lead"] = (2, c["lead"][0] // 2) if recipe != "blockwise" else (2, 64)
        elif t == "fp32 input": c["in_dt"] = "fp32"
        elif t == "fp16 input": c["in_dt"] = "fp16"
        elif t == "fp32 weight": c["w_dt"] = "fp32"
        elif t == "second call": c["steps"] = 2
        elif t == "bias": c["bias"] = True
        elif t.startswith("data:"): c["data"] = t[5:]
    c["seed"] = seed
    return c


def build(c):
    g = torch.Generator().manual_seed(c["seed"])
    shape = tuple(c["lead"]) + (c["K"],)
    x = gen(c["data"], shape, g).to(DT[c["in_dt"]])
    w = (torch.randn(c["N"], c["K"], generator=g) * c["K"] ** -0.5).to(DT[c["w_dt"]])
    b = (torch.randn(c["N"], generator=g) * 0.1).to(DT[c["w_dt"]])
    go = torch.randn(tuple(c["lead"]) + (c["N"],), generator=g).to(DT[c["in_dt"]])
    if c["in_T"]: x = tstore(x)
    if c["w_T"]: w = tstore(w)
    if c["go_T"]: go = tstore(go)
    return x, w, b, go


def instantiate(impl, form, recipe, w, b, has_bias):
    lin = nn.Linear(w.shape[1], w.shape[0], bias=has_bias, dtype=w.dtype)
    lin.weight = nn.Parameter(_keep(w))
    if has_bias:
        lin.bias = nn.Parameter(b.clone())
    if impl == "torchao":
        from torchao.float8 import convert_to_float8_training, Float8LinearConfig
        seq = nn.Sequential(lin)
        convert_to_float8_training(seq, config=Float8LinearConfig.from_recipe_name(recipe))
        m = seq[0]
        return m, m.weight, m.bias
    f = load(impl)
    if form == "module":
        m = f.from_float(lin)
        return m, m.weight, m.bias
    if form == "converter":
        m = f(lin)
        return m, m.weight, m.bias
    wp, bp = lin.weight, lin.bias

    def call(x):
        x2 = x.reshape(-1, x.shape[-1])
        out = f(x2, wp, bias=bp) if bp is not None else f(x2, wp)
        return out.reshape(*x.shape[:-1], out.shape[-1])
    return call, wp, bp


def _keep(w):
    out = torch.empty_strided(w.shape, w.stride(), dtype=w.dtype)
    out.copy_(w)
    return out


class Rec(TorchDispatchMode):
    def __init__(self):
        super().__init__(); self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.ops.aten._scaled_mm.default,):
            a, bb = args[0], args[1]
            sa, sb = args[2], args[3]
            ok = (a.stride(1) == 1 and a.stride(0) >= a.shape[1] and bb.stride(0) == 1
                  and bb.stride(1) >= bb.shape[0] and a.shape[1] % 16 == 0 and bb.shape[1] % 16 == 0
                  and sa.dtype == torch.float32 and sb.dtype == torch.float32)
            self.calls.append(ok)
        return func(*args, **(kwargs or {}))


def run(impl, form, recipe, c, record=False):
    """Returns (results dict, error stage or None, gpu-rule list)."""
    x, w, b, go = build(c)
    res, rec = {}, Rec()
    stage = "output"
    try:
        m, wp, bp = instantiate(impl, form, recipe, w, b, c["bias"])
        for step in range(c["steps"]):
            if step > 0:
                with torch.no_grad():
                    wp.mul_(3).add_(0.01)
            xi = _keep(x).requires_grad_()
            wp.grad = None
            if bp is not None: bp.grad = None
            stage = "output"
            with (rec if (record and step == c["steps"] - 1) else _Null()):
                out = m(xi)
                res["output"] = out.detach().clone()
                stage = "backward"
                out.backward(go)
        res["grad_input"] = xi.grad
        res["grad_weight"] = wp.grad
        res["grad_bias"] = bp.grad if bp is not None else None
        res["_w"] = wp.detach().clone()
        res["_b"] = bp.detach().clone() if bp is not None else None
        return res, None, rec.calls
    except Exception as e:  # noqa
        res["_err"] = repr(e)[:200]
        return res, stage, rec.calls


class _Null:
    def __enter__(self): return self
    def __exit__(self, *a): return False


def same(a, b):
    if a is None or b is None:
        return a is None and b is None
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return bool(((a == b) | (a.isnan() & b.isnan())).all())


def first_diff(r1, e1, r2, e2):
    r1 = {k: v for k, v in r1.items() if not k.startswith("_")}
    r2 = {k: v for k, v in r2.items() if not k.startswith("_")}
    """First GEMM whose result differs between two runs (or raises in one)."""
    for g in GEMMS:
        k = g
        if e1 == "output" or e2 == "output":
            return "output" if g == "output" and e1 != e2 else ("output" if e1 == e2 else "output")
        if g != "output" and (e1 == "backward") != (e2 == "backward"):
            return "grad_input|grad_weight"
        if e1 == "backward" and e2 == "backward":
            return None if g == "output" and same(r1.get(k), r2.get(k)) else None
        if not same(r1.get(k), r2.get(k)):
            return g
        if g == "output" and not same(r1.get("grad_bias"), r2.get("grad_bias")):
            pass
    if not same(r1.get("grad_bias"), r2.get("grad_bias")):
        return "grad_bias"
    return None


def emu_block(x, w, go):
    """float64 emulation of the blockwise recipe; returns out, gi, gw (float64) and bound mats."""
    def q(t, tile_rows, tile_cols):
        t = t.float()
        R, C = t.shape
        tt = t.reshape(R // tile_rows, tile_rows, C // tile_cols, tile_cols)
        amax = tt.abs().amax(dim=(1, 3), keepdim=True)
        s = (448.0 / amax.clamp(min=1e-12)).float()
        qq = (tt * s).clamp(-448, 448).to(torch.float8_e4m3fn).double() / s.double()
        return qq.reshape(R, C)
    x2 = x.reshape(-1, x.shape[-1]); go2 = go.reshape(-1, go.shape[-1])
    out = q(x2, 1, 128) @ q(w, 128, 128).t()
    gi = q(go2, 1, 128) @ q(w.t().contiguous(), 128, 128).t()
    gw = q(go2.t().contiguous(), 1, 128) @ q(x2.t().contiguous(), 1, 128).t()
    absb = [(q(x2, 1, 128).abs() @ q(w, 128, 128).t().abs()),
            (q(go2, 1, 128).abs() @ q(w.t().contiguous(), 128, 128).t().abs()),
            (q(go2.t().contiguous(), 1, 128).abs() @ q(x2.t().contiguous(), 1, 128).t().abs())]
    return [out, gi, gw], absb


def check_block(r, c):
    x, w, b, go = build(c)
    w = r["_w"]
    vals, absb = emu_block(x, w, go)
    if r["_b"] is not None:
        bb = r["_b"].double()
        vals[0] = vals[0] + bb
        absb[0] = absb[0] + 2 * bb.abs() + vals[0].abs()
    for g, v, ab in zip(GEMMS, vals, absb):
        got = r[g].double().reshape(v.shape)
        E = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11, torch.float32: 2.0 ** -24}
        eps_out = max(E[r[g].dtype], E[DT[c["in_dt"]]])
        K = {"output": c["K"], "grad_input": c["N"], "grad_weight": x.reshape(-1, c["K"]).shape[0]}[g]
        bound = eps_out * v.abs() + (K * 2.0 ** -23 + eps_out) * ab + 1e-30
        if not bool(((got - v).abs() <= bound).all()):
            return False, g
    return True, None


CORRECT_CASES = [
    [], ["bias"], ["fp32 input"], ["fp16 input"], ["N-D input"], ["non-contiguous input"],
    ["non-contiguous weight"], ["non-contiguous grad_output"], ["fp32 weight", "bias"],
    ["K == N", "data:outlier"], ["second call", "data:zero_rows"], ["N-D input", "fp32 input", "bias", "data:large"],
    ["data:tiny_amax"], ["data:nearmax", "non-contiguous input"],
]


def main():
    t0 = time.time()
    man = json.load(open(os.path.join(HERE, "manifest.json")))
    only = [a for a in sys.argv[1:]]
    if only:
        man = [e for e in man if e["name"] in only or e["category"] == "none" and "correct" in only]
    by_name = {e["name"]: e for e in man}
    nc = ok_c = nb = ok_b = wrong = 0
    for e in man:
        if e["category"] != "none":
            continue
        nc += 1
        good = True
        for trig in CORRECT_CASES:
            if e["recipe"] != "tensorwise" and "N-D input" in trig and "non-contiguous input" in trig:
                continue
            c = make_case(e["recipe"], trig, seed=len(trig))
            r, err, _ = run(e["impl"], e["form"], e["recipe"], c)
            if err:
                print(f"  FAIL {e['name']} {trig}: raised {r.get('_err')}"); good = False; continue
            if e["recipe"] == "blockwise":
                okb, g = check_block(r, c)
                if not okb:
                    print(f"  FAIL {e['name']} {trig}: {g} outside bound"); good = False
                continue
            rr, err2, _ = run("torchao", "module", e["recipe"], c)
            d = first_diff(r, None, rr, err2)
            if d:
                print(f"  FAIL {e['name']} {trig}: differs from torchao at {d}"); good = False
        ok_c += good
        print(f"correct {e['name']}: {'OK' if good else 'FAIL'}")
    for e in man:
        if e["category"] == "none":
            continue
        nb += 1
        twin_impl = TWINS[e["name"]]
        trig = e["trigger"]
        gpu = "gpu only" in trig
        trig_cpu = [t for t in trig if t != "gpu only"]
        msgs = []
        c = make_case(e["recipe"], trig_cpu, seed=SEED)
        rb, eb, cb = run(e["impl"], e["form"], e["recipe"], c, record=gpu)
        rt, et, ct = run(twin_impl, e["form"], e["recipe"], c, record=gpu)
        if gpu:
            d = first_diff(rb, eb, rt, et)
            if d:
                msgs.append(f"differs on CPU at {d}")
            bad = [GEMMS[i] for i, okk in enumerate(cb) if not okk]
            if not all(ct) or not bad or bad[0] != e["gemm"]:
                msgs.append(f"gpu rule: bug {cb} twin {ct}")
        else:
            d = first_diff(rb, eb, rt, et)
            if d is None:
                msgs.append("no difference with trigger")
            elif not (d == e["gemm"] or (d == "grad_input|grad_weight" and e["gemm"] != "output")):
                msgs.append(f"first diff at {d}, labelled {e['gemm']} ({rb.get('_err')})")
                wrong += 1
            for t in trig_cpu:
                c2 = make_case(e["recipe"], [u for u in trig_cpu if u != t], seed=SEED)
                r1, e1, _ = run(e["impl"], e["form"], e["recipe"], c2)
                r2, e2, _ = run(twin_impl, e["form"], e["recipe"], c2)
                d2 = first_diff(r1, e1, r2, e2)
                if d2:
                    msgs.append(f"still differs without '{t}' at {d2}")
        ok_b += not msgs
        print(f"bug {e['name']} [{e['category']}/{e['gemm']}/{trig}]: {'OK' if not msgs else 'FAIL ' + '; '.join(msgs)}")
    print(f"SUMMARY: correct {ok_c}/{nc} verified, bugs {ok_b}/{nb} verified, {wrong} wrong label(s), {time.time() - t0:.0f}s")


TWINS = {}
SEED = int(os.environ.get("H11_SEED", "1"))
if __name__ == "__main__":
    man0 = json.load(open(os.path.join(HERE, "manifest.json")))
    for e in man0:
        if e["category"] != "none":
            TWINS[e["name"]] = e.get("twin_impl") or None
    tw = json.load(open(os.path.join(HERE, "twins.json"))) if os.path.exists(os.path.join(HERE, "twins.json")) else {}
    TWINS.update(tw)
    main()
