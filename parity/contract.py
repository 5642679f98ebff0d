"""The contracts an FP8 linear layer must keep, checked on any device.

1. torch._scaled_mm (and torch.nn.functional.scaled_mm, whose op is aten._scaled_mm_v2) on
   Hopper (SM90): A row-major and B column-major, dimensions and leading dimensions multiples
   of 16, 16-byte aligned pointers, never two e5m2 operands, fp32 scales whose shape and
   strides fit the scaling kind (tensorwise: one element each; rowwise: [M, 1] and [1, N],
   contiguous; DeepSeek-style blocks: 1x128 scales of A as [M, K/128] stored M-major, 128x128
   scales of B as [K/128 padded to a multiple of 4, N/128] stored K-major, 1x128 scales of B as
   [N, K/128] stored N-major; e4m3 operands only; no fast accumulation with 128x128 blocks;
   measured on the H200: M, N and K need not be multiples of 128), and an out_dtype
   (otherwise it writes FP8). On the CPU _scaled_mm is lenient and runs such calls anyway (and
   has no block scaling at all), so a layout bug that raises on an H100 passes silently there.
   The recorder below intercepts every call while an implementation runs (also inside tensor
   subclasses such as torchao's) and `sm90_violations` says which calls "would fail on H100",
   on the CPU too. Each rule was seen raising on an H200 (`python .ci/probe_scaled_mm.py`).
2. nn.Linear's contract: output and gradients have the dtypes, shapes and strides that
   nn.Linear gives them (output in the input's dtype, contiguous; each gradient in its
   parameter's dtype; a leaf's gradient laid out like the leaf when the leaf is dense).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from parity.cases import Case, Layout
from parity.recipes import BLOCK
from parity.vocabulary import BugClass, Word

try:  # torch's custom-op registry (private): without it, a custom op stays opaque to the recorder
    from torch._library.custom_ops import _maybe_get_opdef
except ImportError:  # another torch
    _maybe_get_opdef = None

aten = torch.ops.aten
_V1_OPS = {aten._scaled_mm.default, aten._scaled_mm.out}
_V2_OPS = {aten._scaled_mm_v2.default} if hasattr(aten, "_scaled_mm_v2") else set()  # torch >= 2.10
_V1_ARGS = ("a", "b", "scale_a", "scale_b", "bias", "scale_result", "out_dtype", "use_fast_accum")
_V2_ARGS = ("a", "b", "scale_a", "recipe_a", "swizzle_a", "scale_b", "recipe_b", "swizzle_b", "bias", "out_dtype",
            "contraction_dim", "use_fast_accum")
# torch.nn.functional.ScalingType values, as aten._scaled_mm_v2 receives them
V2_SCALINGS = {0: "TensorWise", 1: "RowWise", 2: "BlockWise1x16", 3: "BlockWise1x32", 4: "BlockWise1x128",
               5: "BlockWise128x128"}
V2_SWIZZLES = {0: "NO_SWIZZLE", 1: "SWIZZLE_32_4_4"}  # torch.nn.functional.SwizzleType values
# what the recorder calls a GEMM of torchao's MXTensor in its emulated mode (KernelPreference.EMULATED): no
# scaled_mm call, an aten.mm of two MXTensors that dequantizes them; the operands are recorded as a call's
MX_EMULATED = "mx_emulated"
_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)


def _dtype_name(dtype) -> str | None:
    return None if dtype is None else str(dtype).replace("torch.", "")


@dataclass(frozen=True)
class Scale:
    shape: tuple
    dtype: str
    stride: tuple


@dataclass(frozen=True)
class CallData:
    """The tensors of a recorded call (kept when the recorder is asked to): the fp8 operands and
    their scales, for comparing them with what the recipe's oracle hands the same GEMM."""

    a: torch.Tensor
    b: torch.Tensor
    scale_a: torch.Tensor
    scale_b: torch.Tensor
    # NVFP4's second level: the per-tensor float32 scales of A and B (scale_a[1], scale_b[1] of the call)
    global_a: torch.Tensor | None = None
    global_b: torch.Tensor | None = None


@dataclass(frozen=True)
class ScaledMMCall:
    """One recorded scaled GEMM call: what cuBLASLt would be asked to do."""

    phase: str  # "forward" or "backward"
    # the GEMMs its shapes fit: ("output",), ("grad_input",), ("grad_weight",), both backward GEMMs when
    # M, K, N are not distinct, () when none
    gemms: tuple
    a_shape: tuple
    a_stride: tuple
    a_dtype: str
    a_align: int  # data pointer modulo 16 (bytes)
    b_shape: tuple
    b_stride: tuple
    b_dtype: str
    b_align: int
    scale_a: tuple  # (shape, dtype)
    scale_b: tuple
    bias_dtype: str | None
    out_dtype: str | None
    use_fast_accum: bool
    op: str = "_scaled_mm"  # or "scaled_mm_v2" (torch.nn.functional.scaled_mm)
    # (A's, B's) scaling kind, named as torch.nn.functional.ScalingType: TensorWise, RowWise,
    # BlockWise1x128, BlockWise128x128, or "?" (scale shapes _scaled_mm does not recognize)
    scaling: tuple = ()
    scale_strides: tuple = ((), ())
    step: int = 0
    data: CallData | None = field(default=None, compare=False, repr=False)
    # (A's, B's) scale layouts, named as torch.nn.functional.SwizzleType (SWIZZLE_32_4_4, NO_SWIZZLE): the
    # first entry of each; () where the call names none (_scaled_mm, and scaled_mm without swizzle)
    swizzle: tuple = ()
    raised: bool = False  # the kernel rejected the call: no result came of it
    # what it raised (first line), for a reader: no decision reads it (ended_case tells the crash it caused)
    error: str = field(default="", compare=False)
    # its exception is the one that ended the case (parity.runner.execute tells: the same exception object)
    ended_case: bool = field(default=False, compare=False)

    @property
    def label(self) -> str:
        """The GEMM as the text names it: "output", or "grad_input|grad_weight" when the shapes cannot tell."""
        return _gemm_label(self.gemms)

    def describe(self) -> str:
        def operand(name, shape, stride, dtype):
            return f"{name} {dtype} {'x'.join(map(str, shape))} strides {tuple(stride)}"
        kinds = f"{self.scaling[0]}/{self.scaling[1]} " if self.scaling else ""
        return (f"{self.label} GEMM: {operand('A', self.a_shape, self.a_stride, self.a_dtype)}, "
                f"{operand('B', self.b_shape, self.b_stride, self.b_dtype)}, "
                f"{kinds}scales {list(self.scale_a[0])}/{list(self.scale_b[0])}, out_dtype={self.out_dtype}, "
                f"use_fast_accum={self.use_fast_accum}")


def _gemm_label(gemms: tuple) -> str:
    return "|".join(gemms) or "unknown"


def _guess_gemms(phase: str, a_shape: tuple, b_shape: tuple, M: int, K: int, N: int) -> tuple:
    if phase == "forward":
        return ("output",)
    candidates = []
    if a_shape == (M, N) and b_shape == (N, K):
        candidates.append("grad_input")
    if a_shape == (N, M) and b_shape == (M, K):
        candidates.append("grad_weight")
    return tuple(candidates)


def _v1_scaling(a_shape, scale_a: torch.Tensor, b_shape, scale_b: torch.Tensor) -> tuple[str, str]:
    """The scaling kinds torch._scaled_mm infers from the scale shapes (SM90: tensorwise or rowwise) and, on
    SM100, from the scale dtypes (e8m0: MXFP8's 1x32 blocks; e4m3 scales of fp4 operands: NVFP4's 1x16)."""
    mx_kind = v1_mx_kind(scale_a, scale_b)
    if mx_kind is not None:
        return mx_kind, mx_kind
    if scale_a.numel() == 1 and scale_b.numel() == 1:
        return "TensorWise", "TensorWise"
    if len(a_shape) == 2 and len(b_shape) == 2 and tuple(scale_a.shape) == (a_shape[0], 1) \
            and tuple(scale_b.shape) == (1, b_shape[1]):
        return "RowWise", "RowWise"
    return "?", "?"


def v1_mx_kind(scale_a: torch.Tensor, scale_b: torch.Tensor) -> str | None:
    """The microscaled kind of a torch._scaled_mm call (its scales say it: torchao's MX GEMMs call it so), or None.
    Its scales are swizzled: _scaled_mm takes no other layout for them."""
    if scale_a.dtype == scale_b.dtype == torch.float8_e8m0fnu:
        return "BlockWise1x32"
    if scale_a.dtype == scale_b.dtype == torch.float8_e4m3fn and scale_a.numel() > 1:
        return "BlockWise1x16"
    return None


def custom_op_kernel(func, args):
    """The Python function behind a torch.library.custom_op `func` for the device of its first
    tensor argument, or None (an aten op, or an op without one). A custom op is opaque to a
    dispatch mode: the mode sees the op, not the _scaled_mm calls its kernel makes. A mode that
    runs this function itself, with the mode active again, sees them (and no recursion: the
    function is the op's body, not the op)."""
    if func.namespace in ("aten", "prim", "prims") or _maybe_get_opdef is None:
        return None
    try:
        opdef = _maybe_get_opdef(func)
    except (AttributeError, TypeError, ValueError):  # another torch: the op stays opaque
        return None
    if opdef is None:
        return None
    device = next((a.device.type for a in args if isinstance(a, torch.Tensor)), None)
    backends = getattr(opdef, "_backend_fns", {}) or {}
    return backends.get(device) or backends.get(None) or getattr(opdef, "_init_fn", None)


class ScaledMMRecorder(TorchDispatchMode):
    """Records every aten._scaled_mm and aten._scaled_mm_v2 call made while active (with the
    operand and scale tensors, cloned, when keep_data=True).

    Calls with tensor-subclass arguments return NotImplemented so the subclass handles
    them first; the plain-tensor call it then issues comes back through this mode. The body of a
    torch.library custom op runs inside this mode (custom_op_kernel), so calls it makes are seen.
    """

    def __init__(self, M: int, K: int, N: int, *, keep_data: bool = False):
        super().__init__()
        self.M, self.K, self.N = M, K, N
        self.phase, self.step, self.keep_data = "forward", 0, keep_data
        self.calls: list[ScaledMMCall] = []
        # what each rejected call raised, by its index in `calls` (kept apart: an exception need not pickle)
        self.exceptions: dict[int, BaseException] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(t not in _PLAIN_TYPES for t in types):
            if func in _MM_OPS and len(args) >= 2 and all(_is_mx_tensor(arg) for arg in args[:2]):
                self.calls.append(self._record_mx_tensors(args[0], args[1]))
            return NotImplemented
        if func in _V1_OPS or func in _V2_OPS:
            self.calls.append(self._record(func in _V2_OPS, args, kwargs))
            index = len(self.calls) - 1
            try:
                return func(*args, **kwargs)
            except BaseException as err:
                self.calls[index] = replace(self.calls[index], raised=True,
                                            error=(str(err).strip().splitlines() or [""])[0][:300])
                self.exceptions[index] = err
                raise
        kernel = custom_op_kernel(func, args)
        if kernel is not None:  # a torch.library custom op: its body runs here, its calls come through this mode
            with self:
                return kernel(*args, **kwargs)
        return func(*args, **kwargs)

    def mark_ended_case(self, err: BaseException) -> None:
        """Mark the calls whose exception is `err`, the one that ended the case (the same object: a call
        rejected and caught, as code that falls back to its own GEMM does, is not marked)."""
        for index, raised in self.exceptions.items():
            if raised is err:
                self.calls[index] = replace(self.calls[index], ended_case=True)

    def _record(self, v2: bool, args, kwargs) -> ScaledMMCall:
        names = _V2_ARGS if v2 else _V1_ARGS
        bound = dict(zip(names, args))
        bound.update({("a" if k == "self" else "b" if k == "mat2" else k): v for k, v in kwargs.items()})
        a, b = bound["a"], bound["b"]
        globals_, swizzle = (None, None), ()
        if v2:
            scale_a, scale_b = bound["scale_a"][0], bound["scale_b"][0]
            scaling = tuple(V2_SCALINGS.get(int(r[0]) if r else -1, "?") for r in (bound["recipe_a"],
                                                                                   bound["recipe_b"]))
            globals_ = tuple(scales[1] if len(scales) > 1 else None for scales in (bound["scale_a"], bound["scale_b"]))
            swizzles = (bound.get("swizzle_a") or (), bound.get("swizzle_b") or ())
            swizzle = tuple(V2_SWIZZLES.get(int(z[0]), "?") if z else "NO_SWIZZLE" for z in swizzles) \
                if any(swizzles) else ()
        else:
            scale_a, scale_b = bound["scale_a"], bound["scale_b"]
            scaling = _v1_scaling(tuple(a.shape), scale_a, tuple(b.shape), scale_b)
            swizzle = ("SWIZZLE_32_4_4", "SWIZZLE_32_4_4") if scaling[0] in MX_CALLS else ()
        return self._call(a, b, scale_a, scale_b, globals_, op="scaled_mm_v2" if v2 else "_scaled_mm",
                          scaling=scaling, swizzle=swizzle, bias=bound.get("bias"), out_dtype=bound.get("out_dtype"),
                          fast=bool(bound.get("use_fast_accum", False)))

    def _record_mx_tensors(self, a, b) -> ScaledMMCall:
        """An aten.mm of two torchao MXTensors (their emulated GEMM) as the call it stands for: the fp8
        elements, and the e8m0 scales as [rows, K / 32] grids (B's for its columns), not swizzled."""
        scaling = "BlockWise1x32" if a.block_size == 32 else "?"
        return self._call(a.qdata, b.qdata, a.scale, b.scale.t(), (None, None), op=MX_EMULATED,
                          scaling=(scaling, scaling), swizzle=("NO_SWIZZLE", "NO_SWIZZLE"), bias=None,
                          out_dtype=a.orig_dtype, fast=False)

    def _call(self, a, b, scale_a, scale_b, globals_, *, op, scaling, swizzle, bias, out_dtype, fast) -> ScaledMMCall:
        scale = lambda s: (tuple(s.shape), _dtype_name(s.dtype))  # noqa: E731
        kept = (lambda t: None if t is None else t.detach().clone()) if self.keep_data else None  # noqa: E731
        data = CallData(kept(a), kept(b), kept(scale_a), kept(scale_b), *map(kept, globals_)) if kept else None
        return ScaledMMCall(
            phase=self.phase, gemms=_guess_gemms(self.phase, _logical(a), _logical(b), self.M, self.K, self.N),
            a_shape=tuple(a.shape), a_stride=tuple(a.stride()), a_dtype=_dtype_name(a.dtype), a_align=a.data_ptr() % 16,
            b_shape=tuple(b.shape), b_stride=tuple(b.stride()), b_dtype=_dtype_name(b.dtype), b_align=b.data_ptr() % 16,
            scale_a=scale(scale_a), scale_b=scale(scale_b),
            bias_dtype=None if bias is None else _dtype_name(bias.dtype),
            out_dtype=_dtype_name(out_dtype), use_fast_accum=fast, op=op, scaling=scaling,
            scale_strides=(tuple(scale_a.stride()), tuple(scale_b.stride())), step=self.step, data=data,
            swizzle=swizzle,
        )


_MM_OPS = {aten.mm.default}


def _is_mx_tensor(arg) -> bool:
    """torchao's MXTensor (read by its attributes: torchao is not imported here)."""
    return isinstance(arg, torch.Tensor) and all(hasattr(arg, name) for name in ("qdata", "scale", "block_size",
                                                                                  "orig_dtype"))


def _logical(t: torch.Tensor) -> tuple:
    """A GEMM operand's logical shape: a packed fp4 tensor holds two elements per byte along the
    contraction dim (its last dim for A, its first for B, which is stored column-major)."""
    if t.dtype != torch.float4_e2m1fn_x2 or t.dim() != 2:
        return tuple(t.shape)
    rows, cols = t.shape
    return (rows, 2 * cols) if t.stride(-1) == 1 else (2 * rows, cols)


def _strided_as(shape: tuple, stride: tuple, want: tuple) -> bool:
    """Strides equal to `want` wherever the dimension has more than one element."""
    return all(size <= 1 or got == expected for size, got, expected in zip(shape, stride, want))


class GpuRule(Word):
    """A rule of SM90's scaled GEMM (cuBLASLt) that a call breaks (see the module docstring)."""

    NOT_2D = "not_2d"
    SHAPES_MISMATCH = "shapes_mismatch"
    A_NOT_ROW_MAJOR = "a_not_row_major"
    A_ROW_STRIDE = "a_row_stride"
    B_NOT_COLUMN_MAJOR = "b_not_column_major"
    B_COLUMN_STRIDE = "b_column_stride"
    NOT_DIVISIBLE_BY_16 = "not_divisible_by_16"
    BOTH_E5M2 = "both_e5m2"
    SCALES_NOT_FLOAT32 = "scales_not_float32"
    ROWWISE_SCALE_SHAPES = "rowwise_scale_shapes"
    ROWWISE_SCALE_STRIDES = "rowwise_scale_strides"
    BLOCKS_E4M3_ONLY = "blocks_e4m3_only"
    A_BLOCK_SCALE_SHAPE = "a_block_scale_shape"
    A_BLOCK_SCALE_STRIDES = "a_block_scale_strides"
    B_BLOCK_SCALE_SHAPE = "b_block_scale_shape"
    B_BLOCK_SCALE_STRIDES = "b_block_scale_strides"
    BLOCKS_FAST_ACCUM = "blocks_fast_accum"
    UNKNOWN_SCALES = "unknown_scales"
    A_UNALIGNED = "a_unaligned"
    B_UNALIGNED = "b_unaligned"
    BIAS_WITH_FLOAT32_OUT = "bias_with_float32_out"
    NO_OUT_DTYPE = "no_out_dtype"  # not an H100 rule: FP8 out, on any device
    # SM100 (B200) rules of microscaled calls, from torch's _scaled_mm_v2 (ScaledBlas.cpp: check_mxfp8_recipe,
    # check_nvfp4_recipe, _scaled_mxfp8_mxfp8, _scaled_nvfp4_nvfp4)
    MX_ELEMENT_DTYPE = "mx_element_dtype"  # MXFP8: both operands float8_e4m3fn; NVFP4: both float4_e2m1fn_x2
    MX_SCALE_DTYPE = "mx_scale_dtype"  # MXFP8: e8m0 scales; NVFP4: e4m3 block scales and a float32 global
    A_MX_SCALE_SIZE = "a_mx_scale_size"  # scales padded to whole 128x4 tiles: round_up(rows,128)*round_up(K/b,4)
    B_MX_SCALE_SIZE = "b_mx_scale_size"
    A_NOT_SWIZZLED = "a_not_swizzled"  # SM100 takes SWIZZLE_32_4_4 scales only
    B_NOT_SWIZZLED = "b_not_swizzled"
    MX_SCALES_NOT_CONTIGUOUS = "mx_scales_not_contiguous"
    FP4_FAST_ACCUM = "fp4_fast_accum"  # use_fast_accum raises with fp4 operands


# What each rule is about: the operand (a | b | call) and the bug class a call that breaks it shows
RULES = {
    GpuRule.NOT_2D: ("a", BugClass.CRASH), GpuRule.SHAPES_MISMATCH: ("call", BugClass.CRASH),
    GpuRule.NOT_DIVISIBLE_BY_16: ("call", BugClass.CRASH), GpuRule.BOTH_E5M2: ("call", BugClass.FP8_DTYPE),
    GpuRule.BLOCKS_E4M3_ONLY: ("call", BugClass.FP8_DTYPE), GpuRule.BLOCKS_FAST_ACCUM: ("call", BugClass.ACCUMULATION),
    GpuRule.A_BLOCK_SCALE_SHAPE: ("a", BugClass.SCALE), GpuRule.A_BLOCK_SCALE_STRIDES: ("a", BugClass.SCALE),
    GpuRule.B_BLOCK_SCALE_SHAPE: ("b", BugClass.SCALE), GpuRule.B_BLOCK_SCALE_STRIDES: ("b", BugClass.SCALE),
    GpuRule.ROWWISE_SCALE_SHAPES: ("call", BugClass.SCALE), GpuRule.ROWWISE_SCALE_STRIDES: ("call", BugClass.SCALE),
    GpuRule.SCALES_NOT_FLOAT32: ("call", BugClass.SCALE), GpuRule.UNKNOWN_SCALES: ("call", BugClass.SCALE),
    GpuRule.A_UNALIGNED: ("a", BugClass.LAYOUT), GpuRule.B_UNALIGNED: ("b", BugClass.LAYOUT),
    GpuRule.A_NOT_ROW_MAJOR: ("a", BugClass.LAYOUT), GpuRule.A_ROW_STRIDE: ("a", BugClass.LAYOUT),
    GpuRule.B_NOT_COLUMN_MAJOR: ("b", BugClass.LAYOUT), GpuRule.B_COLUMN_STRIDE: ("b", BugClass.LAYOUT),
    GpuRule.BIAS_WITH_FLOAT32_OUT: ("call", BugClass.CONTRACT), GpuRule.NO_OUT_DTYPE: ("call", BugClass.CONTRACT),
    GpuRule.MX_ELEMENT_DTYPE: ("call", BugClass.FP8_DTYPE), GpuRule.MX_SCALE_DTYPE: ("call", BugClass.SCALE),
    GpuRule.A_MX_SCALE_SIZE: ("a", BugClass.SCALE), GpuRule.B_MX_SCALE_SIZE: ("b", BugClass.SCALE),
    GpuRule.A_NOT_SWIZZLED: ("a", BugClass.SCALE), GpuRule.B_NOT_SWIZZLED: ("b", BugClass.SCALE),
    GpuRule.MX_SCALES_NOT_CONTIGUOUS: ("call", BugClass.SCALE), GpuRule.FP4_FAST_ACCUM: ("call", BugClass.CRASH),
}
ON_H100 = "would fail on H100: "
SM100 = "SM100 (B200)"  # the GPU of the microscaled calls' rules (no Hopper runs them at all)


@dataclass(frozen=True)
class GpuProblem:
    """A rule a recorded call breaks, and the rule's sentence about this call (its values)."""

    rule: GpuRule
    detail: str
    gpu: str = "H100"  # the GPU whose kernel refuses it: a microscaled call's rules are SM100's (B200)

    @property
    def role(self) -> str:
        """The operand it is about: "a", "b" or "call"."""
        return RULES[self.rule][0]

    @property
    def category(self) -> BugClass:
        return RULES[self.rule][1]

    @property
    def message(self) -> str:
        if self.rule is GpuRule.NO_OUT_DTYPE:
            return self.detail
        return (ON_H100 if self.gpu == "H100" else f"would fail on {self.gpu}: ") + self.detail

    def __str__(self) -> str:
        return self.message


@dataclass(frozen=True)
class CallProblem:
    """A GpuProblem of one recorded call, as a result row lists it (`scaled_mm`)."""

    gemms: tuple  # the call's candidate GEMMs (ScaledMMCall.gemms)
    problem: GpuProblem

    def __str__(self) -> str:
        return f"{_gemm_label(self.gemms)} GEMM: {self.problem.message}"


def _rowwise_scale_problems(call: ScaledMMCall, M: int, N: int) -> list[GpuProblem]:
    (sa_shape, _), (sb_shape, _) = call.scale_a, call.scale_b
    sa_stride, sb_stride = call.scale_strides or ((), ())
    if tuple(sa_shape) != (M, 1) or tuple(sb_shape) != (1, N):
        return [GpuProblem(GpuRule.ROWWISE_SCALE_SHAPES, f"rowwise scales must be [{M}, 1] and [1, {N}], got "
                                                          f"{list(sa_shape)} and {list(sb_shape)}")]
    if sa_stride and not (_strided_as(sa_shape, sa_stride, (1, 1)) and _strided_as(sb_shape, sb_stride, (N, 1))):
        return [GpuProblem(GpuRule.ROWWISE_SCALE_STRIDES, f"rowwise scales must be contiguous, got strides "
                                                           f"{sa_stride} and {sb_stride}")]
    return []


def _block_scale_problems(call: ScaledMMCall, M: int, K: int, N: int) -> list[GpuProblem]:
    (sa_shape, _), (sb_shape, _) = call.scale_a, call.scale_b
    sa_stride, sb_stride = call.scale_strides or ((), ())
    problems = []
    if "float8_e5m2" in (call.a_dtype, call.b_dtype):
        problems.append(GpuProblem(GpuRule.BLOCKS_E4M3_ONLY, f"block scaling takes e4m3 operands only, got "
                                                             f"{call.a_dtype} x {call.b_dtype}"))
    k_blocks = -(-K // BLOCK)
    if tuple(sa_shape) != (M, k_blocks):
        problems.append(GpuProblem(GpuRule.A_BLOCK_SCALE_SHAPE, f"1x128 scales of A [{M}x{K}] must be [{M}, "
                                                                f"{k_blocks}], got {list(sa_shape)}"))
    elif sa_stride and not _strided_as(sa_shape, sa_stride, (1, M)):
        problems.append(GpuProblem(GpuRule.A_BLOCK_SCALE_STRIDES, f"1x128 scales of A must be stored M-major "
                                   f"(strides (1, {M})), got {sa_stride}; pass scale.t().contiguous().t()"))
    if call.scaling[1] == "BlockWise128x128":
        padded, n_blocks = -(-k_blocks // 4) * 4, -(-N // BLOCK)
        if tuple(sb_shape) != (padded, n_blocks):
            problems.append(GpuProblem(GpuRule.B_BLOCK_SCALE_SHAPE, f"128x128 scales of B [{K}x{N}] must be "
                                       f"[{padded}, {n_blocks}] (K/128 padded to a multiple of 4), got "
                                       f"{list(sb_shape)}"))
        elif sb_stride and not _strided_as(sb_shape, sb_stride, (1, padded)):
            problems.append(GpuProblem(GpuRule.B_BLOCK_SCALE_STRIDES, f"128x128 scales of B must be stored K-major "
                                                                      f"(strides (1, {padded})), got {sb_stride}"))
        if call.use_fast_accum:
            problems.append(GpuProblem(GpuRule.BLOCKS_FAST_ACCUM, "fast accumulation is not supported with 128x128 "
                                                                  "block scales"))
    elif tuple(sb_shape) != (N, k_blocks):
        problems.append(GpuProblem(GpuRule.B_BLOCK_SCALE_SHAPE, f"1x128 scales of B [{K}x{N}] must be [{N}, "
                                                                f"{k_blocks}], got {list(sb_shape)}"))
    elif sb_stride and not _strided_as(sb_shape, sb_stride, (1, N)):
        problems.append(GpuProblem(GpuRule.B_BLOCK_SCALE_STRIDES, f"1x128 scales of B must be stored N-major "
                                                                  f"(strides (1, {N})), got {sb_stride}"))
    return problems


# what a microscaled call's operands and scales must be on SM100: (element dtype, block, block-scale dtype)
MX_CALLS = {"BlockWise1x32": ("float8_e4m3fn", 32, "float8_e8m0fnu"), "BlockWise1x16": ("float4_e2m1fn_x2", 16,
                                                                                          "float8_e4m3fn")}


def _mx_scale_problems(call: ScaledMMCall, M: int, K: int, N: int) -> list[GpuProblem]:
    """The SM100 rules of an MXFP8 or NVFP4 call (torch's _scaled_mm_v2; see GpuRule): both operands of
    the format, scales of its dtype padded to whole 128x4 tiles, swizzled and contiguous. M, K and N are
    the call's shapes as stored (fp4: K counts bytes, two elements each)."""
    element, block, scale_dtype = MX_CALLS[call.scaling[0]]
    packing = 2 if element == "float4_e2m1fn_x2" else 1
    problems = []
    if call.a_dtype != element or call.b_dtype != element:
        problems.append(GpuProblem(GpuRule.MX_ELEMENT_DTYPE, f"{call.scaling[0]} scaling takes {element} operands, "
                                                             f"got {call.a_dtype} x {call.b_dtype}"))
    (sa_shape, sa_dtype), (sb_shape, sb_dtype) = call.scale_a, call.scale_b
    if sa_dtype != scale_dtype or sb_dtype != scale_dtype:
        problems.append(GpuProblem(GpuRule.MX_SCALE_DTYPE, f"{call.scaling[0]} scales must be {scale_dtype}, got "
                                                           f"{sa_dtype} and {sb_dtype}"))
    blocks = -(-K * packing // block)
    for rule, name, rows, shape in ((GpuRule.A_MX_SCALE_SIZE, "A", M, sa_shape),
                                    (GpuRule.B_MX_SCALE_SIZE, "B", N, sb_shape)):
        want = (-(-rows // 128) * 128) * (-(-blocks // 4) * 4)
        if math.prod(shape) != want:
            problems.append(GpuProblem(rule, f"the scales of {name} ({rows} rows x {blocks} blocks of {block}) must "
                                             f"have {want} entries, padded to whole 128x4 tiles "
                                             f"(round_up({rows}, 128) x round_up({blocks}, 4)), got {list(shape)}"))
    for rule, name, swizzle in ((GpuRule.A_NOT_SWIZZLED, "scale_a", call.swizzle[:1]),
                                (GpuRule.B_NOT_SWIZZLED, "scale_b", call.swizzle[1:])):
        if swizzle != ("SWIZZLE_32_4_4",):
            problems.append(GpuProblem(rule, f"{name} must be swizzled (SwizzleType.SWIZZLE_32_4_4), got "
                                             f"{swizzle[0] if swizzle else 'no swizzle'}"))
    strides = call.scale_strides or ((), ())
    if any(stride and not _strided_as(shape, stride, _contiguous_strides(shape))
           for shape, stride in zip((sa_shape, sb_shape), strides)):
        problems.append(GpuProblem(GpuRule.MX_SCALES_NOT_CONTIGUOUS, f"block scales must be contiguous, got strides "
                                                                     f"{strides[0]} and {strides[1]}"))
    if call.use_fast_accum and packing == 2:
        problems.append(GpuProblem(GpuRule.FP4_FAST_ACCUM, "use_fast_accum is not supported with float4 operands"))
    return problems


def _scale_problems(call: ScaledMMCall, M: int, K: int, N: int) -> list[GpuProblem]:
    """The scale rules of the call's scaling kinds (see the module docstring)."""
    (sa_shape, sa_dtype), (sb_shape, sb_dtype) = call.scale_a, call.scale_b
    kinds = call.scaling or ("?", "?")
    if kinds[0] == kinds[1] and kinds[0] in MX_CALLS:
        return _mx_scale_problems(call, M, K, N)
    if sa_dtype != "float32" or sb_dtype != "float32":
        return [GpuProblem(GpuRule.SCALES_NOT_FLOAT32, f"scales must be float32, got scale_a {sa_dtype} and "
                                                       f"scale_b {sb_dtype}")]
    if kinds == ("TensorWise", "TensorWise"):
        return []
    if kinds == ("RowWise", "RowWise"):
        return _rowwise_scale_problems(call, M, N)
    if kinds[0] == "BlockWise1x128" and kinds[1] in ("BlockWise1x128", "BlockWise128x128"):
        return _block_scale_problems(call, M, K, N)
    return [GpuProblem(GpuRule.UNKNOWN_SCALES, f"scale shapes {list(sa_shape)} and {list(sb_shape)} ({kinds[0]}/"
                                               f"{kinds[1]}) are none of tensorwise (1 element each), rowwise "
                                               f"([{M}, 1] and [1, {N}]) or 1x128/128x128 blocks")]


def _layout_problems(call: ScaledMMCall, M: int, K: int, Kb: int, N: int) -> list[GpuProblem]:
    # SM90's cuBLASLt runs FP8 only as "TN" (seen raising on an H200). A microscaled call's block scales run
    # along K, so SM100 takes both operands K-major too: torchao's MX and NVFP4 GEMMs assert
    # a._data.is_contiguous() and b._data.t().is_contiguous() before the call (not seen raising: no SM100 here)
    kernel = ("SM100's block-scaled GEMM (K-major, as its scales)" if call.scaling and call.scaling[0] in MX_CALLS
              else "SM90 cuBLASLt")
    problems = []
    if not (call.a_stride[1] == 1 and call.a_stride[0] >= max(1, K)):
        problems.append(GpuProblem(GpuRule.A_NOT_ROW_MAJOR, f"A [{M}x{K}] has strides {call.a_stride}: {kernel} "
                                                            f"needs A row-major (stride(1) == 1); pass a.contiguous()"))
    elif call.a_stride[0] % 16:
        problems.append(GpuProblem(GpuRule.A_ROW_STRIDE, f"A's row stride {call.a_stride[0]} is not a multiple of 16 "
                                                         f"bytes (cuBLASLt: CUBLAS_STATUS_NOT_SUPPORTED); pass "
                                                         f"a.contiguous()"))
    if not (call.b_stride[0] == 1 and call.b_stride[1] >= max(1, Kb)):
        problems.append(GpuProblem(GpuRule.B_NOT_COLUMN_MAJOR, f"B [{Kb}x{N}] has strides {call.b_stride}: {kernel} "
                                                               f"needs B column-major (stride(0) == 1); pass "
                                                               f"b.t().contiguous().t()"))
    elif call.b_stride[1] % 16:
        problems.append(GpuProblem(GpuRule.B_COLUMN_STRIDE, f"B's column stride {call.b_stride[1]} is not a multiple "
                                                            f"of 16 bytes (cuBLASLt: CUBLAS_STATUS_NOT_SUPPORTED); "
                                                            f"pass b.t().contiguous().t()"))
    return problems


def sm90_problems(call: ScaledMMCall) -> list[GpuProblem]:
    """What goes wrong with this call on an H100/H200; empty if nothing. Each rule was seen raising
    on an H200 (torch 2.11, `python .ci/probe_scaled_mm.py`). A microscaled call (MXFP8, NVFP4) is judged
    by SM100's rules instead (the GPU that runs it; read from torch's source, not seen raising: no SM100
    here); torchao's emulated MX GEMM (an aten.mm, op MX_EMULATED) calls no kernel: no rule applies."""
    if call.op == MX_EMULATED:
        return []
    if call.scaling and call.scaling[0] == call.scaling[1] and call.scaling[0] in MX_CALLS:
        return [replace(problem, gpu=SM100) for problem in _problems(call)]
    return _problems(call)


def _problems(call: ScaledMMCall) -> list[GpuProblem]:
    if len(call.a_shape) != 2 or len(call.b_shape) != 2:
        return [GpuProblem(GpuRule.NOT_2D, f"_scaled_mm takes 2-D operands, got A {call.a_shape} and B "
                                           f"{call.b_shape}")]
    problems = []
    (M, K), (Kb, N) = call.a_shape, call.b_shape
    if K != Kb:
        problems.append(GpuProblem(GpuRule.SHAPES_MISMATCH, f"A [{M}x{K}] and B [{Kb}x{N}] cannot be multiplied"))
    problems += _layout_problems(call, M, K, Kb, N)
    for name, value in (("K (A.size(1))", K), ("B.size(0)", Kb), ("N (B.size(1))", N)):
        if value % 16:
            problems.append(GpuProblem(GpuRule.NOT_DIVISIBLE_BY_16, f"{name} = {value} is not divisible by 16"))
    if call.a_dtype == call.b_dtype == "float8_e5m2":
        problems.append(GpuProblem(GpuRule.BOTH_E5M2, "both operands are float8_e5m2: cuBLASLt multiplies e5m2 only "
                                                      "with e4m3"))
    problems += _scale_problems(call, M, K, N)
    for rule, name, align in ((GpuRule.A_UNALIGNED, "A", call.a_align), (GpuRule.B_UNALIGNED, "B", call.b_align)):
        if align:
            problems.append(GpuProblem(rule, f"{name}'s data pointer is not 16-byte aligned (offset {align} bytes; "
                                             f"cuBLASLt: CUBLAS_STATUS_NOT_SUPPORTED)"))
    if call.bias_dtype is not None and call.out_dtype == "float32":
        problems.append(GpuProblem(GpuRule.BIAS_WITH_FLOAT32_OUT, "a bias with out_dtype=float32 is not supported"))
    if call.out_dtype is None:
        problems.append(GpuProblem(GpuRule.NO_OUT_DTYPE, f"no out_dtype: the result is written in {call.a_dtype}, on "
                                                         f"any device (pass out_dtype=torch.bfloat16 or the input's "
                                                         f"dtype)"))
    return problems


def sm90_violations(call: ScaledMMCall) -> list[str]:
    """sm90_problems as sentences ("would fail on H100: ...")."""
    return [problem.message for problem in sm90_problems(call)]


# ---- nn.Linear's contract -------------------------------------------------------------------

@dataclass(frozen=True)
class TensorContract:
    dtype: torch.dtype
    shape: tuple
    stride: tuple


def _contiguous_strides(shape: tuple) -> tuple:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _grad_strides(shape: tuple, layout: Layout) -> tuple:
    """Strides of a leaf's .grad: autograd lays it out like the leaf when the leaf is dense
    (non-overlapping and without gaps), else contiguous."""
    if layout is Layout.TRANSPOSED:
        swapped = (*shape[:-2], shape[-1], shape[-2])
        strides = list(_contiguous_strides(swapped))
        strides[-1], strides[-2] = strides[-2], strides[-1]
        return tuple(strides)
    return _contiguous_strides(shape)


def expected_contract(case: Case, *, compute_dtype: torch.dtype | None = None) -> dict[str, TensorContract]:
    """What nn.Linear gives for this case (parity's tests check this against nn.Linear itself);
    with `compute_dtype`, what it gives on the case's data cast to that dtype (a bf16 reference)."""
    in_dtype, w_dtype = compute_dtype or case.torch_input_dtype, compute_dtype or case.torch_weight_dtype
    contract = dict(
        output=TensorContract(in_dtype, case.output_shape, _contiguous_strides(case.output_shape)),
        grad_input=TensorContract(in_dtype, case.input_shape, _grad_strides(case.input_shape, case.input_layout)),
        grad_weight=TensorContract(w_dtype, (case.N, case.K), _grad_strides((case.N, case.K), case.weight_layout)),
    )
    if case.bias:
        contract["grad_bias"] = TensorContract(w_dtype, (case.N,), (1,))
    return contract


class Breach(Word):
    """A way to break nn.Linear's contract: what the caller gets back, or what the call does beside it."""

    MISSING = "missing"  # a tensor (a gradient) not returned
    DTYPE = "dtype"
    SHAPE = "shape"
    STRIDES = "strides"
    MODIFIED_IN_PLACE = "modified_in_place"  # an operand the caller owns, written by the call
    SHARES_MEMORY = "shares_memory"  # the output a view of the input
    GLOBAL_STATE = "global_state"  # torch's global state changed (and restored by the harness)
    PRINTS = "prints"  # megabytes printed during one case


@dataclass(frozen=True)
class ContractProblem:
    """One way a result or a call breaks nn.Linear's contract. `subject` is the tensor (output,
    grad_input, ...) or the operand (input, weight, grad_output) it concerns; `got` and `want` what it
    is and what nn.Linear gives; `detail` what else its sentence says."""

    breach: Breach
    subject: str = ""
    step: int | None = None
    got: object = None
    want: object = None
    detail: str = ""

    def __str__(self) -> str:
        return _CONTRACT_SENTENCES[self.breach](self)


def _in_place(p: ContractProblem) -> str:
    if p.subject == "input":
        return f"step {p.step}: the input was modified in place"
    if p.subject == "weight":
        return f"step {p.step}: the weight was modified in place by forward/backward{p.detail}"
    return f"step {p.step}: {p.subject} was modified in place by backward"


_CONTRACT_SENTENCES = {
    Breach.MISSING: lambda p: f"{p.subject} is None (nn.Linear gives a {p.want[0]} tensor of shape {list(p.want[1])})",
    Breach.DTYPE: lambda p: f"{p.subject} dtype is {p.got}, nn.Linear gives {p.want}",
    Breach.SHAPE: lambda p: f"{p.subject} shape is {list(p.got)}, nn.Linear gives {list(p.want)}",
    Breach.STRIDES: lambda p: f"{p.subject} strides are {p.got}, nn.Linear gives {p.want}",
    Breach.MODIFIED_IN_PLACE: _in_place,
    Breach.SHARES_MEMORY: lambda p: f"step {p.step}: the output shares memory with the input (a view of it)",
    Breach.GLOBAL_STATE: lambda p: f"the implementation changed global state: {p.detail} (restored)",
    Breach.PRINTS: lambda p: (f"the implementation printed {p.got / 2**20:.1f} MiB during the case (nn.Linear prints "
                              f"nothing; more than {p.want // 1024} KiB floods a training log)"),
}


def contract_problems(tensor: torch.Tensor | TensorContract | None, expected: TensorContract,
                      name: str) -> list[ContractProblem]:
    """How `tensor` (or its recorded dtype/shape/strides) differs from what nn.Linear gives."""
    if isinstance(tensor, torch.Tensor):
        tensor = TensorContract(tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()))
    if tensor is None:
        return [ContractProblem(Breach.MISSING, name, want=(_dtype_name(expected.dtype), tuple(expected.shape)))]
    problems = []
    if tensor.dtype != expected.dtype:
        problems.append(ContractProblem(Breach.DTYPE, name, got=_dtype_name(tensor.dtype),
                                        want=_dtype_name(expected.dtype)))
    if tuple(tensor.shape) != expected.shape:
        problems.append(ContractProblem(Breach.SHAPE, name, got=tuple(tensor.shape), want=tuple(expected.shape)))
    elif math.prod(tensor.shape) > 1 and not _strided_as(tuple(tensor.shape), tensor.stride, expected.stride):
        # the stride of a dimension of size 1 addresses nothing: (16, 1, 16) and (256, 1, 16) of a [1, 16, 16]
        # tensor are the same layout (nn.Linear's own gradients differ there between torch versions)
        problems.append(ContractProblem(Breach.STRIDES, name, got=tensor.stride, want=expected.stride))
    return problems


def contract_violations(tensor: torch.Tensor | TensorContract | None, expected: TensorContract,
                        name: str) -> list[str]:
    """contract_problems as sentences."""
    return [str(problem) for problem in contract_problems(tensor, expected, name)]
