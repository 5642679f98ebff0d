"""Re-check every label of held-out set 15 on the CPU.

Run from a private working directory, e.g.

    mkdir -p /tmp/h15 && cd /tmp/h15 && OMP_NUM_THREADS=2 \
        /work/main/.venv/bin/python /work/main/property_tests/heldout15/verify.py

What it checks (all bitwise, all on the CPU, no GPU and nothing of the harness imported):

1. manifest.json / twins.json are well formed and name existing files and attributes.
2. Each correct file (h15_c0*.py) equals torchao 0.18's Float8Linear
   (Float8LinearConfig.from_recipe_name) for tensorwise / rowwise / rowwise_with_gw_hp, or
   this file's own float64 emulation of the blockwise recipe, on many cases (dtypes, layouts,
   N-D input, bias, K == N, a second call after an in-place weight update, data
   distributions): output, input.grad, weight.grad and bias.grad equal in dtype, shape,
   strides and bits; its recorded _scaled_mm / _scaled_mm_v2 calls pass the GPU contract
   lint below.
3. Each bug file differs from its twin in at most two lines (module docstring excluded),
   and its docstring starts with "[planted bug: ".
4. Each bug, run beside its twin:
   - with its trigger applied, the first GEMM (first call first, then in the order output,
     grad_input, grad_weight) whose result differs is the labelled one; a crash is located in the GEMM that
     raises; "contract" bugs differ there in dtype/shape/strides, "crash" bugs raise there,
     every other class differs in values;
   - without the trigger (the default case) it is bitwise identical to its twin, and with a
     two-token trigger each token alone leaves it identical;
   - a "gpu only" bug is bitwise identical on the CPU with its other tokens applied, its
     first contract finding is in the labelled GEMM, its twin's calls are clean, and
     without its other tokens it has no finding.

The lint (the SM90 contract as DESIGN.md states it): A row-major, B column-major, inner dim
and N divisible by 16, out_dtype passed, fp32 scales, not e5m2 x e5m2, use_fast_accum only
for the output GEMM of tensorwise / rowwise / rowwise_with_gw_hp, tensorwise scales scalar,
rowwise scales [M,1] / [1,N] contiguous, blockwise scales with the exact shapes and strides
(1, rows) (even when a dimension is 1; 128x128 scales K-major, K blocks padded to 4).
"""
import ast
import sys

sys.dont_write_bytecode = True  # leave no __pycache__ beside the frozen files

import dataclasses
import difflib
import importlib.util
import inspect
import json
import os
import re
import time

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

HERE = os.path.dirname(os.path.abspath(__file__))
GEMMS = ("output", "grad_input", "grad_weight")
CATEGORIES = ("transpose", "layout", "scale", "fp8_dtype", "saturation", "accumulation",
              "contract", "stale_state", "crash")
OPERANDS = ("input", "weight", "grad_output", "result")
RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp", "blockwise")
FORMS = ("function", "module", "converter")
DISTS = ("normal", "uniform", "heavy", "outlier", "zeros", "nearmax", "tiny", "negative",
         "zero_rows", "outlier_row", "tiny_amax", "small_amax", "large")
TOKENS = ("non-contiguous input", "non-contiguous weight", "non-contiguous grad_output", "K == N",
          "N-D input", "fp32 input", "fp16 input", "fp32 weight", "second call", "bias", "gpu only")
KEYS = ["name", "impl", "form", "recipe", "category", "gemm", "operand", "trigger", "devices",
        "source", "description"]
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


# ----------------------------------------------------------------------------- cases
@dataclasses.dataclass(frozen=True)
class Case:
    recipe: str
    lead: tuple
    K: int
    N: int
    in_dtype: str = "bf16"
    w_dtype: str = "bf16"
    in_layout: str = "C"      # C contiguous, T transposed storage, S non-dense slice (NaN gaps)
    w_layout: str = "C"
    go_layout: str = "C"
    bias: bool = False
    dist: str = "normal"
    steps: int = 1
    seed: int = 0
    wrap: bool = True         # converter form: pass nn.Sequential(linear) (else the bare linear)

    def id(self):
        f = [f"{self.recipe}", "x".join(map(str, self.lead)) + f"K{self.K}N{self.N}",
             f"in:{self.in_dtype}:{self.in_layout}", f"w:{self.w_dtype}:{self.w_layout}",
             f"go:{self.go_layout}", self.dist, f"seed{self.seed}", f"steps{self.steps}"]
        if self.bias:
            f.append("bias")
        return "|".join(f)


def default_case(recipe):
    if recipe == "blockwise":
        return Case(recipe, (256,), 256, 384)
    return Case(recipe, (32,), 48, 64)


def apply_tokens(case, tokens):
    for t in tokens:
        if t == "non-contiguous input":
            case = dataclasses.replace(case, in_layout="T")
        elif t == "non-contiguous weight":
            case = dataclasses.replace(case, w_layout="T")
        elif t == "non-contiguous grad_output":
            case = dataclasses.replace(case, go_layout="T")
        elif t == "K == N":
            case = dataclasses.replace(case, K=case.N)
        elif t == "N-D input":
            m = case.lead[0]
            case = dataclasses.replace(case, lead=(2, m // 2))
        elif t == "fp32 input":
            case = dataclasses.replace(case, in_dtype="fp32")
        elif t == "fp16 input":
            case = dataclasses.replace(case, in_dtype="fp16")
        elif t == "fp32 weight":
            case = dataclasses.replace(case, w_dtype="fp32")
        elif t == "second call":
            case = dataclasses.replace(case, steps=2)
        elif t == "bias":
            case = dataclasses.replace(case, bias=True)
        elif t.startswith("data:"):
            case = dataclasses.replace(case, dist=t[5:])
        elif t == "gpu only":
            pass
        else:
            raise ValueError(f"unknown trigger token {t!r}")
    return case


def _draw_input(M, K, dist, g):
    base = torch.randn(M, K, generator=g)
    if dist == "normal":
        return base
    if dist == "uniform":
        return torch.rand(M, K, generator=g) * 2 - 1
    if dist == "heavy":   # Student-t, 3 degrees of freedom
        chi2 = (torch.randn(3, M, K, generator=g) ** 2).sum(0) / 3
        return base / chi2.sqrt()
    if dist == "outlier":
        x = base.clone()
        x[:, 1] *= 100.0
        return x
    if dist == "zeros":
        return torch.zeros(M, K)
    if dist == "nearmax":
        sign = torch.where(torch.rand(M, K, generator=g) < 0.5, -1.0, 1.0)
        return sign * (400.0 + 48.0 * torch.rand(M, K, generator=g))
    if dist == "tiny":
        sign = torch.where(torch.rand(M, K, generator=g) < 0.5, -1.0, 1.0)
        return sign * torch.exp2(-9.0 + 3.0 * torch.rand(M, K, generator=g))
    if dist == "negative":
        return base.abs() * -1.0 + 0.1 * torch.randn(M, K, generator=g)
    if dist == "zero_rows":
        x = base.clone()
        x[: max(1, M // 4)] = 0.0
        x[:, : max(1, K // 4)] = 0.0
        return x
    if dist == "outlier_row":
        x = base.clone()
        x[0] *= 1e4
        return x
    if dist == "tiny_amax":
        return base * 1e-30
    if dist == "small_amax":
        return base * 2.0 ** -16
    if dist == "large":
        return base * 1000.0
    raise ValueError(dist)


def _layout(t, kind):
    if kind == "C":
        return t.contiguous()
    if kind == "T":
        return t.transpose(-1, -2).contiguous().transpose(-1, -2)
    if kind == "S":
        buf = torch.full((*t.shape[:-1], 2 * t.shape[-1]), float("nan"), dtype=t.dtype)
        buf[..., : t.shape[-1]] = t
        return buf[..., : t.shape[-1]]
    raise ValueError(kind)


def build(case):
    """Fresh tensors for one run; the same case gives the same numbers."""
    g = torch.Generator().manual_seed(1000 + case.seed)
    M = 1
    for d in case.lead:
        M *= d
    K, N = case.K, case.N
    x = _draw_input(M, K, case.dist, g).reshape(*case.lead, K)
    w = (torch.rand(N, K, generator=g) * 2 - 1) / K ** 0.5
    b = (torch.rand(N, generator=g) * 2 - 1) / K ** 0.5
    go = torch.randn(*case.lead, N, generator=g)
    deltas = [torch.randn(N, K, generator=g) / K ** 0.5 for _ in range(case.steps)]
    xd, wd = DTYPES[case.in_dtype], DTYPES[case.w_dtype]
    x = _layout(x.to(xd), case.in_layout).detach().requires_grad_(True)
    lin = nn.Linear(K, N, bias=case.bias, device="meta")
    lin.weight = nn.Parameter(_layout(w.to(wd), case.w_layout))
    lin.bias = nn.Parameter(b.to(wd)) if case.bias else None
    go = _layout(go.to(xd), case.go_layout)
    return x, lin, go, [d.to(wd) for d in deltas]


# ----------------------------------------------------------------------------- recording
SCALED = (torch.ops.aten._scaled_mm.default, torch.ops.aten._scaled_mm_v2.default)


def _meta(v):
    if isinstance(v, torch.Tensor):
        return {"shape": tuple(v.shape), "stride": tuple(v.stride()), "dtype": v.dtype,
                "contiguous": v.is_contiguous()}
    if isinstance(v, (list, tuple)):
        return [_meta(u) for u in v]
    return v


class Recorder(TorchDispatchMode):
    """Records every aten._scaled_mm / _scaled_mm_v2 call with its arguments' metadata."""

    def __init__(self):
        super().__init__()
        self.calls = []
        self.phase = ("fwd", 0)
        self.count = {}
        self.last_failed = None

    def begin(self, phase, step):
        self.phase = (phase, step)
        self.count[self.phase] = 0
        self.last_failed = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        rec = None
        if func in SCALED:
            names = [a.name for a in func._schema.arguments]
            bound = dict(zip(names, args))
            bound.update(kwargs)
            idx = self.count[self.phase]
            self.count[self.phase] += 1
            rec = {k: _meta(v) for k, v in bound.items()}
            rec.update(op=func.overloadpacket.__name__, phase=self.phase[0], step=self.phase[1], index=idx,
                       gemm="output" if self.phase[0] == "fwd" else ("grad_input" if idx == 0 else "grad_weight"))
            self.calls.append(rec)
        try:
            out = func(*args, **kwargs)
        except Exception:
            self.last_failed = rec
            raise
        self.last_failed = None
        return out


def _rowmaj(m):
    return m["stride"][1] == 1 and m["stride"][0] >= max(1, m["shape"][1])


def _colmaj(m):
    return m["stride"][0] == 1 and m["stride"][1] >= max(1, m["shape"][0])


def lint_call(c, recipe):
    """GPU (SM90) contract findings for one recorded call."""
    f = []
    a, b = c["self"], c["mat2"]
    M, K = a["shape"]
    N = b["shape"][1]
    if not _rowmaj(a):
        f.append(f"A not row-major (strides {a['stride']})")
    if not _colmaj(b):
        f.append(f"B not column-major (strides {b['stride']})")
    if K % 16 or N % 16:
        f.append(f"K={K} or N={N} not divisible by 16")
    if c.get("out_dtype") is None:
        f.append("out_dtype not passed")
    if a["dtype"] == E5M2 and b["dtype"] == E5M2:
        f.append("e5m2 x e5m2")
    fast = bool(c.get("use_fast_accum", False))
    want = recipe != "blockwise" and c["gemm"] == "output"
    if fast != want:
        f.append(f"use_fast_accum={fast} where the recipe uses {want}")
    if c["op"] == "_scaled_mm":
        sa, sb = c["scale_a"], c["scale_b"]
        if sa["dtype"] != torch.float32 or sb["dtype"] != torch.float32:
            f.append("scales not fp32")
        na = 1
        for d in sa["shape"]:
            na *= d
        nb = 1
        for d in sb["shape"]:
            nb *= d
        if na == 1 and nb == 1 and len(sa["shape"]) <= 1 and len(sb["shape"]) <= 1:
            pass
        elif sa["shape"] == (M, 1) and sb["shape"] == (1, N):
            if not (sa["contiguous"] and sb["contiguous"]) or sa["stride"][1] != 1 or sb["stride"][1] != 1:
                f.append("rowwise scales not contiguous")
        else:
            f.append(f"scale shapes {sa['shape']} / {sb['shape']} fit no scaling mode")
    else:
        ra, rb = list(c["recipe_a"]), list(c["recipe_b"])
        sa, sb = c["scale_a"][0], c["scale_b"][0]
        if sa["dtype"] != torch.float32 or sb["dtype"] != torch.float32:
            f.append("scales not fp32")
        kb = K // 128
        if ra == [4] and rb == [5]:
            l4 = -(-kb // 4) * 4
            want_a, want_b = ((M, kb), (1, M)), ((l4, N // 128), (1, l4))
        elif ra == [4] and rb == [4]:
            want_a, want_b = ((M, kb), (1, M)), ((N, kb), (1, N))
        else:
            f.append(f"unexpected block recipes {ra} x {rb}")
            return f
        if (sa["shape"], sa["stride"]) != want_a:
            f.append(f"scale_a {sa['shape']} strides {sa['stride']}, want {want_a}")
        if (sb["shape"], sb["stride"]) != want_b:
            f.append(f"scale_b {sb['shape']} strides {sb['stride']}, want {want_b}")
    return f


def lint(calls, recipe):
    out = []
    for c in calls:
        for msg in lint_call(c, recipe):
            out.append((c["step"], GEMMS.index(c["gemm"]), c["gemm"], msg))
    return sorted(out)


# ----------------------------------------------------------------------------- loading / running
_LOADED = {}


def load(impl):
    path, attr = impl.rsplit(":", 1)
    path = os.path.join(HERE, os.path.basename(path))
    if path not in _LOADED:
        name = "h15_verify_" + os.path.splitext(os.path.basename(path))[0]
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        _LOADED[path] = mod
    return getattr(_LOADED[path], attr)


def _prepare(kind, obj, lin, case):
    if kind == "function":
        if "bias" in inspect.signature(obj).parameters:
            return lambda x: obj(x, lin.weight, bias=lin.bias)
        return lambda x: obj(x, lin.weight) + (lin.bias.to(x.dtype) if lin.bias is not None else 0)
    if kind == "module":
        return obj.from_float(lin)
    if kind == "converter":
        model = obj(nn.Sequential(lin)) if case.wrap else obj(lin)
        return model
    if kind == "torchao":
        from torchao.float8.config import Float8LinearConfig
        from torchao.float8.float8_linear import Float8Linear
        return Float8Linear.from_float(lin, config=Float8LinearConfig.from_recipe_name(case.recipe))
    if kind == "emulated":
        return lambda x: _BlockwiseRef.apply(x, lin.weight) + (
            lin.bias.to(x.dtype) if lin.bias is not None else 0)
    raise ValueError(kind)


def _clone(t):
    return None if t is None else t.detach().clone()


def run(kind, obj, case):
    """-> (list of per-call dicts, recorded calls). A dict holds output/grad_input/grad_weight/
    grad_bias tensors, or 'crash': (gemm, message) for the GEMM that raised."""
    x, lin, go, deltas = build(case)
    fn = _prepare(kind, obj, lin, case)
    rec = Recorder()
    steps = []
    with rec:
        for s in range(case.steps):
            if s:
                with torch.no_grad():
                    lin.weight.add_(deltas[s])
                x.grad = None
                lin.weight.grad = None
                if lin.bias is not None:
                    lin.bias.grad = None
            res = {}
            steps.append(res)
            rec.begin("fwd", s)
            try:
                out = fn(x)
            except Exception as e:  # noqa: BLE001
                res["crash"] = ("output", f"{type(e).__name__}: {e}")
                break
            res["output"] = _clone(out)
            rec.begin("bwd", s)
            try:
                out.backward(go)
            except Exception as e:  # noqa: BLE001
                msg = f"{type(e).__name__}: {e}"
                m = re.search(r"invalid gradient at index (\d+)", msg)
                if m:
                    gemm = "grad_input" if int(m.group(1)) == 0 else "grad_weight"
                elif re.search(r"Mismatch in shape|shape mismatch|Mismatch in dtype", msg) and "output" in res:
                    gemm = "grad_input"
                elif rec.last_failed is not None:
                    gemm = rec.last_failed["gemm"]
                else:
                    gemm = "grad_input" if rec.count[("bwd", s)] == 0 else "grad_weight"
                res["crash"] = (gemm, msg)
                break
            res["grad_input"] = _clone(x.grad)
            res["grad_weight"] = _clone(lin.weight.grad)
            res["grad_bias"] = _clone(lin.bias.grad) if lin.bias is not None else None
    return steps, rec.calls


def _bits_equal(a, b):
    if a.dtype != b.dtype or a.shape != b.shape or a.stride() != b.stride():
        return False
    it = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.view(it), b.view(it))


def _meta_equal(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()


def first_diff(ra, rb, with_bias=True):
    """First GEMM (earliest call, then output < grad_input < grad_weight) whose result differs between two runs -> (gemm, kind, step)
    with kind in {'crash', 'meta', 'value'}; None when identical."""
    found = []
    for s in range(max(len(ra), len(rb))):
        a = ra[s] if s < len(ra) else {"crash": ("output", "missing call")}
        b = rb[s] if s < len(rb) else {"crash": ("output", "missing call")}
        for gi, g in enumerate(GEMMS):
            ca = a.get("crash") and GEMMS.index(a["crash"][0]) <= gi
            cb = b.get("crash") and GEMMS.index(b["crash"][0]) <= gi
            if ca or cb:
                if not (ca and cb):
                    found.append((gi, s, "crash"))
                break
            if not _bits_equal(a[g], b[g]):
                found.append((gi, s, "value" if _meta_equal(a[g], b[g]) else "meta"))
        else:
            if with_bias and (a.get("grad_bias") is None) != (b.get("grad_bias") is None):
                found.append((3, s, "meta"))
            elif with_bias and a.get("grad_bias") is not None and not _bits_equal(a["grad_bias"], b["grad_bias"]):
                found.append((3, s, "value"))
    if not found:
        return None
    s, gi, kind = min((s, gi, kind) for gi, s, kind in found)   # first call first, then GEMM order
    return ("grad_bias" if gi == 3 else GEMMS[gi]), kind, s


# ----------------------------------------------------------------------------- blockwise reference
def _bw_quant(t, gr, gc):
    """Groups of gr x gc over a 2-D fp32 tensor -> (e4m3 values, per-element fp32 inverse scale)."""
    R, C = t.shape
    g = t.reshape(R // gr, gr, C // gc, gc)
    amax = g.abs().amax(dim=(1, 3), keepdim=True).to(torch.float64).clamp(min=1e-12)
    s = (448.0 / amax).to(torch.float32)
    q = (g * s).clamp(-448.0, 448.0).to(E4M3).reshape(R, C)
    return q, s.reciprocal().expand(g.shape).reshape(R, C)


def _bw_gemm(qa, inv_a, qb, inv_b):
    """sum over 128-wide K blocks of (exact fp8 block product) * (scale_a * scale_b), float64 -> bf16."""
    M, K = qa.shape
    a, b = qa.to(torch.float64), qb.to(torch.float64)
    out = torch.zeros(M, qb.shape[1], dtype=torch.float64)
    for k in range(0, K, 128):
        out += (a[:, k:k + 128] @ b[k:k + 128, :]) * (inv_a[:, k:k + 1].to(torch.float64) * inv_b[k:k + 1, :].to(torch.float64))
    return out.to(torch.bfloat16)


class _BlockwiseRef(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        x2 = x.reshape(-1, x.shape[-1]).to(torch.float32)
        qx, sx = _bw_quant(x2, 1, 128)
        qw, sw = _bw_quant(w.to(torch.float32), 128, 128)
        return _bw_gemm(qx, sx, qw.t(), sw.t()).to(x.dtype).reshape(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx, go):
        x, w = ctx.saved_tensors
        g2 = go.reshape(-1, go.shape[-1]).to(torch.float32)
        x2 = x.reshape(-1, x.shape[-1]).to(torch.float32)
        qg, sg = _bw_quant(g2, 1, 128)
        qw, sw = _bw_quant(w.to(torch.float32), 128, 128)
        gi = _bw_gemm(qg, sg, qw, sw).to(go.dtype).reshape(*go.shape[:-1], x.shape[-1])
        qgt, sgt = _bw_quant(g2.t().contiguous(), 1, 128)
        qx, sx = _bw_quant(x2, 128, 1)
        gw = _bw_gemm(qgt, sgt, qx, sx).to(go.dtype)
        return gi, gw


# ----------------------------------------------------------------------------- checks
FAILS = []
NCHECK = [0]


def check(cond, msg):
    NCHECK[0] += 1
    if not cond:
        FAILS.append(msg)
        print("FAIL:", msg, flush=True)
    return cond


_RUNS = {}


def cached_run(kind, impl, case):
    key = (kind, impl, case)
    if key not in _RUNS:
        obj = None if kind in ("torchao", "emulated") else load(impl)
        form = kind
        _RUNS[key] = run(form, obj, case)
    return _RUNS[key]


def reference(case):
    if case.recipe == "blockwise":
        return cached_run("emulated", None, case)
    if case.recipe != "tensorwise" and len(case.lead) > 1 and case.in_layout == "T":
        return None   # torchao 0.18 rowwise recipes raise on a transposed N-D input
    return cached_run("torchao", None, case)


def correct_cases(recipe, form):
    d = default_case(recipe)
    R = dataclasses.replace
    nd = apply_tokens(d, ["N-D input"])
    cases = [
        d, R(d, in_layout="T"), R(d, in_layout="S"), R(d, w_layout="T"), R(d, w_layout="S"),
        R(d, go_layout="T"), R(d, go_layout="S"), nd, R(nd, in_layout="T"), R(nd, in_layout="S"),
        R(nd, go_layout="T"), R(nd, go_layout="S", bias=True), R(d, in_dtype="fp32"),
        R(d, in_dtype="fp16"), R(d, w_dtype="fp32"), R(d, in_dtype="fp32", w_dtype="fp32", bias=True),
        R(d, bias=True), R(d, w_dtype="fp32", bias=True), R(d, in_dtype="fp16", bias=True, go_layout="T"),
        R(d, K=d.N), R(d, K=d.N, in_layout="T", w_layout="T"), R(d, steps=2), R(d, steps=2, bias=True, seed=3),
        R(d, seed=7), R(d, wrap=False, bias=True),
    ]
    cases += [R(d, dist=x) for x in DISTS if x != "normal"]
    cases += [R(nd, dist="zero_rows"), R(d, dist="negative", go_layout="S", seed=2)]
    if recipe == "blockwise":
        cases += [Case(recipe, (128,), 128, 256), Case(recipe, (128,), 256, 128, bias=True),
                  Case(recipe, (2, 64), 128, 256, in_layout="T"), Case(recipe, (384,), 512, 128, seed=5)]
    else:
        cases += [Case(recipe, (16,), 16, 32), Case(recipe, (48,), 64, 16, w_layout="T"),
                  Case(recipe, (2, 8), 32, 48, in_dtype="fp16", w_dtype="fp32")]
    if form != "converter":
        cases = [c for c in cases if c.wrap]
    return list(dict.fromkeys(cases))


def strip_docstring(text):
    tree = ast.parse(text)
    body = tree.body
    lines = text.splitlines()
    if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) \
            and isinstance(body[0].value.value, str):
        return body[0].value.value, lines[body[0].end_lineno:]
    return None, lines


def changed_lines(a, b):
    n = 0
    for op, i1, i2, j1, j2 in difflib.SequenceMatcher(a=a, b=b, autojunk=False).get_opcodes():
        if op != "equal":
            n += max(i2 - i1, j2 - j1)
    return n


def main():
    t0 = time.time()
    torch.manual_seed(0)
    with open(os.path.join(HERE, "manifest.json")) as f:
        manifest = json.load(f)
    with open(os.path.join(HERE, "twins.json")) as f:
        twins = json.load(f)
    by_name = {e["name"]: e for e in manifest}

    # 1. manifest / twins well formed
    check(len(by_name) == len(manifest), "duplicate names in manifest")
    for e in manifest:
        check(list(e.keys()) == KEYS, f"{e.get('name')}: keys {list(e.keys())}")
        check(e["impl"].startswith("property_tests/heldout15/" + e["name"] + ".py:"), f"{e['name']}: impl {e['impl']}")
        check(e["form"] in FORMS and e["recipe"] in RECIPES, f"{e['name']}: form/recipe")
        try:
            load(e["impl"])
        except Exception as exc:  # noqa: BLE001
            check(False, f"{e['name']}: cannot load {e['impl']}: {exc}")
        if e["category"] == "none":
            check(e["gemm"] is None and e["operand"] is None and e["trigger"] == [], f"{e['name']}: correct labels")
        else:
            check(e["category"] in CATEGORIES, f"{e['name']}: category {e['category']}")
            check(e["gemm"] in GEMMS and e["operand"] in OPERANDS, f"{e['name']}: gemm/operand")
            check(all(t in TOKENS or (t.startswith("data:") and t[5:] in DISTS) for t in e["trigger"]),
                  f"{e['name']}: trigger {e['trigger']}")
            check(len(e["trigger"]) <= 2 + ("gpu only" in e["trigger"]), f"{e['name']}: too many tokens")
            gpu = "gpu only" in e["trigger"]
            check(e["devices"] == (["cuda"] if gpu else ["cpu", "cuda"]), f"{e['name']}: devices")
            tw = twins.get(e["name"])
            check(tw in by_name and by_name[tw]["category"] == "none", f"{e['name']}: twin {tw}")
            if tw in by_name:
                check(by_name[tw]["recipe"] == e["recipe"] and by_name[tw]["form"] == e["form"]
                      and by_name[tw]["impl"].split(":")[1] == e["impl"].split(":")[1], f"{e['name']}: twin mismatch")
    check(set(twins) == {e["name"] for e in manifest if e["category"] != "none"}, "twins.json keys")

    # 2. correct files against torchao / the blockwise emulation
    n_correct_cases = 0
    for e in manifest:
        if e["category"] != "none":
            continue
        for case in correct_cases(e["recipe"], e["form"]):
            ref = reference(case)
            if ref is None:
                continue
            mine, calls = cached_run(e["form"], e["impl"], case)
            n_correct_cases += 1
            d = first_diff(mine, ref[0])
            check(d is None, f"{e['name']} != reference on {case.id()}: {d} "
                  f"{[r.get('crash') for r in mine if 'crash' in r]} {[r.get('crash') for r in ref[0] if 'crash' in r]}")
            check(all("crash" not in r for r in mine), f"{e['name']} crashed on {case.id()}")
            lf = lint(calls, e["recipe"])
            check(not lf, f"{e['name']} contract findings on {case.id()}: {lf[:2]}")
            n_gemm = 3 if e["recipe"] != "rowwise_with_gw_hp" else 2
            check(len(calls) == n_gemm * case.steps, f"{e['name']}: {len(calls)} recorded GEMMs on {case.id()}")
    print(f"correct files checked on {n_correct_cases} (file, case) pairs, {time.time() - t0:.1f} s", flush=True)

    # 3. + 4. bugs
    n_bugs = 0
    for e in manifest:
        if e["category"] == "none":
            continue
        n_bugs += 1
        name, tw = e["name"], twins[e["name"]]
        twin = by_name[tw]
        with open(os.path.join(HERE, name + ".py")) as f:
            doc_b, body_b = strip_docstring(f.read())
        with open(os.path.join(HERE, tw + ".py")) as f:
            _, body_t = strip_docstring(f.read())
        check(doc_b is not None and doc_b.startswith("[planted bug: "), f"{name}: docstring header")
        n = changed_lines(body_t, body_b)
        check(1 <= n <= 2, f"{name}: differs from {tw} in {n} lines")

        tokens = [t for t in e["trigger"] if t != "gpu only"]
        gpu = "gpu only" in e["trigger"]
        D = default_case(e["recipe"])
        T = apply_tokens(D, tokens)
        rb, cb = cached_run(e["form"], e["impl"], T)
        rt, ct = cached_run(twin["form"], twin["impl"], T)
        ref = reference(T)
        if ref is not None:
            check(first_diff(rt, ref[0]) is None, f"{name}: twin {tw} != reference on trigger case {T.id()}")
        if gpu:
            check(first_diff(rb, rt) is None, f"{name}: gpu-only bug differs on CPU: {first_diff(rb, rt)}")
            fb, ft = lint(cb, e["recipe"]), lint(ct, e["recipe"])
            check(not ft, f"{name}: twin {tw} has findings {ft[:1]}")
            check(bool(fb) and fb[0][2] == e["gemm"], f"{name}: first finding {fb[:1]} != {e['gemm']}")
            if tokens:
                rbd, cbd = cached_run(e["form"], e["impl"], D)
                check(not lint(cbd, e["recipe"]), f"{name}: findings without trigger {lint(cbd, e['recipe'])[:1]}")
        else:
            d = first_diff(rb, rt, with_bias=False)
            check(d is not None and d[0] == e["gemm"], f"{name}: first differing GEMM {d} != {e['gemm']} on {T.id()}")
            if d is not None:
                want = {"crash": ("crash",), "contract": ("meta", "value")}.get(e["category"], ("value",))
                check(d[1] in want, f"{name}: difference kind {d[1]} != {want} for category {e['category']}")
        if tokens:
            rbd, _ = cached_run(e["form"], e["impl"], D)
            rtd, _ = cached_run(twin["form"], twin["impl"], D)
            check(first_diff(rbd, rtd) is None, f"{name}: differs without its trigger: {first_diff(rbd, rtd)}")
            if len(tokens) == 2:
                for t in tokens:
                    C1 = apply_tokens(D, [t])
                    r1, c1 = cached_run(e["form"], e["impl"], C1)
                    r2, _ = cached_run(twin["form"], twin["impl"], C1)
                    check(first_diff(r1, r2) is None, f"{name}: differs with only {t!r}: {first_diff(r1, r2)}")
                    if gpu:
                        check(not lint(c1, e["recipe"]), f"{name}: findings with only {t!r}")

    # counts
    cats = {}
    for e in manifest:
        if e["category"] != "none":
            cats.setdefault(e["category"], {}).setdefault(e["recipe"], 0)
            cats[e["category"]][e["recipe"]] += 1
    print("category x recipe:")
    for c in CATEGORIES:
        row = cats.get(c, {})
        print(f"  {c:13s} " + " ".join(f"{r}={row.get(r, 0)}" for r in RECIPES) + f"  total={sum(row.values())}")
    status = "PASS" if not FAILS else f"FAIL ({len(FAILS)} failures)"
    print(f"verify.py: {status} - {sum(1 for e in manifest if e['category'] == 'none')} correct files on "
          f"{n_correct_cases} (file, case) pairs, {n_bugs} bugs, {NCHECK[0]} checks, {time.time() - t0:.1f} s")
    return 0 if not FAILS else 1


if __name__ == "__main__":
    sys.exit(main())
