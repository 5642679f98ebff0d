"""Check the held-out set by execution on a CPU.

    python property_tests/heldout3/verify.py [NAME ...]

Standalone: imports only torch, torchao and the files of this folder.

1. Every correct_* entry of tensorwise / rowwise / rowwise_with_gw_hp must be
   bitwise equal to torchao 0.18's Float8Linear (convert_to_float8_training with
   Float8LinearConfig.from_recipe_name(recipe)) in output, grad_input and
   grad_weight (values and dtypes) on a few small cases.  The blockwise ones are
   compared with an independent float64 emulation of the recipe (torchao's
   blockwise prototype needs Triton and a GPU).
2. Every buggy entry runs beside the reference correct implementation of its
   recipe on a plain case and on a case that satisfies its trigger; the script
   prints which of output / grad_input / grad_weight differ (values, dtype,
   shape, output strides, or a crash) and checks that the first differing GEMM
   is the manifest's "gemm", and that the plain case shows no difference when
   the entry has a trigger.  Entries whose trigger contains "gpu only" cannot be
   checked on a CPU (torch._scaled_mm ignores use_fast_accum there): their plain
   case is run and reported, and they are marked CUDA-ONLY.
"""
import copy
import importlib.util
import json
import math
import os
import sys
import warnings

warnings.filterwarnings("ignore")
sys.dont_write_bytecode = True

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
GEMMS = ("output", "grad_input", "grad_weight")
REFERENCE = {
    "tensorwise": "correct_tensorwise",
    "rowwise": "correct_rowwise",
    "rowwise_with_gw_hp": "correct_rowwise_with_gw_hp",
    "blockwise": "correct_blockwise",
}


# ---------------------------------------------------------------- loading

_modules = {}


def load(impl):
    path, attr = impl.rsplit(":", 1)
    full = os.path.join(ROOT, path)
    if full not in _modules:
        name = "heldout3_" + os.path.splitext(os.path.basename(full))[0]
        spec = importlib.util.spec_from_file_location(name, full)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        _modules[full] = mod
    return getattr(_modules[full], attr)


# ---------------------------------------------------------------- cases

def make_case(recipe, trigger, seed=0):
    t = set(trigger)
    blockwise = recipe == "blockwise"
    M, K, N = (256, 256, 128) if blockwise else (64, 128, 96)
    if "K == N" in t:
        N = K
    return dict(
        M=M, K=K, N=N, seed=seed,
        x_dtype=torch.float32 if "fp32 input" in t else torch.float16 if "fp16 input" in t else torch.bfloat16,
        w_dtype=torch.float32 if "fp32 weight" in t else torch.bfloat16,
        nd="N-D input" in t, bias="bias" in t,
        nc_input="non-contiguous input" in t, nc_weight="non-contiguous weight" in t,
        nc_grad="non-contiguous grad_output" in t,
        second_call="second call" in t,
        data=next((tok.split(":", 1)[1] for tok in t if tok.startswith("data:")), "gaussian"),
    )


def _strided(t):
    """Same values, transposed storage of the last two dims."""
    return t.transpose(-1, -2).contiguous().transpose(-1, -2)


def _input_data(shape, kind, g):
    M = math.prod(shape[:-1])
    K = shape[-1]
    x = torch.randn(M, K, generator=g)
    if kind == "zeros":
        x.zero_()
    elif kind == "nearmax":
        x = torch.sign(x) * (400 + 48 * torch.rand(M, K, generator=g))
    elif kind == "tiny":
        x = torch.sign(x) * torch.exp2(-30 + 20 * torch.rand(M, K, generator=g))
    elif kind == "outlier":
        x[:, K // 3] *= 100
    elif kind == "zero_rows":
        x[::5] = 0
        x[:, ::7] = 0
    elif kind == "outlier_row":
        x[M // 2] *= 1e4
    elif kind != "gaussian":
        raise ValueError(kind)
    return x.reshape(shape)


def build(case):
    g = torch.Generator().manual_seed(1234 + case["seed"])
    M, K, N = case["M"], case["K"], case["N"]
    lin = nn.Linear(K, N, bias=case["bias"])
    with torch.no_grad():
        lin.weight.copy_(torch.randn(N, K, generator=g) / math.sqrt(K))
        if case["bias"]:
            lin.bias.copy_(torch.randn(N, generator=g) * 0.1)
    lin = lin.to(case["w_dtype"])
    if case["nc_weight"]:
        lin.weight = nn.Parameter(_strided(lin.weight.detach()))
    shape = (4, M // 4, K) if case["nd"] else (M, K)
    x = _input_data(shape, case["data"], g).to(case["x_dtype"])
    go = torch.randn(*shape[:-1], N, generator=g).to(case["x_dtype"])
    if case["nc_input"]:
        x = _strided(x)
    if case["nc_grad"]:
        go = _strided(go)
    return lin, x, go


# ---------------------------------------------------------------- running

class _CountGemms(TorchDispatchMode):
    OPS = {"aten::_scaled_mm", "aten::_scaled_mm_v2", "aten::mm"}

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func._schema.name in self.OPS:
            self.n += 1
        return out


def _make(kind, impl, lin):
    lin = copy.deepcopy(lin)
    if kind == "torchao":
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        m = convert_to_float8_training(nn.Sequential(lin), config=Float8LinearConfig.from_recipe_name(impl))
        return m, m[0].weight
    if kind == "function":
        f = impl

        class _Harness(nn.Module):
            def __init__(self):
                super().__init__()
                self.weight, self.bias = lin.weight, lin.bias

            def forward(self, x):
                y = f(x.reshape(-1, x.shape[-1]), self.weight).reshape(*x.shape[:-1], self.weight.shape[0])
                return y if self.bias is None else y + self.bias.to(y.dtype)

        m = _Harness()
        return m, m.weight
    if kind == "module":
        m = impl.from_float(lin)
        return m, m.weight
    if kind == "converter":
        m = impl(nn.Sequential(lin))
        return m, m[0].weight
    raise ValueError(kind)


def _step(m, w, x0, go):
    """One forward + backward: {gemm: tensor or ('crash', message)}."""
    x = x0.detach().requires_grad_()
    res = {}
    try:
        y = m(x)
        res["output"] = y.detach()
    except Exception as e:                                  # noqa: BLE001
        res["output"] = ("crash", f"{type(e).__name__}: {str(e).splitlines()[0][:90]}")
        return res
    w.grad = None
    counter = _CountGemms()
    try:
        with counter:
            y.backward(go)
        res["grad_input"] = x.grad
        res["grad_weight"] = w.grad
    except Exception as e:                                  # noqa: BLE001
        msg = f"{type(e).__name__}: {str(e).splitlines()[0][:90]}"
        # which backward GEMM raised: none of its GEMM ops completed -> grad_input
        where = "grad_input" if counter.n == 0 else "grad_weight"
        res[where] = ("crash", msg)
    return res


def run(kind, impl, case):
    lin, x, go = build(case)
    m, w = _make(kind, impl, lin)
    res = _step(m, w, x, go)
    if case["second_call"]:
        if isinstance(res.get("output"), tuple):
            return res
        with torch.no_grad():                               # an optimizer step, in place
            g = torch.Generator().manual_seed(99)
            w.mul_(0.5).add_(torch.randn(w.shape, generator=g).to(w.dtype) * 0.05)
        res = _step(m, w, x, go)
    return res


def compare(a, b, gemm):
    """'=' when equal, else what differs."""
    if isinstance(a, tuple) or isinstance(b, tuple):
        if isinstance(a, tuple) and isinstance(b, tuple):
            return "=" if a == b else "CRASH(both)"
        return "CRASH" if isinstance(a, tuple) else "CRASH(reference)"
    if a is None or b is None:
        return "=" if a is None and b is None else "MISSING"
    if a.shape != b.shape:
        return "shape"
    if a.dtype != b.dtype:
        return f"dtype({str(a.dtype)[6:]} vs {str(b.dtype)[6:]})"
    va, vb = a.double().nan_to_num(1e300), b.double().nan_to_num(1e300)
    if not torch.equal(va, vb):
        frac = (va != vb).float().mean().item()
        return f"values({frac:.1%})"
    if gemm == "output" and a.stride() != b.stride():
        return f"strides({a.stride()} vs {b.stride()})"
    return "="


def diff(kind, impl, ref_kind, ref_impl, case):
    got, ref = run(kind, impl, case), run(ref_kind, ref_impl, case)
    out = {}
    for gemm in GEMMS:
        if gemm not in got and gemm not in ref:
            out[gemm] = "n/a"
            continue
        if gemm not in got:
            out[gemm] = "n/a (earlier crash)"
            continue
        out[gemm] = compare(got[gemm], ref.get(gemm), gemm)
        if isinstance(got[gemm], tuple):
            out[gemm] += "  " + got[gemm][1]
    return out


def first_diff(d):
    for gemm in GEMMS:
        if not d[gemm].startswith("=") and not d[gemm].startswith("n/a"):
            return gemm
    return None


def fmt(d):
    return " | ".join(f"{g} {d[g]}" for g in GEMMS)


# ---------------------------------------------------------------- correct ones

def check_against_torchao(entry):
    kind, impl, recipe = entry["form"], load(entry["impl"]), entry["recipe"]
    cases = [
        [], ["fp32 weight", "bias"], ["fp32 input", "N-D input"], ["fp16 input", "bias"],
        ["non-contiguous input"], ["non-contiguous weight", "fp32 weight"], ["data:outlier"],
    ]
    ok = True
    for trig in cases:
        d = diff(kind, impl, "torchao", recipe, make_case(recipe, trig, seed=3))
        same = all(v == "=" for v in d.values())
        ok &= same
        print(f"    vs torchao {str(trig):40s} {'bitwise equal' if same else fmt(d)}")
    return ok


def _emulate_blockwise_fp64(x2, w, go2):
    """float64 emulation: quantize per the recipe, dequantize, matmul, round to bf16."""
    B, F8 = 128, torch.float8_e4m3fn
    mx = torch.finfo(F8).max

    def q(t, view_shape, red_dims, back):
        v = t.double().reshape(view_shape)
        s = (mx / v.abs().amax(dim=red_dims, keepdim=True).clamp(min=1e-12)).float().double()
        return ((v * s).clamp(-mx, mx).to(F8).double() / s).reshape(back)

    M, K = x2.shape
    N = w.shape[0]
    xd = q(x2, (M, K // B, B), (-1,), (M, K))
    wd = q(w, (N // B, B, K // B, B), (1, 3), (N, K))
    gd = q(go2, (M, N // B, B), (-1,), (M, N))
    gd_m = q(go2, (M // B, B, N), (1,), (M, N))
    xd_m = q(x2, (M // B, B, K), (1,), (M, K))
    return ((xd @ wd.t()).to(torch.bfloat16), (gd @ wd).to(torch.bfloat16),
            (gd_m.t() @ xd_m).to(torch.bfloat16))


def check_blockwise(entry):
    kind, impl = entry["form"], load(entry["impl"])
    ok = True
    for trig in ([], ["fp32 input", "bias"], ["fp32 weight", "N-D input"], ["non-contiguous input"]):
        case = make_case("blockwise", trig, seed=5)
        lin, x, go = build(case)
        res = run(kind, impl, case)
        x2, go2 = x.reshape(-1, x.shape[-1]), go.reshape(-1, go.shape[-1])
        emu = _emulate_blockwise_fp64(x2, lin.weight.detach(), go2)
        line = []
        for gemm, e, want in zip(GEMMS, emu, (x.dtype, x.dtype, lin.weight.dtype)):
            got = res[gemm]
            if gemm == "output" and lin.bias is not None:
                e = (e.to(x.dtype) + lin.bias.detach().to(x.dtype)).to(torch.bfloat16)
                got = got.to(torch.bfloat16) if got.dtype == torch.float32 else got
            g = got.reshape(e.shape).double()
            ulp = (e.double().abs() * 2.0 ** -7).clamp(min=2.0 ** -133)
            err = ((g - e.double()).abs() / ulp).max().item()
            frac = (g != e.to(g.dtype).double()).float().mean().item()
            good = err <= 2.0 and frac < 0.01 and res[gemm].dtype == want
            ok &= good
            line.append(f"{gemm} {frac:.2%} differ, max {err:.1f} bf16-ulp, {str(res[gemm].dtype)[6:]}")
        print(f"    vs fp64 emulation {str(trig):34s} " + " | ".join(line))
    return ok


# ---------------------------------------------------------------- main

def main(names):
    manifest = json.load(open(os.path.join(HERE, "manifest.json")))
    by_name = {e["name"]: e for e in manifest}
    todo = [by_name[n] for n in names] if names else manifest
    summary = []
    torch.manual_seed(0)
    for e in todo:
        kind, recipe = e["form"], e["recipe"]
        head = f"{e['name']}  [{recipe} / {kind} / {e['category']}]"
        if e["category"] == "none":
            print(head)
            ok = check_blockwise(e) if recipe == "blockwise" else check_against_torchao(e)
            if e["name"] != REFERENCE[recipe]:
                ref = by_name[REFERENCE[recipe]]
                d = diff(kind, load(e["impl"]), ref["form"], load(ref["impl"]), make_case(recipe, [], seed=7))
                same = all(v == "=" for v in d.values())
                ok &= same
                print(f"    vs {ref['name']:34s} {'bitwise equal' if same else fmt(d)}")
            summary.append((e["name"], "OK" if ok else "FAIL"))
            print(f"    => {'OK' if ok else 'FAIL'}")
            continue

        ref = by_name[REFERENCE[recipe]]
        args = (kind, load(e["impl"]), ref["form"], load(ref["impl"]))
        trig = e["trigger"]
        print(f"{head}  manifest: gemm={e['gemm']} operand={e['operand']} trigger={trig}")
        plain = diff(*args, make_case(recipe, [], seed=11))
        print(f"    plain   : {fmt(plain)}")
        if "gpu only" in trig:
            status = "CUDA-ONLY (not checkable on CPU; plain case " + \
                     ("shows no difference" if first_diff(plain) is None else "DIFFERS") + ")"
        else:
            if trig:
                trig_d = diff(*args, make_case(recipe, trig, seed=11))
                print(f"    trigger : {fmt(trig_d)}")
            else:
                trig_d = plain
            got = first_diff(trig_d)
            problems = []
            if got != e["gemm"]:
                problems.append(f"first differing GEMM is {got}, manifest says {e['gemm']}")
            if trig and first_diff(plain) is not None:
                problems.append("the plain case already differs")
            if e["category"] == "crash" and got and "CRASH" not in trig_d[got]:
                problems.append("expected a crash")
            status = "OK" if not problems else "MISMATCH: " + "; ".join(problems)
        print(f"    => {status}")
        summary.append((e["name"], status))

    print("\nsummary")
    for name, status in summary:
        print(f"  {name:34s} {status}")
    bad = [n for n, s in summary if not (s == "OK" or s.startswith("CUDA-ONLY"))]
    print(f"{len(summary) - len(bad)}/{len(summary)} as described")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
