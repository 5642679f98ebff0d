"""verify.py for the frozen heldout12 set (run on CPU):

    OMP_NUM_THREADS=2 /work/main/.venv/bin/python property_tests/heldout12/verify.py

1. every correct implementation: tensorwise / rowwise / rowwise_with_gw_hp bitwise equal to
   torchao 0.18 Float8Linear (output, grad_input, grad_weight, grad_bias; values, dtype, shape,
   strides) over a set of cases; blockwise within one unit in the last place (of the output
   dtype) of an independent float64 emulation of the blockwise recipe;
2. every planted bug against its correct twin: with its trigger applied it must differ (crash
   bugs: must raise while the twin does not); without the trigger (and without each single
   trigger token, for multi-token triggers) it must not differ; for CPU-visible non-crash bugs,
   the first differing GEMM must be the manifest's `gemm`. Bugs marked devices ["cuda"] can only
   be checked here for being CPU-identical to their twin.
Exits 1 on any failure.
"""
import importlib.util
import inspect
import json
import os
import sys
import time
import warnings

import torch
from torch import nn

warnings.filterwarnings("ignore")
torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
DT = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}
E4M3 = torch.float8_e4m3fn

# ----------------------------------------------------------------------------- loading
_CACHE = {}


def load(impl):
    path, attr = impl.rsplit(":", 1)
    full = os.path.join(REPO, path)
    if full not in _CACHE:
        name = "heldout12_" + os.path.splitext(os.path.basename(full))[0]
        spec = importlib.util.spec_from_file_location(name, full)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        _CACHE[full] = mod
    return getattr(_CACHE[full], attr)


class FunctionLayer(nn.Module):
    """How a function-form implementation is driven: 2-D input, weight, bias."""

    def __init__(self, fn, linear):
        super().__init__()
        self.fn = fn
        self.weight = linear.weight
        self.bias = linear.bias
        self.takes_bias = "bias" in inspect.signature(fn).parameters

    def forward(self, x):
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        if self.takes_bias:
            y = self.fn(x2, self.weight, bias=self.bias)
        else:
            y = self.fn(x2, self.weight)
            if self.bias is not None:
                y = y + self.bias.to(y.dtype)
        return y.reshape(*lead, y.shape[-1])


def build(entry_or_ref, linear):
    if entry_or_ref == "torchao":
        raise AssertionError
    form, obj = entry_or_ref
    if form == "function":
        return FunctionLayer(obj, linear)
    if form == "module":
        return obj.from_float(linear)
    return obj(linear)


def torchao_layer(recipe, linear):
    from torchao.float8.config import Float8LinearConfig
    from torchao.float8.float8_linear import Float8Linear

    return Float8Linear.from_float(linear, config=Float8LinearConfig.from_recipe_name(recipe))


# ----------------------------------------------------------------------------- cases
DEFAULT = dict(M=32, K=48, N=64, nd=False, in_dt="bf16", w_dt="bf16", bias=False,
               x_nc=False, w_nc=False, go_nc=False, data="normal", steps=1, seed=0)
BLOCK_DEFAULT = dict(DEFAULT, M=256, K=256, N=128)
# every check runs on these variants of the default case (seed, shape)
VARIANTS = [dict(seed=0), dict(seed=1, M=16, K=64, N=32), dict(seed=2, M=64, K=32, N=48)]
BLOCK_VARIANTS = [dict(seed=0), dict(seed=1, M=128, K=384, N=256), dict(seed=2, M=384, K=128, N=256)]


def apply_trigger(case, tokens):
    c = dict(case)
    for t in tokens:
        if t == "non-contiguous input":
            c["x_nc"] = True
        elif t == "non-contiguous weight":
            c["w_nc"] = True
        elif t == "non-contiguous grad_output":
            c["go_nc"] = True
        elif t == "K == N":
            c["K"] = c["N"]
        elif t == "N-D input":
            c["nd"] = True
        elif t == "fp32 input":
            c["in_dt"] = "fp32"
        elif t == "fp16 input":
            c["in_dt"] = "fp16"
        elif t == "fp32 weight":
            c["w_dt"] = "fp32"
        elif t == "second call":
            c["steps"] = 2
        elif t == "bias":
            c["bias"] = True
        elif t == "gpu only":
            pass
        elif t.startswith("data:"):
            c["data"] = t[5:]
        else:
            raise ValueError(t)
    return c


def gen(shape, data, gen_, scale=1.0):
    x = torch.randn(*shape, generator=gen_, dtype=torch.float64)
    if data == "uniform":
        x = torch.rand(*shape, generator=gen_, dtype=torch.float64) * 2 - 1
    elif data == "negative":
        x = -x.abs() + 0.05 * torch.rand(*shape, generator=gen_, dtype=torch.float64)
    elif data == "zero_rows":
        x2 = x.reshape(-1, shape[-1])
        x2[: max(1, x2.shape[0] // 4)] = 0
        x2[:, : max(1, x2.shape[1] // 4)] = 0
        x = x2.reshape(shape)
    elif data == "small_amax":
        x = x * 2.0 ** -16
    elif data == "tiny_amax":
        x = x * 1e-30
    elif data == "large":
        x = x * 1000.0
    elif data == "outlier":
        x[..., 3] *= 100.0
    elif data == "zeros":
        x = torch.zeros_like(x)
    return x * scale


def make_tensor(shape, dtype, noncontig, data, g):
    if not noncontig:
        return gen(shape, data, g).to(dtype)
    # same logical values, transposed storage of the last two dims
    t_shape = list(shape[:-2]) + [shape[-1], shape[-2]]
    v = gen(t_shape, data, g).to(dtype)
    return v.transpose(-1, -2)


def run(layer_factory, case):
    """Returns per-step tuple (out, grad_input, grad_weight, grad_bias) of the last step, or raises."""
    g = torch.Generator().manual_seed(1000 + case["seed"])
    K, N, M = case["K"], case["N"], case["M"]
    wdt, idt = DT[case["w_dt"]], DT[case["in_dt"]]
    lin = nn.Linear(K, N, bias=case["bias"], dtype=wdt)
    with torch.no_grad():
        w = make_tensor((N, K), wdt, case["w_nc"], "normal", g) * 0.1
        lin.weight = nn.Parameter(w if case["w_nc"] else w.contiguous())
        if case["bias"]:
            lin.bias.copy_(gen((N,), "normal", g).to(wdt))
    layer = layer_factory(lin)
    xshape = (2, M // 2, K) if case["nd"] else (M, K)
    goshape = xshape[:-1] + (N,)
    xv = make_tensor(xshape, idt, case["x_nc"], case["data"], g)
    res = None
    for step in range(case["steps"]):
        x = xv.detach().clone()  # clone keeps the (possibly transposed) strides
        x.requires_grad_(True)
        lin.weight.grad = None
        if lin.bias is not None:
            lin.bias.grad = None
        out = layer(x)
        gg = torch.Generator().manual_seed(2000 + step)
        go = make_tensor(goshape, out.dtype if out.dtype.is_floating_point else idt,
                         case["go_nc"], "normal", gg)
        if go.shape != out.shape:  # a shape-contract violation: report the forward only
            return (out.detach(), None, None, None)
        out.backward(go)
        res = (out.detach(), x.grad, lin.weight.grad,
               None if lin.bias is None else lin.bias.grad)
        with torch.no_grad():  # in-place optimizer-like update between calls
            lin.weight.mul_(0.5).add_(gen(lin.weight.shape, "normal", gg).to(wdt) * 0.05)
    return res


NAMES = ("output", "grad_input", "grad_weight", "grad_bias")


def same(a, b):
    if a is None or b is None:
        return a is None and b is None, "presence"
    if a.dtype != b.dtype:
        return False, f"dtype {a.dtype} vs {b.dtype}"
    if a.shape != b.shape:
        return False, f"shape {tuple(a.shape)} vs {tuple(b.shape)}"
    if a.stride() != b.stride():
        return False, f"strides {a.stride()} vs {b.stride()}"
    af, bf = a.float(), b.float()
    eq = (af == bf) | (torch.isnan(af) & torch.isnan(bf))
    if not bool(eq.all()):
        return False, f"{int((~eq).sum())} values differ"
    return True, ""


def first_diff(ra, rb):
    for name, a, b in zip(NAMES, ra, rb):
        ok, why = same(a, b)
        if not ok:
            return name, why
    return None, ""


# ----------------------------------------------------------------------------- blockwise emulation
def _quant_groups(x, gr, gc):
    """float64 dequantized values of x after the blockwise e4m3 cast with gr x gc groups."""
    R, C = x.shape
    t = x.reshape(R // gr, gr, C // gc, gc)
    amax = t.abs().amax(dim=(1, 3), keepdim=True).to(torch.float64).clamp(min=1e-12)
    scale = (448.0 / amax).to(torch.float32)
    q = (t.to(torch.float32) * scale).clamp(-448.0, 448.0).to(E4M3)
    inv = (1.0 / scale)
    return (q.to(torch.float64) * inv.to(torch.float64)).reshape(R, C)


def emulate_blockwise(case):
    """Expected (out, grad_input, grad_weight, grad_bias) of the blockwise recipe in float64,
    rounded once to the output dtype, for the same data `run` generates."""
    captured = {}

    class Probe(nn.Module):
        def __init__(self, lin):
            super().__init__()
            self.lin = lin

        def forward(self, x):
            captured["x"] = x.detach().clone()
            captured["w"] = self.lin.weight.detach().clone()
            captured["b"] = None if self.lin.bias is None else self.lin.bias.detach().clone()
            y = torch.nn.functional.linear(x.to(self.lin.weight.dtype), self.lin.weight).to(x.dtype)
            if self.lin.bias is not None:
                y = y + self.lin.bias.to(y.dtype)
            y.register_hook(lambda g: captured.__setitem__("go", g.detach().clone()))
            return y

    run(lambda lin: Probe(lin), case)
    x, w, go = captured["x"], captured["w"], captured["go"]
    odt = x.dtype
    K, N = w.shape[1], w.shape[0]
    x2, go2 = x.reshape(-1, K), go.reshape(-1, N)
    out = _quant_groups(x2, 1, 128) @ _quant_groups(w, 128, 128).t()
    gi = _quant_groups(go2, 1, 128) @ _quant_groups(w, 128, 128)
    gw = _quant_groups(go2, 128, 1).t() @ _quant_groups(x2, 128, 1)
    # fp16 results go through a bf16 GEMM output (as torchao's rowwise recipes do)
    mid = torch.bfloat16 if odt == torch.float16 else odt
    out, gi, gw = out.to(mid), gi.to(mid), gw.to(mid)
    out = out.to(odt)
    if captured.get("b") is not None:
        out = out + captured["b"].to(odt)
    # weight.grad: the GEMM result in grad_output's dtype, then autograd's cast to weight's
    return (out.reshape(*x.shape[:-1], N), gi.to(odt).reshape(x.shape),
            gw.to(odt).to(w.dtype), go2.sum(0))


def within_ulp(a, e, dtype):
    """|a - e| <= one ulp of `dtype` at |e| (plus 1e-30 absolute for zeros)."""
    mant = {torch.bfloat16: 7, torch.float32: 23, torch.float16: 10}[dtype]
    e64, a64 = e.to(torch.float64), a.to(torch.float64)
    ulp = torch.exp2(torch.floor(torch.log2(e64.abs().clamp(min=1e-300))) - mant)
    err = (a64 - e64).abs()
    ok = bool((err <= ulp + 1e-30).all())
    return ok, float((err / (ulp + 1e-30)).max())


# ----------------------------------------------------------------------------- main
def main():
    t0 = time.time()
    manifest = json.load(open(os.path.join(HERE, "manifest.json")))
    twins = json.load(open(os.path.join(HERE, "twins.json")))
    by_name = {e["name"]: e for e in manifest}
    failures = []

    def factory(entry):
        obj = load(entry["impl"])
        return lambda lin: build((entry["form"], obj), lin)

    # 1. correct implementations
    correct_cases = [
        [], ["fp32 input"], ["fp32 weight"], ["fp32 input", "fp32 weight"], ["N-D input"],
        ["bias"], ["non-contiguous input"], ["non-contiguous weight"],
        ["non-contiguous grad_output"], ["K == N"], ["second call"], ["data:zero_rows"],
        ["data:small_amax"], ["data:large"], ["data:tiny_amax"], ["data:negative"],
        ["bias", "N-D input", "fp32 input"], ["fp16 input"], ["non-contiguous input", "N-D input"],
    ]
    n_correct_checks = 0
    for e in manifest:
        if e["category"] != "none":
            continue
        block = e["recipe"] == "blockwise"
        for toks, var in [(t, v) for t in correct_cases for v in (BLOCK_VARIANTS if block else VARIANTS)]:
            case = apply_trigger(dict(BLOCK_DEFAULT if block else DEFAULT, **var), toks)
            if e["recipe"] in ("rowwise", "rowwise_with_gw_hp") and case["nd"] and case["x_nc"]:
                continue  # torchao 0.18 limitation
            try:
                got = run(factory(e), case)
            except Exception as exc:  # noqa: BLE001
                failures.append(f"{e['name']} {toks}: raised {type(exc).__name__}: {exc}")
                continue
            if block:
                exp = emulate_blockwise(case)
                for name, a, b in zip(NAMES, got, exp):
                    if a is None and b is None:
                        continue
                    if name == "grad_bias":
                        if case["bias"] and not torch.allclose(a.double(), b.double(), rtol=1e-2, atol=1e-2):
                            failures.append(f"{e['name']} {toks}: grad_bias off")
                        continue
                    if a.dtype != b.dtype or a.shape != b.shape:
                        failures.append(f"{e['name']} {toks}: {name} dtype/shape {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}")
                        continue
                    ok, worst = within_ulp(a, b, torch.bfloat16 if a.dtype == torch.float16 else a.dtype)
                    if not ok:
                        failures.append(f"{e['name']} {toks}: {name} beyond 1 ulp of the fp64 emulation (worst {worst:.2f} ulp)")
            else:
                ref = run(lambda lin: torchao_layer(e["recipe"], lin), case)
                name, why = first_diff(got, ref)
                if name is not None:
                    failures.append(f"{e['name']} {toks}: {name} differs from torchao ({why})")
            n_correct_checks += 1
    print(f"[correct] {sum(e['category'] == 'none' for e in manifest)} implementations, "
          f"{n_correct_checks} case checks, {time.time() - t0:.0f}s")

    # 2. planted bugs
    n_ok = 0
    cuda_only = 0
    for e in manifest:
        if e["category"] == "none":
            continue
        twin = by_name[twins[e["name"]]]
        block = e["recipe"] == "blockwise"
        base = BLOCK_DEFAULT if block else DEFAULT
        trig = [t for t in e["trigger"]]
        cpu_visible = "cpu" in e["devices"]
        problems = []

        def compare(toks):
            outcomes = [compare1(toks, var) for var in (BLOCK_VARIANTS if block else VARIANTS)]
            kinds = {k for k, _ in outcomes}
            if len(kinds) > 1:  # not the same behaviour on every seed/shape
                return "mixed", "; ".join(f"{k} {i}" for k, i in outcomes)
            return outcomes[0][0], "; ".join(i for _, i in outcomes)

        def compare1(toks, var):
            case = apply_trigger(dict(base, **var), toks)
            try:
                rt = run(factory(twin), case)
            except Exception as exc:  # noqa: BLE001
                return "twin-raised", f"{type(exc).__name__}: {exc}"
            try:
                rb = run(factory(e), case)
            except Exception as exc:  # noqa: BLE001
                return "raised", f"{type(exc).__name__}: {str(exc)[:80]}"
            name, why = first_diff(rb, rt)
            return ("differs", f"{name}: {why}") if name else ("same", "")

        if cpu_visible:
            kind, info = compare(trig)
            if kind == "twin-raised":
                problems.append(f"twin raised with trigger: {info}")
            elif e["category"] == "crash":
                if kind != "raised":
                    problems.append(f"crash bug did not raise with trigger ({kind} {info})")
            else:
                if kind != "differs":
                    problems.append(f"no difference with trigger ({kind} {info})")
                elif any(not i.startswith(e["gemm"] + ":") for i in info.split("; ")):
                    problems.append(f"first difference is {info}, manifest says {e['gemm']}")
            if trig:
                subsets = [[]] + ([[t for t in trig if t != u] for u in trig] if len(trig) > 1 else [])
                for sub in subsets:
                    kind, info = compare(sub)
                    if kind != "same":
                        problems.append(f"differs without full trigger {sub}: {kind} {info}")
        else:
            cuda_only += 1
            # CPU cannot see it: with its trigger applied (minus 'gpu only') it must be CPU-identical
            for sub in ([[t for t in trig if t != "gpu only"]] + ([[]] if trig else [])):
                kind, info = compare(sub)
                if kind != "same":
                    problems.append(f"cuda-only bug differs on CPU with {sub}: {kind} {info}")
        if problems:
            failures.append(f"{e['name']}: " + "; ".join(problems))
        else:
            n_ok += 1
    n_bugs = sum(e["category"] != "none" for e in manifest)
    print(f"[bugs] {n_ok}/{n_bugs} behave as labelled ({cuda_only} cuda-only, checked CPU-identical), "
          f"{time.time() - t0:.0f}s")
    for f in failures:
        print("FAIL", f)
    print("RESULT:", "PASS" if not failures else f"FAIL ({len(failures)})")
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
