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

aten = torch.ops.aten
_V1_OPS = {aten._scaled_mm.default, aten._scaled_mm.out}
_V2_OPS = {aten._scaled_mm_v2.default} if hasattr(aten, "_scaled_mm_v2") else set()  # torch >= 2.10
_V1_ARGS = ("a", "b", "scale_a", "scale_b", "bias", "scale_result", "out_dtype", "use_fast_accum")
_V2_ARGS = ("a", "b", "scale_a", "recipe_a", "swizzle_a", "scale_b", "recipe_b", "swizzle_b", "bias", "out_dtype",
            "contraction_dim", "use_fast_accum")
# torch.nn.functional.ScalingType values, as aten._scaled_mm_v2 receives them
V2_SCALINGS = {0: "TensorWise", 1: "RowWise", 2: "BlockWise1x16", 3: "BlockWise1x32", 4: "BlockWise1x128",
               5: "BlockWise128x128"}
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


@dataclass(frozen=True)
class ScaledMMCall:
    """One recorded scaled GEMM call: what cuBLASLt would be asked to do."""

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
    op: str = "_scaled_mm"  # or "scaled_mm_v2" (torch.nn.functional.scaled_mm)
    # (A's, B's) scaling kind, named as torch.nn.functional.ScalingType: TensorWise, RowWise,
    # BlockWise1x128, BlockWise128x128, or "?" (scale shapes _scaled_mm does not recognize)
    scaling: tuple = ()
    scale_strides: tuple = ((), ())
    step: int = 0
    data: CallData | None = field(default=None, compare=False, repr=False)
    raised: bool = False  # the kernel rejected the call: no result came of it
    error: str = field(default="", compare=False)  # what it raised (first line), to tell the crash it caused

    def describe(self) -> str:
        def operand(name, shape, stride, dtype):
            return f"{name} {dtype} {'x'.join(map(str, shape))} strides {tuple(stride)}"
        kinds = f"{self.scaling[0]}/{self.scaling[1]} " if self.scaling else ""
        return (f"{self.gemm} GEMM: {operand('A', self.a_shape, self.a_stride, self.a_dtype)}, "
                f"{operand('B', self.b_shape, self.b_stride, self.b_dtype)}, "
                f"{kinds}scales {list(self.scale_a[0])}/{list(self.scale_b[0])}, out_dtype={self.out_dtype}, "
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


def _v1_scaling(a_shape, scale_a: torch.Tensor, b_shape, scale_b: torch.Tensor) -> tuple[str, str]:
    """The scaling kinds torch._scaled_mm infers from the scale shapes (SM90: tensorwise or rowwise)."""
    if scale_a.numel() == 1 and scale_b.numel() == 1:
        return "TensorWise", "TensorWise"
    if len(a_shape) == 2 and len(b_shape) == 2 and tuple(scale_a.shape) == (a_shape[0], 1) \
            and tuple(scale_b.shape) == (1, b_shape[1]):
        return "RowWise", "RowWise"
    return "?", "?"


def custom_op_kernel(func, args):
    """The Python function behind a torch.library.custom_op `func` for the device of its first
    tensor argument, or None (an aten op, or an op without one). A custom op is opaque to a
    dispatch mode: the mode sees the op, not the _scaled_mm calls its kernel makes. A mode that
    runs this function itself, with the mode active again, sees them (and no recursion: the
    function is the op's body, not the op)."""
    if func.namespace in ("aten", "prim", "prims"):
        return None
    try:
        from torch._library.custom_ops import _maybe_get_opdef
        opdef = _maybe_get_opdef(func)
    except (ImportError, AttributeError, TypeError, ValueError):  # another torch: the op stays opaque
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

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(t not in _PLAIN_TYPES for t in types):
            return NotImplemented
        if func in _V1_OPS or func in _V2_OPS:
            self.calls.append(self._record(func in _V2_OPS, args, kwargs))
            index = len(self.calls) - 1
            try:
                return func(*args, **kwargs)
            except BaseException as err:
                self.calls[index] = replace(self.calls[index], raised=True,
                                            error=(str(err).strip().splitlines() or [""])[0][:300])
                raise
        kernel = custom_op_kernel(func, args)
        if kernel is not None:  # a torch.library custom op: its body runs here, its calls come through this mode
            with self:
                return kernel(*args, **kwargs)
        return func(*args, **kwargs)

    def _record(self, v2: bool, args, kwargs) -> ScaledMMCall:
        names = _V2_ARGS if v2 else _V1_ARGS
        bound = dict(zip(names, args))
        bound.update({("a" if k == "self" else "b" if k == "mat2" else k): v for k, v in kwargs.items()})
        a, b = bound["a"], bound["b"]
        if v2:
            scale_a, scale_b = bound["scale_a"][0], bound["scale_b"][0]
            scaling = tuple(V2_SCALINGS.get(int(r[0]) if r else -1, "?") for r in (bound["recipe_a"],
                                                                                   bound["recipe_b"]))
        else:
            scale_a, scale_b = bound["scale_a"], bound["scale_b"]
            scaling = _v1_scaling(tuple(a.shape), scale_a, tuple(b.shape), scale_b)
        bias = bound.get("bias")
        scale = lambda s: (tuple(s.shape), _dtype_name(s.dtype))  # noqa: E731
        data = CallData(a.detach().clone(), b.detach().clone(), scale_a.detach().clone(),
                        scale_b.detach().clone()) if self.keep_data else None
        return ScaledMMCall(
            phase=self.phase, gemm=_guess_gemm(self.phase, tuple(a.shape), tuple(b.shape), self.M, self.K, self.N),
            a_shape=tuple(a.shape), a_stride=tuple(a.stride()), a_dtype=_dtype_name(a.dtype), a_align=a.data_ptr() % 16,
            b_shape=tuple(b.shape), b_stride=tuple(b.stride()), b_dtype=_dtype_name(b.dtype), b_align=b.data_ptr() % 16,
            scale_a=scale(scale_a), scale_b=scale(scale_b),
            bias_dtype=None if bias is None else _dtype_name(bias.dtype),
            out_dtype=_dtype_name(bound.get("out_dtype")), use_fast_accum=bool(bound.get("use_fast_accum", False)),
            op="scaled_mm_v2" if v2 else "_scaled_mm", scaling=scaling,
            scale_strides=(tuple(scale_a.stride()), tuple(scale_b.stride())), step=self.step, data=data,
        )


def _strided_as(shape: tuple, stride: tuple, want: tuple) -> bool:
    """Strides equal to `want` wherever the dimension has more than one element."""
    return all(size <= 1 or got == expected for size, got, expected in zip(shape, stride, want))


def _scale_violations(call: ScaledMMCall, M: int, K: int, N: int) -> list[str]:
    """The scale rules of the call's scaling kinds (see the module docstring)."""
    fail = "would fail on H100: "
    (sa_shape, sa_dtype), (sb_shape, sb_dtype) = call.scale_a, call.scale_b
    (sa_stride, sb_stride), kinds = call.scale_strides or ((), ()), call.scaling or ("?", "?")
    if sa_dtype != "float32" or sb_dtype != "float32":
        return [f"{fail}scales must be float32, got scale_a {sa_dtype} and scale_b {sb_dtype}"]
    if kinds == ("TensorWise", "TensorWise"):
        return []
    if kinds == ("RowWise", "RowWise"):
        problems = []
        if tuple(sa_shape) != (M, 1) or tuple(sb_shape) != (1, N):
            problems.append(f"{fail}rowwise scales must be [{M}, 1] and [1, {N}], got {list(sa_shape)} and "
                            f"{list(sb_shape)}")
        elif sa_stride and not (_strided_as(sa_shape, sa_stride, (1, 1)) and _strided_as(sb_shape, sb_stride, (N, 1))):
            problems.append(f"{fail}rowwise scales must be contiguous, got strides {sa_stride} and {sb_stride}")
        return problems
    blocks = ("BlockWise1x128", "BlockWise128x128")
    if kinds[0] == "BlockWise1x128" and kinds[1] in blocks:
        problems = []
        if "float8_e5m2" in (call.a_dtype, call.b_dtype):
            problems.append(f"{fail}block scaling takes e4m3 operands only, got {call.a_dtype} x {call.b_dtype}")
        k_blocks = -(-K // 128)
        if tuple(sa_shape) != (M, k_blocks):
            problems.append(f"{fail}1x128 scales of A [{M}x{K}] must be [{M}, {k_blocks}], got {list(sa_shape)}")
        elif sa_stride and not _strided_as(sa_shape, sa_stride, (1, M)):
            problems.append(f"{fail}1x128 scales of A must be stored M-major (strides (1, {M})), got {sa_stride}; "
                            f"pass scale.t().contiguous().t()")
        if kinds[1] == "BlockWise128x128":
            padded = -(-k_blocks // 4) * 4
            if tuple(sb_shape) != (padded, -(-N // 128)):
                problems.append(f"{fail}128x128 scales of B [{K}x{N}] must be [{padded}, {-(-N // 128)}] (K/128 padded "
                                f"to a multiple of 4), got {list(sb_shape)}")
            elif sb_stride and not _strided_as(sb_shape, sb_stride, (1, padded)):
                problems.append(f"{fail}128x128 scales of B must be stored K-major (strides (1, {padded})), got "
                                f"{sb_stride}")
            if call.use_fast_accum:
                problems.append(f"{fail}fast accumulation is not supported with 128x128 block scales")
        elif tuple(sb_shape) != (N, k_blocks):
            problems.append(f"{fail}1x128 scales of B [{K}x{N}] must be [{N}, {k_blocks}], got {list(sb_shape)}")
        elif sb_stride and not _strided_as(sb_shape, sb_stride, (1, N)):
            problems.append(f"{fail}1x128 scales of B must be stored N-major (strides (1, {N})), got {sb_stride}")
        return problems
    return [f"{fail}scale shapes {list(sa_shape)} and {list(sb_shape)} ({kinds[0]}/{kinds[1]}) are none of "
            f"tensorwise (1 element each), rowwise ([{M}, 1] and [1, {N}]) or 1x128/128x128 blocks"]


def sm90_violations(call: ScaledMMCall) -> list[str]:
    """What goes wrong with this call on an H100/H200 ("would fail on H100: ..."); empty if
    nothing. Each rule was seen raising on an H200 (torch 2.11, `python .ci/probe_scaled_mm.py`)."""
    return _sm90_messages(call)


# What each SM90 rule is about: (a fragment of its message, the operand: a | b | call, the bug class)
_RULE_KINDS = (
    ("takes 2-D operands", "a", "crash"), ("cannot be multiplied", "call", "crash"),
    ("is not divisible by 16", "call", "crash"), ("both operands are float8_e5m2", "call", "fp8_dtype"),
    ("block scaling takes e4m3", "call", "fp8_dtype"), ("fast accumulation is not supported", "call", "accumulation"),
    ("scales of A", "a", "scale"), ("scales of B", "b", "scale"), ("rowwise scales", "call", "scale"),
    ("scales must be float32", "call", "scale"), ("are none of tensorwise", "call", "scale"),
    ("A's data pointer", "a", "layout"), ("B's data pointer", "b", "layout"), ("A [", "a", "layout"),
    ("A's row stride", "a", "layout"), ("B [", "b", "layout"), ("B's column stride", "b", "layout"),
    ("a bias with out_dtype", "call", "contract"), ("no out_dtype", "call", "contract"),
)


def sm90_problems(call: ScaledMMCall) -> list[tuple[str, str, str]]:
    """sm90_violations with what each rule is about: (operand "a" | "b" | "call", bug class, message)."""
    out = []
    for message in _sm90_messages(call):
        text = message.removeprefix("would fail on H100: ")
        role, category = next(((r, c) for fragment, r, c in _RULE_KINDS if fragment in text), ("call", "layout"))
        out.append((role, category, message))
    return out


def _sm90_messages(call: ScaledMMCall) -> list[str]:
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
    problems += _scale_violations(call, M, K, N)
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
