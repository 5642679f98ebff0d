"""A fast CPU kernel for torch._scaled_mm, used while the harness runs implementations on a CPU.

No CPU has FP8 arithmetic: torch's CPU _scaled_mm is itself an emulation, and in torch 2.13 a
slow one (measured on a 2-core machine: 64x1280x1280 took 3.4 s, an fp32 matmul of the same
shape 1.9 ms). While active, FastScaledMM computes tensorwise and rowwise _scaled_mm calls on
the CPU as the same emulation done with the fast kernels: the fp8 operands converted to fp32
(exact), one fp32 matmul (products of two fp8 values are exact in fp32; the sum is an fp32
accumulation, like torch's kernel and within parity.oracles' bound), the inverse scales
multiplied into the result, then the bias, then the cast to out_dtype. With unit scales this
is bitwise torch's own CPU result (measured); with other scales torch's kernel rounds the
scaling in another order, so the last fp32 bit can differ. The operands are multiplied in one
layout (A row-major, B column-major, the GPU contract's), whatever strides they came with: the
same values give the same bits, as on a GPU, where any other layout is rejected.

The harness runs every implementation of a case under the same kernel, so two implementations
that make the same calls stay bitwise equal, and the accumulation bound holds as before. Calls
it does not handle (block scales, scale_result, a non-fp8 operand, CUDA tensors) go to torch
unchanged. Set FP8_PARITY_CPU_SCALED_MM=torch to use torch's kernel throughout.

FP8_PARITY_CPU_REJECT=sm90-layout makes the fast kernel reject what SM90's cuBLASLt rejects for its layout (an
A that is not row-major, a B that is not column-major), raising as the GPU does: a CPU run then crashes where
an H100 or H200 crashes, which is how the tests exercise bisect's handling of a call the GPU rejected without a
GPU (workers inherit it: parity.worker.INHERITED_ENVIRON).
"""

from __future__ import annotations

import os

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from parity import hopper, mx, oracles  # mmaemu itself is imported on the first modelled call
from parity.contract import V2_SCALINGS, custom_op_kernel, v1_mx_kind
from parity.names import CPU_GEMM_MODES

aten = torch.ops.aten
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)
_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)
# the schema names of aten._scaled_mm's and aten._scaled_mm_v2's arguments (self -> a, mat2 -> b)
_V1_NAMES = ("a", "b", "scale_a", "scale_b", "bias", "scale_result", "out_dtype", "use_fast_accum")
_V2_NAMES = ("a", "b", "scale_a", "recipe_a", "swizzle_a", "scale_b", "recipe_b", "swizzle_b", "bias", "out_dtype",
             "contraction_dim", "use_fast_accum")


MODES = CPU_GEMM_MODES  # fast, hopper, torch (in parity.names: the parser lists them)
ENV = "FP8_PARITY_CPU_SCALED_MM"
REJECT_ENV = "FP8_PARITY_CPU_REJECT"  # "sm90-layout": reject as SM90 does (see the module docstring)


def mode() -> str:
    """The CPU kernel of scaled GEMM calls: fast (the default), hopper (the H200's bits, parity.hopper) or torch."""
    value = os.environ.get(ENV, "fast")
    return value if value in MODES else "fast"


def enabled() -> bool:
    return mode() != "torch"


def kernel() -> TorchDispatchMode:
    """The dispatch mode that computes CPU scaled GEMM calls in this process's mode (enabled() must hold)."""
    return HopperScaledMM() if mode() == "hopper" else FastScaledMM()


def _fast(a, b, scale_a, scale_b, bias=None, scale_result=None, out_dtype=None, use_fast_accum=False):
    """The emulation, or None when the call is not one it handles."""
    if (a.device.type != "cpu" or a.dtype not in _FP8 or b.dtype not in _FP8 or scale_result is not None
            or a.dim() != 2 or b.dim() != 2 or scale_a.dtype != torch.float32 or scale_b.dtype != torch.float32):
        return None
    M, N = a.shape[0], b.shape[1]
    tensorwise = scale_a.numel() == 1 and scale_b.numel() == 1
    rowwise = tuple(scale_a.shape) == (M, 1) and tuple(scale_b.shape) == (1, N)
    if not (tensorwise or rowwise) or a.shape[1] != b.shape[0]:
        return None
    if rowwise and (scale_a.stride(1) != 1 or scale_b.stride(1) != 1):
        return None  # torch's kernel rejects these scales ("expected scale_a.stride(1) to be 1"): let it say so
    if os.environ.get(REJECT_ENV) == "sm90-layout" and (a.stride(1) != 1 or b.stride(0) != 1):
        raise RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED: only multiplication of row-major and column-major matrices "
                           f"is supported (SM90's layout rule, {REJECT_ENV}=sm90-layout on a CPU)")
    # In the GPU contract's layout whatever strides the call came with: the CPU matmul's summation
    # order follows the operands' memory layout, so two implementations passing the same values with
    # other (valid) strides would differ in the last bit on a CPU and not on a GPU.
    out = a.to(torch.float32).contiguous() @ b.to(torch.float32).t().contiguous().t()
    out = out * (scale_a.reshape(()) * scale_b.reshape(())) if tensorwise else out * scale_a * scale_b
    if bias is not None:
        out = out + bias.to(torch.float32)
    return out.to(out_dtype or a.dtype)


def _bound(names: tuple[str, ...], args, kwargs) -> dict:
    """An aten scaled-mm call's arguments by schema name (self -> a, mat2 -> b)."""
    bound = dict(zip(names, args))
    bound.update({("a" if k == "self" else "b" if k == "mat2" else k): v for k, v in kwargs.items()})
    return bound


def _fast_v2(call: dict) -> torch.Tensor | None:
    """An aten._scaled_mm_v2 call with one TensorWise or RowWise scale per operand, as _fast computes the
    _scaled_mm call it stands for; None for the others (block scales, swizzles, a contraction dim)."""
    recipes = (tuple(call.get("recipe_a", ())), tuple(call.get("recipe_b", ())))
    plain = all(len(r) == 1 and V2_SCALINGS.get(r[0]) in ("TensorWise", "RowWise") for r in recipes)
    swizzled = any(any(call.get(name) or ()) for name in ("swizzle_a", "swizzle_b"))
    if not plain or swizzled or call.get("contraction_dim") or len(call["scale_a"]) != 1 or len(call["scale_b"]) != 1:
        return None
    return _fast(call["a"], call["b"], call["scale_a"][0], call["scale_b"][0], bias=call.get("bias"),
                 out_dtype=call.get("out_dtype"), use_fast_accum=call.get("use_fast_accum", False))


# ---- microscaled calls (MXFP8, NVFP4): SM100's GEMMs, served on a CPU ----------------------------------
# torch 2.13 refuses block-scaled calls on a CPU ("CPU does not support swizzle"), so an implementation
# written for SM100 could not run here. While the harness runs code on a CPU, its torch.nn.functional.
# scaled_mm calls with BlockWise1x32 (e8m0) or [BlockWise1x16 (e4m3), TensorWise] scales are computed
# here instead: the operands decoded (fp4 unpacked), the scales read in the layout the call declares
# (swizzled, or [rows, K / block] as they are), and the exact emulation of parity.oracles.gemm (each
# block's products summed exactly in float64, times its two scales, the blocks summed in float64), the
# bias added, then one rounding to the output dtype: the MX-SPEC.md emulated GEMM. A call whose scales
# do not fit its shapes raises a ValueError as torch's check does on SM100; the rest of what SM100 would
# refuse (NO_SWIZZLE, strides) runs here and parity.contract's SM100 rules report it.

MX_SCALINGS = {("BlockWise1x32",): ("e4m3", 32), ("BlockWise1x16", "TensorWise"): ("e2m1", 16)}


def _mx_kind(call: dict) -> tuple[str, int] | None:
    """(element format, block) of a microscaled _scaled_mm_v2 call, or None for another call."""
    kinds = [tuple(V2_SCALINGS.get(int(r)) for r in call.get(name, ())) for name in ("recipe_a", "recipe_b")]
    return MX_SCALINGS.get(kinds[0]) if kinds[0] == kinds[1] else None


def _mx_operand(values: torch.Tensor, scales: list, swizzle, block: int, role: str) -> oracles.Quantized:
    """One operand of a microscaled call as parity.oracles.Quantized, laid out [rows, inner] (B as B.T)."""
    packed = values.t() if role == "b" else values
    decoded = mx.unpack_e2m1(packed) if packed.dtype == torch.float4_e2m1fn_x2 else packed.to(torch.float64)
    rows, inner = decoded.shape
    if inner % block:
        raise ValueError(f"scaled_mm: the inner dim {inner} of a {block}-element block-scaled operand is not a "
                         f"whole number of blocks")
    swizzled = bool(swizzle) and int(swizzle[0]) != 0
    grid = (mx.unswizzled(scales[0], rows, inner // block) if swizzled else scales[0].reshape(rows, inner // block))
    per_block = (mx.e8m0_values(grid) if grid.dtype == torch.float8_e8m0fnu else grid.to(torch.float64))
    if len(scales) > 1:  # NVFP4's per-tensor scale: the decode scale of every block is s * global
        per_block = per_block * scales[1].to(torch.float64).reshape(())
    fmt = torch.float4_e2m1fn_x2 if packed.dtype == torch.float4_e2m1fn_x2 else packed.dtype
    return oracles.Quantized(decoded, per_block, (1, block), fmt)


def _as_v2(call: dict) -> dict:
    """A torch._scaled_mm call with microscaled scales as the _scaled_mm_v2 call it stands for (swizzled scales)."""
    kind = {"BlockWise1x32": 3, "BlockWise1x16": 2}[v1_mx_kind(call["scale_a"], call["scale_b"])]
    return {**call, "scale_a": [call["scale_a"]], "scale_b": [call["scale_b"]], "recipe_a": [kind], "recipe_b": [kind],
            "swizzle_a": [1], "swizzle_b": [1]}


def mx_scaled_mm(call: dict) -> torch.Tensor:
    """A microscaled aten._scaled_mm_v2 call (its arguments by schema name), computed exactly (see above)."""
    _, block = _mx_kind(call)
    try:
        a = _mx_operand(call["a"], call["scale_a"], call.get("swizzle_a"), block, "a")
        b = _mx_operand(call["b"], call["scale_b"], call.get("swizzle_b"), block, "b")
    except (ValueError, RuntimeError) as err:
        raise ValueError(f"scaled_mm (served on the CPU by parity.cpu_gemm, as SM100 would): {err}") from None
    if a.values.shape[1] != b.values.shape[1]:
        raise ValueError(f"scaled_mm: mat_a and mat_b shapes cannot be multiplied ({list(call['a'].shape)} and "
                         f"{list(call['b'].shape)})")
    value = oracles.gemm(a, b)
    if call.get("bias") is not None:
        value = value + call["bias"].to(torch.float64)
    out_dtype = call.get("out_dtype") or torch.bfloat16
    return value.to(out_dtype)


class FastScaledMM(TorchDispatchMode):
    """While active, CPU tensorwise and rowwise aten._scaled_mm calls run as an fp32 matmul, and microscaled
    _scaled_mm_v2 calls (MXFP8, NVFP4) run as their exact emulation (mx_scaled_mm)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(t not in _PLAIN_TYPES for t in types):
            return NotImplemented
        if func is aten._scaled_mm.default:
            call = _bound(_V1_NAMES, args, kwargs)
            if call["a"].device.type == "cpu" and v1_mx_kind(call["scale_a"], call["scale_b"]) is not None:
                return mx_scaled_mm(_as_v2(call))
            out = _fast(**call)
            if out is not None:
                return out
        if hasattr(aten, "_scaled_mm_v2") and func is aten._scaled_mm_v2.default:
            # torch.nn.functional.scaled_mm: the same kernel as _scaled_mm for the calls it handles, so that an
            # implementation written with either API computes the same bits as its reference
            call = _bound(_V2_NAMES, args, kwargs)
            if call["a"].device.type == "cpu" and _mx_kind(call) is not None:
                return mx_scaled_mm(call)
            out = _fast_v2(call)
            if out is not None:
                return out
        kernel = custom_op_kernel(func, args)
        if kernel is not None:  # a torch.library custom op: the _scaled_mm calls in its body run here too
            with self:
                return kernel(*args, **kwargs)
        return func(*args, **kwargs)


# ---- the H200's bits on a CPU ----------------------------------------------------------------------------
# FP8_PARITY_CPU_SCALED_MM=hopper (`--cpu-gemm hopper`): every CPU _scaled_mm and _scaled_mm_v2 call, of the
# candidate and of every reference alike, is computed by parity.hopper's model of the H200, so a CPU run
# shows in the numbers what only a GPU's numbers showed: fast accumulation, the tensor cores' truncated
# partial sums, an accumulation order. Calls the model does not cover (scale_result, a non-fp8 operand,
# other scalings) raise: a run in this mode is the model's or says that it is not.

class HopperModelNotApplicable(RuntimeError):
    """A scaled GEMM call that --cpu-gemm hopper cannot compute as the H200 does."""


MODELLED_SCALINGS = ("TensorWise", "RowWise", "BlockWise1x128", "BlockWise128x128")  # of contract.V2_SCALINGS


def _hopper_v1(a, b, scale_a, scale_b, bias=None, scale_result=None, out_dtype=None, use_fast_accum=False):
    out_dtype = out_dtype or a.dtype
    if scale_result is not None:
        raise HopperModelNotApplicable("--cpu-gemm hopper: a _scaled_mm call with scale_result is not modelled")
    M, N = a.shape[0], b.shape[1]
    wide = torch.float32 if bias is not None else out_dtype  # a bias joins the fp32 result, then one rounding
    if scale_a.numel() == 1 and scale_b.numel() == 1:
        value = hopper.tensorwise(a, b.t(), scale_a, scale_b, out_dtype=wide, fast_accum=use_fast_accum).value
    elif scale_a.numel() == M and scale_b.numel() == N:
        value = hopper.rowwise(a, b.t(), scale_a, scale_b, out_dtype=wide, fast_accum=use_fast_accum).value
    else:
        raise HopperModelNotApplicable(f"--cpu-gemm hopper: scales {list(scale_a.shape)} x {list(scale_b.shape)} "
                                       f"of a {M}x{a.shape[1]}x{N} _scaled_mm are neither tensorwise nor rowwise")
    return value if bias is None else (value + bias.float()).to(out_dtype)


def _hopper_v2(call: dict) -> torch.Tensor:
    """An aten._scaled_mm_v2 call (its arguments by schema name) through the model."""
    a, b, scale_a, scale_b = call["a"], call["b"], call["scale_a"], call["scale_b"]
    recipe_a, recipe_b = call["recipe_a"], call["recipe_b"]
    bias, out_dtype, fast = call.get("bias"), call.get("out_dtype"), call.get("use_fast_accum", False)
    kinds = (V2_SCALINGS.get(recipe_a[0]), V2_SCALINGS.get(recipe_b[0]))
    if len(scale_a) != 1 or len(scale_b) != 1 or not set(kinds) <= set(MODELLED_SCALINGS) \
            or call.get("contraction_dim"):
        raise HopperModelNotApplicable(f"--cpu-gemm hopper: a scaled_mm_v2 call with scalings {recipe_a} x {recipe_b} "
                                       "is not modelled")
    if kinds[0] != "BlockWise1x128":
        return _hopper_v1(a, b, scale_a[0], scale_b[0], bias=bias, out_dtype=out_dtype, use_fast_accum=fast)
    if bias is not None:
        raise HopperModelNotApplicable("--cpu-gemm hopper: a block-scaled call with a bias is not modelled")
    blocks = a.shape[1] // 128
    tiles = "128x128" if kinds[1] == "BlockWise128x128" else "1x128"
    b_scale = scale_b[0][:blocks].t() if tiles == "128x128" else scale_b[0]  # cuBLASLt pads K/128 to 4 there
    return hopper.blockwise(a, b.t(), scale_a[0], b_scale, out_dtype=out_dtype or torch.bfloat16, b_tiles=tiles,
                            fast_accum=fast).value


class HopperScaledMM(TorchDispatchMode):
    """While active, CPU aten._scaled_mm and aten._scaled_mm_v2 calls are computed as the H200 computes them."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(t not in _PLAIN_TYPES for t in types):
            return NotImplemented
        v2 = hasattr(aten, "_scaled_mm_v2") and func is aten._scaled_mm_v2.default
        if v2 and args[0].device.type == "cpu" and _mx_kind(_bound(_V2_NAMES, args, kwargs)) is not None:
            return mx_scaled_mm(_bound(_V2_NAMES, args, kwargs))  # SM100's GEMMs: no Hopper model, the emulation
        if func is aten._scaled_mm.default and args[0].device.type == "cpu":
            call = _bound(_V1_NAMES, args, kwargs)
            if v1_mx_kind(call["scale_a"], call["scale_b"]) is not None:
                return mx_scaled_mm(_as_v2(call))
        if (func is aten._scaled_mm.default or v2) and args[0].device.type == "cpu" and args[0].dtype in _FP8:
            bound = _bound(_V2_NAMES if v2 else _V1_NAMES, args, kwargs)
            return _hopper_v2(bound) if v2 else _hopper_v1(**bound)
        kernel = custom_op_kernel(func, args)
        if kernel is not None:
            with self:
                return kernel(*args, **kwargs)
        return func(*args, **kwargs)

