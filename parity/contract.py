"""The contracts an FP8 linear layer must keep, checked on any device.

1. torch._scaled_mm on Hopper (SM90) takes A row-major and B column-major, every dimension
   divisible by 16, never two e5m2 operands, fp32 scales of a supported shape, and should be
   told its out_dtype (otherwise it writes FP8). On the CPU _scaled_mm is lenient and runs
   such calls anyway, so a layout bug that raises on an H100 passes silently there. The
   recorder below intercepts every aten._scaled_mm call while an implementation runs (also
   inside tensor subclasses such as torchao's) and `sm90_violations` says which calls
   "would fail on H100", on the CPU too.
2. nn.Linear's contract: output and gradients have the dtypes, shapes and strides that
   nn.Linear gives them (output in the input's dtype, contiguous; each gradient in its
   parameter's dtype; a leaf's gradient laid out like the leaf when the leaf is dense).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from parity.cases import Case, Layout

aten = torch.ops.aten
_SCALED_MM_OPS = {aten._scaled_mm.default, aten._scaled_mm.out}
_ARG_NAMES = ("a", "b", "scale_a", "scale_b", "bias", "scale_result", "out_dtype", "use_fast_accum")
_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)


def _dtype_name(dtype) -> str | None:
    return None if dtype is None else str(dtype).replace("torch.", "")


@dataclass(frozen=True)
class ScaledMMCall:
    """One recorded torch._scaled_mm call: what cuBLASLt would be asked to do."""

    phase: str  # "forward" or "backward"
    gemm: str  # "output", "grad_input", "grad_weight", or "grad_input|grad_weight" when shapes cannot tell
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

    def describe(self) -> str:
        def operand(name, shape, stride, dtype):
            return f"{name} {dtype} {'x'.join(map(str, shape))} strides {tuple(stride)}"
        return (f"{self.gemm} GEMM: {operand('A', self.a_shape, self.a_stride, self.a_dtype)}, "
                f"{operand('B', self.b_shape, self.b_stride, self.b_dtype)}, "
                f"scales {list(self.scale_a[0])}/{list(self.scale_b[0])}, out_dtype={self.out_dtype}, "
                f"use_fast_accum={self.use_fast_accum}")


def _guess_gemm(phase: str, a_shape: tuple, b_shape: tuple, M: int, K: int, N: int) -> str:
    if phase == "forward":
        return "output"
    candidates = []
    if a_shape == (M, N) and b_shape == (N, K):
        candidates.append("grad_input")
    if a_shape == (N, M) and b_shape == (M, K):
        candidates.append("grad_weight")
    return "|".join(candidates) or "unknown"


class ScaledMMRecorder(TorchDispatchMode):
    """Records every aten._scaled_mm call made while active.

    Calls with tensor-subclass arguments return NotImplemented so the subclass handles
    them first; the plain-tensor _scaled_mm it then issues comes back through this mode.
    """

    def __init__(self, M: int, K: int, N: int):
        super().__init__()
        self.M, self.K, self.N = M, K, N
        self.phase = "forward"
        self.calls: list[ScaledMMCall] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(t not in _PLAIN_TYPES for t in types):
            return NotImplemented
        if func in _SCALED_MM_OPS:
            self.calls.append(self._record(args, kwargs))
        return func(*args, **kwargs)

    def _record(self, args, kwargs) -> ScaledMMCall:
        bound = dict(zip(_ARG_NAMES, args))
        bound.update({("a" if k == "self" else "b" if k == "mat2" else k): v for k, v in kwargs.items()})
        a, b = bound["a"], bound["b"]
        bias = bound.get("bias")
        scale = lambda s: (tuple(s.shape), _dtype_name(s.dtype))  # noqa: E731
        return ScaledMMCall(
            phase=self.phase, gemm=_guess_gemm(self.phase, tuple(a.shape), tuple(b.shape), self.M, self.K, self.N),
            a_shape=tuple(a.shape), a_stride=tuple(a.stride()), a_dtype=_dtype_name(a.dtype), a_align=a.data_ptr() % 16,
            b_shape=tuple(b.shape), b_stride=tuple(b.stride()), b_dtype=_dtype_name(b.dtype), b_align=b.data_ptr() % 16,
            scale_a=scale(bound["scale_a"]), scale_b=scale(bound["scale_b"]),
            bias_dtype=None if bias is None else _dtype_name(bias.dtype),
            out_dtype=_dtype_name(bound.get("out_dtype")), use_fast_accum=bool(bound.get("use_fast_accum", False)),
        )


def sm90_violations(call: ScaledMMCall) -> list[str]:
    """What goes wrong with this call on an H100/H200 ("would fail on H100: ..."); empty if
    nothing. Each rule was seen raising on an H200 (torch 2.11, `python .ci/probe_scaled_mm.py`)
    except the scale rules, which follow ScaledBlas.cpp."""
    fail = "would fail on H100: "
    if len(call.a_shape) != 2 or len(call.b_shape) != 2:
        return [f"{fail}_scaled_mm takes 2-D operands, got A {call.a_shape} and B {call.b_shape}"]
    problems = []
    (M, K), (Kb, N) = call.a_shape, call.b_shape
    if K != Kb:
        problems.append(f"{fail}A [{M}x{K}] and B [{Kb}x{N}] cannot be multiplied")
    if not (call.a_stride[1] == 1 and call.a_stride[0] >= max(1, K)):
        problems.append(f"{fail}A [{M}x{K}] has strides {call.a_stride}: SM90 cuBLASLt needs A row-major "
                        f"(stride(1) == 1); pass a.contiguous()")
    elif call.a_stride[0] % 16:
        problems.append(f"{fail}A's row stride {call.a_stride[0]} is not a multiple of 16 bytes (cuBLASLt: "
                        f"CUBLAS_STATUS_NOT_SUPPORTED); pass a.contiguous()")
    if not (call.b_stride[0] == 1 and call.b_stride[1] >= max(1, Kb)):
        problems.append(f"{fail}B [{Kb}x{N}] has strides {call.b_stride}: SM90 cuBLASLt needs B column-major "
                        f"(stride(0) == 1); pass b.t().contiguous().t()")
    elif call.b_stride[1] % 16:
        problems.append(f"{fail}B's column stride {call.b_stride[1]} is not a multiple of 16 bytes (cuBLASLt: "
                        f"CUBLAS_STATUS_NOT_SUPPORTED); pass b.t().contiguous().t()")
    for name, value in (("K (A.size(1))", K), ("B.size(0)", Kb), ("N (B.size(1))", N)):
        if value % 16:
            problems.append(f"{fail}{name} = {value} is not divisible by 16")
    if call.a_dtype == call.b_dtype == "float8_e5m2":
        problems.append(f"{fail}both operands are float8_e5m2: cuBLASLt multiplies e5m2 only with e4m3")
    (sa_shape, sa_dtype), (sb_shape, sb_dtype) = call.scale_a, call.scale_b
    tensorwise = math.prod(sa_shape) == 1 and math.prod(sb_shape) == 1
    rowwise = sa_shape == (M, 1) and sb_shape == (1, N)
    if sa_dtype != "float32" or sb_dtype != "float32":
        problems.append(f"{fail}scales must be float32, got scale_a {sa_dtype} and scale_b {sb_dtype}")
    elif not (tensorwise or rowwise):
        problems.append(f"{fail}scale shapes {list(sa_shape)} and {list(sb_shape)} are neither tensorwise "
                        f"(1 element each) nor rowwise ([{M}, 1] and [1, {N}])")
    for name, align in (("A", call.a_align), ("B", call.b_align)):
        if align:
            problems.append(f"{fail}{name}'s data pointer is not 16-byte aligned (offset {align} bytes; cuBLASLt: "
                            f"CUBLAS_STATUS_NOT_SUPPORTED)")
    if call.bias_dtype is not None and call.out_dtype == "float32":
        problems.append(f"{fail}a bias with out_dtype=float32 is not supported")
    if call.out_dtype is None:
        problems.append(f"no out_dtype: the result is written in {call.a_dtype}, on any device (pass "
                        f"out_dtype=torch.bfloat16 or the input's dtype)")
    return problems


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


def expected_contract(case: Case) -> dict[str, TensorContract]:
    """What nn.Linear gives for this case (parity's tests check this against nn.Linear itself)."""
    in_dtype, w_dtype = case.torch_input_dtype, case.torch_weight_dtype
    contract = dict(
        output=TensorContract(in_dtype, case.output_shape, _contiguous_strides(case.output_shape)),
        grad_input=TensorContract(in_dtype, case.input_shape, _grad_strides(case.input_shape, case.input_layout)),
        grad_weight=TensorContract(w_dtype, (case.N, case.K), _grad_strides((case.N, case.K), case.weight_layout)),
    )
    if case.bias:
        contract["grad_bias"] = TensorContract(w_dtype, (case.N,), (1,))
    return contract


def contract_violations(tensor: torch.Tensor | TensorContract | None, expected: TensorContract,
                        name: str) -> list[str]:
    """How `tensor` (or its recorded dtype/shape/strides) differs from what nn.Linear gives."""
    if isinstance(tensor, torch.Tensor):
        tensor = TensorContract(tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()))
    if tensor is None:
        return [f"{name} is None (nn.Linear gives a {_dtype_name(expected.dtype)} tensor of shape "
                f"{list(expected.shape)})"]
    problems = []
    if tensor.dtype != expected.dtype:
        problems.append(f"{name} dtype is {_dtype_name(tensor.dtype)}, nn.Linear gives {_dtype_name(expected.dtype)}")
    if tuple(tensor.shape) != expected.shape:
        problems.append(f"{name} shape is {list(tensor.shape)}, nn.Linear gives {list(expected.shape)}")
    elif tensor.stride != expected.stride and math.prod(tensor.shape) > 1:
        problems.append(f"{name} strides are {tensor.stride}, nn.Linear gives {expected.stride}")
    return problems
