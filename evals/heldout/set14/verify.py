"""Self-check of the frozen held-out set heldout14 (CPU only, no GPU, no parity imports).

    python property_tests/heldout14/verify.py            # every file in manifest.json
    python property_tests/heldout14/verify.py h14_c03 h14_b13 ...   # a subset
    python property_tests/heldout14/verify.py --seeds 3 # bugs also re-checked on seeds 1, 2

What is checked
* correct files, tensorwise / rowwise / rowwise_with_gw_hp: bitwise equal (values, dtype,
  shape, strides) to torchao 0.18 ``Float8Linear`` built with
  ``Float8LinearConfig.from_recipe_name(recipe)`` for output, grad_input, grad_weight and
  grad_bias, on every case of ``CORRECT_CASES`` (dtypes, layouts, N-D, bias, second call,
  every data distribution).  torchao's rowwise recipes raise on an N-D input stored
  transposed; those cases only check that the file runs and keeps the GEMM contract.
* correct files, blockwise: (a) every recorded block-scaled GEMM gets exactly the fp8
  operands and inverse scales of an independent re-implementation of torchao's prototype
  quantizers (1x128 along K/N/M, 128x128 weight blocks, 128x1 input groups); (b) output,
  grad_input, grad_weight are within ``|got - ref| <= 2^-8 |ref| + 2^-14 (|A| @ |B|)`` of a
  float64 GEMM of those dequantized operands (one bf16 rounding plus float32
  accumulation over K <= 512), grad_bias within 2^-7 of the float64 sum; (c) dtypes and
  shapes are nn.Linear's.
* GEMM contract (every file, every run): all ``aten._scaled_mm`` / ``aten._scaled_mm_v2``
  calls are recorded with a TorchDispatchMode and checked against the SM90 rules (hard:
  2-D fp8 operands, no e5m2 x e5m2, A row-major, B column-major, dims % 16, out_dtype
  passed, fp32 scales of a valid tensorwise / rowwise shape, contiguous rowwise scales,
  bf16 rowwise output, bias dtype / no bias with fp32 output, blockwise scale shapes AND
  exact strides (1, rows) even when a dim is 1, K-block rows of 128x128 scales padded to a
  multiple of 4) and the recipe (soft: fast accumulation on the output GEMM only, the
  expected GEMMs per step).  Correct files: no hard and no soft finding.
* bugs: with the labelled triggers applied, the first of output / grad_input /
  grad_weight that differs bitwise from the twin is the labelled ``gemm``; no hard
  contract finding unless the category is crash (so it stays numerical on an H200);
  crash bugs raise in the labelled phase; "gpu only" bugs are bitwise identical to the
  twin on CPU and the recorded calls show a hard (crash) or soft (accumulation) finding
  whose first GEMM is the labelled one, absent from the twin.  Triggers are necessary:
  without them the bug is bitwise identical to the twin with a clean contract, and with
  two triggers neither alone is enough.  Each bug file is its twin plus the
  ``[planted bug: ...]`` docstring header and a change of at most two lines.
"""
import argparse
import difflib
import importlib.util
import inspect
import json
import math
import os
import sys
import time
import warnings
from dataclasses import dataclass, replace

os.environ.setdefault("OMP_NUM_THREADS", "2")
warnings.filterwarnings("ignore")

import logging  # noqa: E402

logging.getLogger("torchao").setLevel(logging.ERROR)  # its optional C++ extensions do not load on CPU
logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

BF16, FP16, FP32, FP64 = torch.bfloat16, torch.float16, torch.float32, torch.float64
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8 = (E4M3, E5M2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)
DT = {"bf16": BF16, "fp16": FP16, "fp32": FP32}
GEMMS = ("output", "grad_input", "grad_weight")
DATA = ("uniform", "heavy", "outlier", "zeros", "nearmax", "tiny", "negative", "zero_rows",
        "outlier_row", "tiny_amax", "small_amax", "large")
BW_1x128, BW_128x128 = 4, 5  # ScalingType values as passed to aten._scaled_mm_v2


# ----------------------------------------------------------------------------- cases
@dataclass(frozen=True)
class Case:
    lead: tuple = ()          # leading dims of the input; () = recipe default
    K: int = 0
    N: int = 0
    x: str = "bf16"           # input dtype
    w: str = "bf16"           # weight (and bias) dtype
    xl: str = "C"             # layouts: C contiguous, T transposed storage, S non-dense slice,
    wl: str = "C"             #          P padded rows (NaN in the gaps)
    gl: str = "C"
    bias: bool = False
    data: str = "normal"      # input distribution
    steps: int = 1            # calls; an in-place weight update between them
    seed: int = 0

    def dims(self, recipe):
        lead, k, n = ((384,), 256, 512) if recipe == "blockwise" else ((32,), 64, 48)
        return (self.lead or lead), (self.K or k), (self.N or n)

    def label(self, recipe):
        lead, k, n = self.dims(recipe)
        s = f"M{'x'.join(map(str, lead))}K{k}N{n}|in:{self.x}:{self.xl}|w:{self.w}:{self.wl}|go:{self.gl}"
        if self.bias:
            s += "|bias"
        if self.data != "normal":
            s += f"|{self.data}"
        if self.seed:
            s += f"|seed{self.seed}"
        if self.steps > 1:
            s += f"|steps{self.steps}"
        return s


def apply_trigger(case, tok, recipe):
    lead, k, n = case.dims(recipe)
    if tok == "non-contiguous input":
        return replace(case, xl="T")
    if tok == "non-contiguous weight":
        return replace(case, wl="T")
    if tok == "non-contiguous grad_output":
        return replace(case, gl="T")
    if tok == "K == N":
        return replace(case, K=n, N=n)
    if tok == "N-D input":
        m = math.prod(lead)
        return replace(case, lead=(2, m // 2))
    if tok == "fp32 input":
        return replace(case, x="fp32")
    if tok == "fp16 input":
        return replace(case, x="fp16")
    if tok == "fp32 weight":
        return replace(case, w="fp32")
    if tok == "second call":
        return replace(case, steps=2)
    if tok == "bias":
        return replace(case, bias=True)
    if tok == "gpu only":
        return case
    if tok.startswith("data:") and tok[5:] in DATA:
        return replace(case, data=tok[5:])
    raise ValueError(f"unknown trigger token {tok!r}")


CORRECT_CASES = [
    Case(), Case(bias=True), Case(seed=1), Case(seed=2),
    Case(x="fp32"), Case(x="fp32", w="fp32"), Case(x="fp16"), Case(x="fp16", w="fp16"), Case(w="fp32"),
    Case(xl="T"), Case(xl="S"), Case(xl="P"), Case(wl="T"), Case(wl="S"), Case(wl="P"),
    Case(gl="T"), Case(gl="S"), Case(gl="P", bias=True),
    Case(lead=("nd",)), Case(lead=("nd",), xl="T"), Case(lead=("nd",), gl="T", bias=True),
    Case(K=-1), Case(steps=2), Case(steps=2, bias=True, x="fp32", xl="T"),
] + [Case(data=d) for d in DATA]
BLOCKWISE_EXTRA = [Case(lead=(128,), K=128, N=256), Case(lead=(128,), K=384, N=128, bias=True)]


def concrete(case, recipe):
    """Resolve the symbolic dims used in CORRECT_CASES ('nd' lead, K=-1 for K == N)."""
    if case.lead == ("nd",):
        case = apply_trigger(replace(case, lead=()), "N-D input", recipe)
    if case.K == -1:
        case = apply_trigger(replace(case, K=0), "K == N", recipe)
    return case


# ----------------------------------------------------------------------------- data
def _values(kind, shape, g):
    x = torch.randn(shape, generator=g)
    u = torch.rand(shape, generator=g)
    if kind == "normal":
        return x
    if kind == "uniform":
        return u * 2 - 1
    if kind == "heavy":  # Student-t, 3 degrees of freedom
        chi2 = sum(torch.randn(shape, generator=g) ** 2 for _ in range(3))
        return x / torch.sqrt(chi2 / 3)
    if kind == "outlier":
        x[..., 3] *= 100.0
        return x
    if kind == "zeros":
        return torch.zeros(shape)
    if kind == "nearmax":
        return torch.where(x < 0, -1.0, 1.0) * (400.0 + 48.0 * u)
    if kind == "tiny":
        return torch.where(x < 0, -1.0, 1.0) * torch.exp2(-24.0 * u)
    if kind == "negative":
        return -x.abs() * torch.where(u < 0.9, 1.0, -0.5)
    if kind == "zero_rows":
        x2 = x.reshape(-1, shape[-1])
        x2[::4] = 0
        x2[:, ::4] = 0
        return x2.reshape(shape)
    if kind == "outlier_row":
        x2 = x.reshape(-1, shape[-1])
        x2[1] *= 1e4
        return x2.reshape(shape)
    if kind == "tiny_amax":
        return x * 1e-30
    if kind == "small_amax":
        return x * 2.0 ** -16
    if kind == "large":
        return x * 1000.0
    raise ValueError(kind)


def lay(v, kind):
    """Same values as ``v``, stored as: C contiguous, T transposed, S non-dense, P padded."""
    if kind == "C":
        return v.contiguous()
    if kind == "T":
        return v.transpose(-1, -2).contiguous().transpose(-1, -2)
    c = v.shape[-1]
    if kind == "S":
        buf = torch.full((*v.shape[:-1], 2 * c), float("nan"), dtype=v.dtype)
        buf[..., ::2] = v
        return buf[..., ::2]
    if kind == "P":
        buf = torch.full((*v.shape[:-1], c + 16), float("nan"), dtype=v.dtype)
        buf[..., :c] = v
        return buf[..., :c]
    raise ValueError(kind)


# ----------------------------------------------------------------------------- recorder
def _bind(func, args, kwargs):
    out = {}
    for i, a in enumerate(func._schema.arguments):
        if i < len(args):
            out[a.name] = args[i]
        elif a.name in kwargs:
            out[a.name] = kwargs[a.name]
        else:
            out[a.name] = a.default_value if a.has_default_value() else None
    return out


class Recorder(TorchDispatchMode):
    """Records every aten._scaled_mm / aten._scaled_mm_v2 call, then runs it unchanged."""

    def __init__(self):
        super().__init__()
        self.calls = []
        self.step = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._scaled_mm.default:
            c = _bind(func, args, kwargs)
            c["op"], c["step"] = "v1", self.step
            self.calls.append(c)
        elif func is torch.ops.aten._scaled_mm_v2.default:
            c = _bind(func, args, kwargs)
            c["op"], c["step"] = "v2", self.step
            self.calls.append(c)
        return func(*args, **kwargs)


def _row_major(t):
    return t.stride(0) > t.stride(1) and t.stride(1) == 1


def _col_major(t):
    return t.stride(0) == 1 and t.stride(1) > 1


def _hard_v1(c):
    v = []
    a, b = c["self"], c["mat2"]
    if a.dim() != 2 or b.dim() != 2:
        return ["operands not 2-D"]
    if a.dtype not in FP8 or b.dtype not in FP8:
        v.append(f"operand dtypes {a.dtype} {b.dtype}")
    if a.dtype == E5M2 and b.dtype == E5M2:
        v.append("e5m2 x e5m2")
    if not _row_major(a):
        v.append(f"A not row-major, strides {a.stride()}")
    if not _col_major(b):
        v.append(f"B not column-major, strides {b.stride()}")
    if a.size(1) % 16 or b.size(0) % 16 or b.size(1) % 16:
        v.append(f"dims not multiples of 16: {tuple(a.shape)} {tuple(b.shape)}")
    od = c["out_dtype"]
    if od is None:
        v.append("out_dtype not passed")
    sa, sb = c["scale_a"], c["scale_b"]
    m, n = a.size(0), b.size(1)
    if sa.dtype != FP32 or sb.dtype != FP32:
        v.append(f"scales not fp32: {sa.dtype} {sb.dtype}")
    if sa.numel() == 1 and sb.numel() == 1:
        pass
    elif tuple(sa.shape) == (m, 1) and tuple(sb.shape) == (1, n):
        if not (sa.is_contiguous() and sb.is_contiguous()):
            v.append("rowwise scales not contiguous")
        if od != BF16:
            v.append(f"rowwise scaling with {od} output (bf16 only)")
        if a.dtype != E4M3 or b.dtype != E4M3:
            v.append("rowwise scaling with a non-e4m3 operand")
    else:
        v.append(f"invalid scale shapes {tuple(sa.shape)} {tuple(sb.shape)}")
    bias = c["bias"]
    if bias is not None:
        if od == FP32:
            v.append("bias with float32 output")
        elif bias.dtype != od:
            v.append(f"bias dtype {bias.dtype} with {od} output")
        if bias.dim() != 1 or bias.numel() != n:
            v.append("bias shape")
    return v


def _exact_scale(s, shape, what):
    if s.dtype != FP32:
        return [f"{what} scale dtype {s.dtype}"]
    if tuple(s.shape) != tuple(shape):
        return [f"{what} scale shape {tuple(s.shape)}, expected {tuple(shape)}"]
    if s.stride() != (1, shape[0]):
        return [f"{what} scale strides {s.stride()}, expected {(1, shape[0])}"]
    return []


def _hard_v2(c):
    v = []
    a, b = c["self"], c["mat2"]
    if a.dim() != 2 or b.dim() != 2:
        return ["operands not 2-D"]
    if a.dtype != E4M3 or b.dtype != E4M3:
        v.append(f"block-scaled operands must be e4m3: {a.dtype} {b.dtype}")
    if not _row_major(a):
        v.append(f"A not row-major, strides {a.stride()}")
    if not _col_major(b):
        v.append(f"B not column-major, strides {b.stride()}")
    m, k = a.shape
    n = b.shape[1]
    if k % 128 or m % 16 or n % 16:
        v.append(f"dims {m}x{k}x{n}")
    if c["out_dtype"] is None:
        v.append("out_dtype not passed")
    if c["bias"] is not None:
        v.append("bias with block scaling")
    if list(c["swizzle_a"] or []) or list(c["swizzle_b"] or []) or list(c["contraction_dim"] or []):
        v.append("swizzle / contraction_dim given")
    sa, sb = c["scale_a"], c["scale_b"]
    if len(sa) != 1 or len(sb) != 1:
        return v + ["one scale tensor per operand expected"]
    sa, sb = sa[0], sb[0]
    ra, rb = tuple(c["recipe_a"]), tuple(c["recipe_b"])
    l4 = -(-(k // 128) // 4) * 4
    if ra == (BW_1x128,) and rb == (BW_128x128,):
        v += _exact_scale(sa, (m, k // 128), "1x128 A") + _exact_scale(sb, (l4, n // 128), "128x128 B")
    elif ra == (BW_1x128,) and rb == (BW_1x128,):
        v += _exact_scale(sa, (m, k // 128), "1x128 A") + _exact_scale(sb, (n, k // 128), "1x128 B")
    elif ra == (BW_128x128,) and rb == (BW_1x128,):
        v += _exact_scale(sa, (l4, m // 128), "128x128 A") + _exact_scale(sb, (n, k // 128), "1x128 B")
    else:
        v.append(f"unsupported recipes {ra} {rb}")
    return v


def _on_meta(t):
    if t is None:
        return None
    return torch.empty_strided(tuple(t.shape), t.stride(), dtype=t.dtype, device="meta")


def _meta_registration(c):
    """The call replayed on meta tensors through torch's own meta checks; a meta tensor's
    device hint is "cuda", so the CUDA-only layout rules apply literally."""
    import torch._meta_registrations as mr
    try:
        if c["op"] == "v1":
            mr._check_scaled_mm_sizes(
                _on_meta(c["self"]), _on_meta(c["mat2"]), _on_meta(c["scale_a"]), _on_meta(c["scale_b"]),
                _on_meta(c["bias"]), _on_meta(c["scale_result"]), c["out_dtype"], bool(c["use_fast_accum"]))
        else:
            mr._check_scaled_mm_sizes_v2(
                _on_meta(c["self"]), _on_meta(c["mat2"]), [_on_meta(t) for t in c["scale_a"]],
                list(c["recipe_a"]), [_on_meta(t) for t in c["scale_b"]], list(c["recipe_b"]),
                bias=_on_meta(c["bias"]), out_dtype=c["out_dtype"], swizzle_a=list(c["swizzle_a"] or []),
                swizzle_b=list(c["swizzle_b"] or []), use_fast_accum=bool(c["use_fast_accum"]))
    except Exception as e:  # noqa: BLE001
        return [f"meta registration (cuda rules): {str(e).splitlines()[0][:160]}"]
    return []


def contract_findings(calls, recipe, dims):
    """[(step, gemm, 'hard'|'soft', message)] for the recorded calls of one run."""
    lead, k, n = dims
    m = math.prod(lead)
    shapes = {"output": (m, k, n), "grad_input": (m, n, k), "grad_weight": (n, m, k)}
    expected = ["output", "grad_input"] + ([] if recipe == "rowwise_with_gw_hp" else ["grad_weight"])
    fast = {"output": recipe != "blockwise", "grad_input": False, "grad_weight": False}
    out = []
    seen = {}
    for c in calls:
        a, b = c["self"], c["mat2"]
        mkn = (a.shape[0], a.shape[1], b.shape[1]) if a.dim() == 2 and b.dim() == 2 else None
        step_seen = seen.setdefault(c["step"], [])
        cands = [g for g in GEMMS if shapes[g] == mkn]
        fresh = [g for g in cands if g not in step_seen]
        gemm = (fresh or cands or ["unknown"])[0]
        step_seen.append(gemm)
        for msg in (_hard_v1(c) if c["op"] == "v1" else _hard_v2(c)) + _meta_registration(c):
            out.append((c["step"], gemm, "hard", msg))
        if gemm == "unknown":
            out.append((c["step"], gemm, "soft", f"unrecognised GEMM {mkn}"))
        elif bool(c["use_fast_accum"]) != fast[gemm]:
            out.append((c["step"], gemm, "soft", f"use_fast_accum={bool(c['use_fast_accum'])}"))
    for step, got in seen.items():
        if got != expected:
            out.append((step, "unknown", "soft", f"GEMMs per step {got}, expected {expected}"))
    return out


# ----------------------------------------------------------------------------- running
_MODS = {}


def load_impl(spec):
    path, attr = spec.rsplit(":", 1)
    path = os.path.join(ROOT, path)
    if path not in _MODS:
        name = "_h14v_" + os.path.splitext(os.path.basename(path))[0]
        s = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(s)
        s.loader.exec_module(mod)
        _MODS[path] = mod
    return getattr(_MODS[path], attr)


class _FunctionModule(nn.Module):
    def __init__(self, fn, weight, bias):
        super().__init__()
        self.fn, self.weight, self.bias = fn, weight, bias
        self.takes_bias = "bias" in inspect.signature(fn).parameters

    def forward(self, x):
        if self.takes_bias:
            return self.fn(x, self.weight, bias=self.bias)
        out = self.fn(x, self.weight)
        return out if self.bias is None else out + self.bias.to(out.dtype)


class Run:
    def __init__(self):
        self.steps = []        # per step: dict(out, gx, gw, gb, x, w, go)
        self.error = None      # (phase, exception)
        self.calls = []


def run(impl, form, recipe, case):
    """Build fresh tensors from the case seed, convert / wrap, call ``case.steps`` times."""
    lead, k, n = case.dims(recipe)
    g = torch.Generator().manual_seed(1234 + 7 * case.seed)
    w_val = (torch.randn(n, k, generator=g) * 0.1).to(DT[case.w])
    b_val = (torch.randn(n, generator=g) * 0.1).to(DT[case.w])
    x_val = _values(case.data, (*lead, k), g).to(DT[case.x])
    go_vals = [torch.randn(*lead, n, generator=g) for _ in range(case.steps)]
    deltas = [torch.randn(n, k, generator=g) * 0.05 for _ in range(case.steps)]

    with torch.device("meta"):
        lin = nn.Linear(k, n, bias=False)
    lin.weight = nn.Parameter(lay(w_val, case.wl))
    if case.bias:
        lin.bias = nn.Parameter(b_val.clone())
    weight, bias = lin.weight, lin.bias
    r = Run()
    r.bias_val = b_val if case.bias else None
    try:
        if form == "torchao":
            from torchao.float8.config import Float8LinearConfig
            from torchao.float8.float8_linear import Float8Linear
            mod = Float8Linear.from_float(lin, config=Float8LinearConfig.from_recipe_name(recipe))
        elif form == "function":
            mod = _FunctionModule(impl, weight, bias)
        elif form == "module":
            mod = impl.from_float(lin)
        else:
            mod = impl(lin)
    except Exception as e:  # noqa: BLE001
        r.error = ("convert", e)
        return r
    rec = Recorder()
    with rec:
        for step in range(case.steps):
            rec.step = step
            if step:
                with torch.no_grad():
                    weight.add_(deltas[step].to(weight.dtype))
            weight.grad = None
            if bias is not None:
                bias.grad = None
            x = lay(x_val, case.xl).detach().requires_grad_(True)
            try:
                out = mod(x)
            except Exception as e:  # noqa: BLE001
                r.error = ("output", e)
                break
            go = go_vals[step]
            go = lay((go.reshape(out.shape) if go.numel() == out.numel() else go).to(out.dtype), case.gl)
            try:
                out.backward(go)
            except Exception as e:  # noqa: BLE001
                r.error = ("backward", e)
                break
            r.steps.append(dict(out=out.detach(), gx=x.grad, gw=weight.grad,
                                gb=None if bias is None else bias.grad,
                                x=x.detach(), w=weight.detach().clone(), go=go))
    r.calls = rec.calls
    return r


_INT = {BF16: torch.int16, FP16: torch.int16, FP32: torch.int32, FP64: torch.int64}


def same(a, b):
    if a is None or b is None:
        return a is None and b is None, "one is None"
    if a.dtype != b.dtype:
        return False, f"dtype {a.dtype} vs {b.dtype}"
    if a.shape != b.shape:
        return False, f"shape {tuple(a.shape)} vs {tuple(b.shape)}"
    if a.stride() != b.stride():
        return False, f"strides {a.stride()} vs {b.stride()}"
    ia, ib = a.contiguous().view(_INT[a.dtype]), b.contiguous().view(_INT[b.dtype])
    if not torch.equal(ia, ib):
        return False, f"{int((ia != ib).sum())} of {a.numel()} elements differ"
    return True, ""


KEYS = (("out", "output"), ("gx", "grad_input"), ("gw", "grad_weight"), ("gb", "grad_bias"))


def first_diff(ra, rb):
    """(step, gemm, why) of the first bitwise difference, or None."""
    for step, (sa, sb) in enumerate(zip(ra.steps, rb.steps)):
        for key, gemm in KEYS:
            ok, why = same(sa[key], sb[key])
            if not ok:
                return step, gemm, why
    if len(ra.steps) != len(rb.steps):
        return min(len(ra.steps), len(rb.steps)), "steps", "different number of completed steps"
    return None


# ----------------------------------------------------------------------------- blockwise oracle
def _bw_quant(t, br, bc):
    """Independent e4m3 quantization with (br x bc) groups: (fp8 data, per-element 1/scale)."""
    r, c = t.shape
    v = t.to(FP32).reshape(r // br, br, c // bc, bc)
    amax = v.abs().amax(dim=(1, 3)).to(FP64)
    scale = (448.0 / torch.clamp(amax, min=1e-12)).to(FP32)
    full = scale.repeat_interleave(br, 0).repeat_interleave(bc, 1)
    q = (t.to(FP32) * full).clamp(-448.0, 448.0).to(E4M3)
    inv = (1.0 / scale).repeat_interleave(br, 0).repeat_interleave(bc, 1)
    return q, inv


def _expand_recorded(s, recipe, shape, lhs):
    rows, cols = shape
    if recipe == BW_1x128:
        return s.repeat_interleave(128, 1) if lhs else s.t().repeat_interleave(128, 0)
    grid = s[: cols // 128].t() if lhs else s[: rows // 128]
    return grid.repeat_interleave(128, 0).repeat_interleave(128, 1)


def _eq_nan(a, b):
    a, b = a.to(FP64), b.to(FP64)
    return bool(torch.equal(torch.isnan(a), torch.isnan(b)) and torch.equal(a.nan_to_num(), b.nan_to_num()))


def blockwise_oracle(r, case, recipe):
    """Problems of a blockwise run against the independent float64 emulation."""
    probs = []
    lead, k, n = case.dims(recipe)
    by_step = {}
    for c in r.calls:
        by_step.setdefault(c["step"], []).append(c)
    for step, st in enumerate(r.steps):
        x2 = st["x"].reshape(-1, k)
        go2 = st["go"].reshape(-1, n)
        w = st["w"]
        qx, ix = _bw_quant(x2, 1, 128)
        qw, iw = _bw_quant(w, 128, 128)
        qg, ig = _bw_quant(go2, 1, 128)
        qgt, igt = _bw_quant(go2.t().contiguous(), 1, 128)
        qxc, ixc = _bw_quant(x2, 128, 1)
        exp = {"output": (qx, ix, qw.t(), iw.t()), "grad_input": (qg, ig, qw, iw),
               "grad_weight": (qgt, igt, qxc, ixc)}
        calls = by_step.get(step, [])
        if len(calls) != 3:
            probs.append(f"step {step}: {len(calls)} block-scaled GEMM calls, expected 3")
            continue
        for gemm, c in zip(GEMMS, calls):
            qa, ia, qb, ib = exp[gemm]
            if not (_eq_nan(c["self"], qa) and _eq_nan(c["mat2"], qb)):
                probs.append(f"step {step} {gemm}: fp8 operands differ from the reference quantization")
            sa = _expand_recorded(c["scale_a"][0], c["recipe_a"][0], tuple(c["self"].shape), True)
            sb = _expand_recorded(c["scale_b"][0], c["recipe_b"][0], tuple(c["mat2"].shape), False)
            if not (_eq_nan(sa, ia) and _eq_nan(sb, ib)):
                probs.append(f"step {step} {gemm}: inverse scales differ from the reference")
        # float64 GEMMs of the reference operands, bound check of the results
        for key, gemm, like, shape in (("out", "output", st["x"], (*lead, n)),
                                       ("gx", "grad_input", st["x"], (*lead, k)),
                                       ("gw", "grad_weight", st["w"], (n, k))):
            qa, ia, qb, ib = exp[gemm]
            a64, b64 = qa.to(FP64) * ia.to(FP64), qb.to(FP64) * ib.to(FP64)
            ref, mag = (a64 @ b64).reshape(shape), (a64.abs() @ b64.abs()).reshape(shape)
            tol = 2.0 ** -8 * ref.abs() + 2.0 ** -14 * mag + 1e-38
            if gemm == "output" and r.bias_val is not None:
                ref = ref + r.bias_val.to(FP64)        # added after the GEMM, one more rounding
                tol = tol + 2.0 ** -8 * ref.abs()
            got = st[key]
            if got.dtype != like.dtype or tuple(got.shape) != tuple(ref.shape):
                probs.append(f"step {step} {gemm}: dtype/shape {got.dtype} {tuple(got.shape)}, "
                             f"expected {like.dtype} {tuple(ref.shape)}")
                continue
            diff = (got.to(FP64) - ref).abs()
            bad = ~(diff <= tol)
            if bool(bad.any()):
                probs.append(f"step {step} {gemm}: {int(bad.sum())} elements outside the bound, "
                             f"max |diff| {float(diff.nan_to_num(float('inf')).max()):.3g}")
        if st["gb"] is not None:
            ref = go2.to(FP64).sum(0)
            if not bool(((st["gb"].to(FP64) - ref).abs() <= 2.0 ** -7 * go2.to(FP64).abs().sum(0) + 1e-30).all()):
                probs.append(f"step {step}: grad_bias outside the bound")
    return probs


# ----------------------------------------------------------------------------- checks
class Checker:
    def __init__(self, manifest, twins):
        self.by_name = {e["name"]: e for e in manifest}
        self.twins = twins
        self.cache = {}
        self.failures = []

    def fail(self, name, msg):
        self.failures.append(f"{name}: {msg}")
        print(f"FAIL {name}: {msg}", flush=True)

    def run_entry(self, entry, case, use_cache=True):
        key = (entry["name"], case)
        if use_cache and key in self.cache:
            return self.cache[key]
        impl = load_impl(entry["impl"])
        r = run(impl, entry["form"], entry["recipe"], case)
        if use_cache:
            self.cache[key] = r
        return r

    # -- correct files
    def check_correct(self, e):
        recipe = e["recipe"]
        cases = [concrete(c, recipe) for c in CORRECT_CASES]
        if recipe == "blockwise":
            cases += BLOCKWISE_EXTRA
        n_ok = 0
        for case in cases:
            lab = case.label(recipe)
            before = len(self.failures)
            r = self.run_entry(e, case, use_cache=(case == Case()))
            if r.error:
                self.fail(e["name"], f"[{lab}] raised in {r.error[0]}: {r.error[1]!r}")
                continue
            for step, gemm, kind, msg in contract_findings(r.calls, recipe, case.dims(recipe)):
                self.fail(e["name"], f"[{lab}] contract ({kind}) step {step} {gemm}: {msg}")
            if recipe == "blockwise":
                for p in blockwise_oracle(r, case, recipe):
                    self.fail(e["name"], f"[{lab}] {p}")
                n_ok += len(self.failures) == before
                continue
            ref = run(None, "torchao", recipe, case)
            if ref.error:
                if "axiswise scaling is not supported" in str(ref.error[1]):
                    # torchao limitation: the case only checks that we run and keep the contract
                    n_ok += len(self.failures) == before
                    continue
                self.fail(e["name"], f"[{lab}] torchao raised {ref.error[1]!r}")
                continue
            d = first_diff(r, ref)
            if d:
                self.fail(e["name"], f"[{lab}] differs from torchao at step {d[0]} {d[1]}: {d[2]}")
            n_ok += len(self.failures) == before
        return n_ok, len(cases)

    # -- bugs
    def check_source(self, e):
        """The bug file is its twin plus a '[planted bug: ...]' docstring header and a
        change of at most two lines."""
        twin = self.by_name[self.twins[e["name"]]]
        src = open(os.path.join(ROOT, e["impl"].rsplit(":", 1)[0])).read()
        ref = open(os.path.join(ROOT, twin["impl"].rsplit(":", 1)[0])).read()
        head = '"""[planted bug: '
        if not src.startswith(head) or "]\n\n" not in src:
            self.fail(e["name"], "module docstring does not start with [planted bug: ...]")
            return False
        body = '"""' + src[src.index("]\n\n") + 3:]
        removed = added = 0
        for line in difflib.ndiff(ref.splitlines(), body.splitlines()):
            removed += line.startswith("- ")
            added += line.startswith("+ ")
        if max(removed, added) > 2 or removed + added == 0:
            self.fail(e["name"], f"differs from its twin by -{removed}/+{added} lines")
            return False
        return True

    def check_bug(self, e, seed=0):
        name, recipe = e["name"], e["recipe"]
        if seed == 0 and not self.check_source(e):
            return False
        twin = self.by_name[self.twins[name]]
        trig = list(e["trigger"])
        gpu_only = "gpu only" in trig
        toks = [t for t in trig if t != "gpu only"]
        base = Case(seed=seed)
        tcase = base
        for t in toks:
            tcase = apply_trigger(tcase, t, recipe)
        dims = tcase.dims(recipe)
        rb, rt = self.run_entry(e, tcase, use_cache=False), self.run_entry(twin, tcase)
        lab = tcase.label(recipe)
        ok = True
        if rt.error:
            self.fail(name, f"[{lab}] twin raised {rt.error[1]!r}")
            return False
        twin_find = contract_findings(rt.calls, recipe, dims)
        if twin_find:
            self.fail(name, f"[{lab}] twin has contract findings {twin_find[:2]}")
            return False
        bug_find = contract_findings(rb.calls, recipe, dims)
        hard = [f for f in bug_find if f[2] == "hard"]
        if gpu_only:
            if rb.error:
                self.fail(name, f"[{lab}] gpu-only bug raised on CPU: {rb.error[1]!r}")
                return False
            d = first_diff(rb, rt)
            if d:
                self.fail(name, f"[{lab}] gpu-only bug differs on CPU at {d}")
                ok = False
            want = "hard" if e["category"] == "crash" else "soft"
            flagged = [f for f in bug_find if f[2] == want]
            if not flagged:
                self.fail(name, f"[{lab}] no {want} contract finding recorded")
                ok = False
            elif flagged[0][1] != e["gemm"]:
                self.fail(name, f"[{lab}] first {want} finding in {flagged[0][1]}, label {e['gemm']}")
                ok = False
            if want == "soft" and hard:
                self.fail(name, f"[{lab}] accumulation bug would raise on SM90: {hard[0]}")
                ok = False
        elif e["category"] == "crash":
            if not rb.error:
                self.fail(name, f"[{lab}] crash bug did not raise")
                ok = False
            else:
                phase = rb.error[0]
                if (phase == "output") != (e["gemm"] == "output"):
                    self.fail(name, f"[{lab}] raised in {phase}, label {e['gemm']}")
                    ok = False
        else:
            if rb.error:
                self.fail(name, f"[{lab}] raised {rb.error[1]!r}")
                return False
            if hard:
                self.fail(name, f"[{lab}] would raise on SM90: {hard[0]}")
                ok = False
            d = first_diff(rb, rt)
            if d is None:
                self.fail(name, f"[{lab}] identical to its twin with its triggers")
                ok = False
            else:
                step, gemm, why = d
                if gemm != e["gemm"]:
                    self.fail(name, f"[{lab}] first difference in {gemm} ({why}), label {e['gemm']}")
                    ok = False
                if "second call" in toks and step != 1:
                    self.fail(name, f"[{lab}] differs already on call {step + 1}")
                    ok = False
        # necessity of the triggers
        without = [base]
        if len(toks) == 2:
            without += [apply_trigger(base, t, recipe) for t in toks]
        if toks:
            for c in without:
                lab = c.label(recipe)
                rb2, rt2 = self.run_entry(e, c, use_cache=False), self.run_entry(twin, c)
                if rb2.error:
                    self.fail(name, f"[{lab}] raised without its trigger(s): {rb2.error[1]!r}")
                    ok = False
                    continue
                d = first_diff(rb2, rt2)
                if d:
                    self.fail(name, f"[{lab}] differs without its trigger(s): {d}")
                    ok = False
                f2 = contract_findings(rb2.calls, recipe, c.dims(recipe))
                if f2:
                    self.fail(name, f"[{lab}] contract findings without its trigger(s): {f2[0]}")
                    ok = False
        # a non-crash bug must stay numerical on an H200: no exception and no hard contract
        # finding on any case the correct files are checked on
        if e["category"] != "crash" and seed == 0:
            cases = [concrete(c, recipe) for c in CORRECT_CASES]
            for c in cases + (BLOCKWISE_EXTRA if recipe == "blockwise" else []):
                rb3 = self.run_entry(e, c, use_cache=False)
                if rb3.error:
                    self.fail(name, f"[{c.label(recipe)}] raised: {rb3.error[1]!r}")
                    ok = False
                hard3 = [f for f in contract_findings(rb3.calls, recipe, c.dims(recipe)) if f[2] == "hard"]
                if hard3:
                    self.fail(name, f"[{c.label(recipe)}] would raise on SM90: {hard3[0]}")
                    ok = False
        return ok


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("names", nargs="*")
    ap.add_argument("--seeds", type=int, default=1, help="re-check bugs on this many seeds")
    args = ap.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    t0 = time.time()
    manifest = json.load(open(os.path.join(HERE, "manifest.json")))
    twins = json.load(open(os.path.join(HERE, "twins.json")))
    chk = Checker(manifest, twins)
    names = args.names or [e["name"] for e in manifest]
    unknown = [n for n in names if n not in chk.by_name]
    if unknown:
        print(f"unknown names: {unknown}")
        return 2
    n_corr = n_bug = ok_corr = ok_bug = 0
    for name in names:
        e = chk.by_name[name]
        before = len(chk.failures)
        if e["category"] == "none":
            n_corr += 1
            good, total = chk.check_correct(e)
            if len(chk.failures) == before:
                ok_corr += 1
                print(f"ok   {name} ({e['recipe']}, {e['form']}): {good}/{total} cases", flush=True)
        else:
            n_bug += 1
            good = all([chk.check_bug(e, seed) for seed in range(args.seeds)])
            if good and len(chk.failures) == before:
                ok_bug += 1
                print(f"ok   {name} ({e['category']}, {e['recipe']}, {e['gemm']}, {e['trigger']})", flush=True)
    dt = time.time() - t0
    status = "PASS" if not chk.failures else "FAIL"
    print(f"verify.py: {status}: {ok_corr}/{n_corr} correct files and {ok_bug}/{n_bug} planted bugs "
          f"check out, {len(chk.failures)} failures, {dt:.1f} s")
    return 0 if not chk.failures else 1


if __name__ == "__main__":
    sys.exit(main())
