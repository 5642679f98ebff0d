"""FP8 matmul for training: dynamic scaling and the three GEMMs of a linear layer.

How FP8 training of a linear layer works
----------------------------------------
A linear layer does three matrix multiplications (GEMMs) per training step (M tokens, the product of the
input's leading dims; K = in_features; N = out_features):

    forward      output      = input       @ weight.T      [M,K] x [K,N] -> [M,N]
    backward     grad_input  = grad_output @ weight        [M,N] x [N,K] -> [M,K]
                 grad_weight = grad_output.T @ input       [N,M] x [M,K] -> [N,K]

Each runs with FP8 operands on the tensor cores (about twice the bf16 rate) and keeps its result in high
precision. FP8 has little range (e4m3fn: max 448, 3 mantissa bits; e5m2: max 57344, 2 bits), so each operand
is first scaled into it from its own amax ("dynamic" scaling), the largest element of each group to fp8_max:

    scale = fp8_max / max(amax, 1e-12)   (amax = max |x| over the group: exact; divided in float64, stored
                                          as float32; the floor quantizes an all-zero group to zeros)
    x_fp8 = saturate(x.float() * scale) -> fp8         (round to nearest even, clamp to +-max)

The GEMM takes the *inverse* scales and undoes them in high precision: `torch._scaled_mm(a_fp8, b_fp8,
1/scale_a, 1/scale_b)`. Finer scales run along the GEMM's inner (contraction) dim: a scale constant over a
dot product, or over one block of it, factors out of that sum and is applied once per partial sum.

The recipes (config.py): how many elements share a scale
---------------------------------------------------------
tensorwise: one scale per tensor; input and weight in e4m3 (precision matters most), grad_output in e5m2
    (gradients span a wide range, all under one scale); fast accumulation in the forward GEMM only. The cast
    is the same for every GEMM, so the FP8 tensors are saved for backward (half bf16's activation memory).
rowwise: one scale per row of A and per column of B, so a large row no longer crushes the others, and each
    scale covers a range narrow enough for e4m3 gradients (one more mantissa bit). Scales are rounded *down*
    to a power of two: scaling by 2^k is exact, and rounding down keeps each amax within fp8_max (< 1 bit of
    range lost). The inner dim differs per GEMM (K, N, then M), so each GEMM re-quantizes the saved
    high-precision tensors.
rowwise_with_gw_hp: rowwise for output; grad_input with a tensorwise weight; grad_weight in high precision
    (the GEMM that sums over all tokens is the most sensitive).
blockwise: DeepSeek-V3's, e4m3 everywhere: a scale per 1x128 tile along the inner dim for activations and
    gradients (grad_weight re-tiles them along M), per 128x128 block for weights (a block serves as W.T in
    output and as W in grad_input), so an outlier spoils only its own tile; the GEMM scales each block's
    partial sum and adds them in fp32. cuBLASLt takes tile scales [rows, K/128] column-major, block scales
    [K/128, N/128] K-major, every dim (M too) a multiple of 128. SM90 runs it, a CPU emulates it.
mxfp8: Blackwell's microscaling (OCP MX), e4m3: a scale per 32 elements along every GEMM's inner dim, a power
    of two stored as an E8M0 byte (e + 127; 0xFF is NaN, the scale of a block holding a NaN or Inf). 2^e is
    the smallest power of two >= amax / 448 (RCEIL, cuBLAS's cast: nothing saturates); mxfp8_floor takes OCP
    MX v1.0's 2^(floor(log2 amax) - 8), which may saturate. SM100's GEMM takes the scales "swizzled" into
    128x4 tiles; elsewhere (a CPU, a GPU before SM100) the operands are decoded exactly and multiplied in fp32.

Why each operand has the layout it has
--------------------------------------
On Hopper (SM90) cuBLASLt runs FP8 GEMMs only as "TN": A row-major, B column-major, every dim and stride
divisible by 16. A row-major [R,C] tensor's transpose is a column-major [C,R] view for free, so each operand
is quantized "inner dim last" (A as [rows, inner], B as B.T = [cols, inner]) and B handed over transposed;
inputs with other strides (a transposed or sliced activation) are copied only where the GEMM needs it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from fp8_impl.config import E4M3, E5M2, CastConfig, Float8LinearConfig, GemmConfig, Scaling

FP8_MAX = {dt: torch.finfo(dt).max for dt in (torch.float8_e4m3fn, torch.float8_e5m2,
                                              torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)}
EPS = 1e-12  # amax floor: an all-zero tensor (row, tile) gets a finite scale and quantizes to zeros
HIGH_PRECISION_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
BLOCK = 128


def amax_to_scale(amax: torch.Tensor, fp8_dtype: torch.dtype, *, pow2: bool = False) -> torch.Tensor:
    # float64 division, then float32: the same bits in eager and compiled code (torchao does this).
    scale = (FP8_MAX[fp8_dtype] / torch.clamp(amax.to(torch.float64), min=EPS)).to(torch.float32)
    return torch.exp2(torch.floor(torch.log2(scale))) if pow2 else scale


def to_float8(x: torch.Tensor, fp8_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Tensorwise dynamic scaling of `x`: returns (x_fp8, inverse_scale), x ~ x_fp8 * inverse_scale. Two passes
    over x (torchao's eager path makes six): an amax reduction, and a multiply that upcasts, scales and rounds."""
    amax = torch.linalg.vector_norm(x, ord=math.inf)  # max |x| in one pass, no |x| temporary; exact
    scale = amax_to_scale(amax, fp8_dtype)
    # The scale as a 1-element (not 0-dim) tensor makes the product float32: bf16 * 0-dim fp32
    # would stay bf16 and round x * scale in bf16. No clamp is needed: |x| <= amax, so
    # |x * scale| <= fp8_max (1 + 2^-23), which rounds to fp8_max (inf and NaN input give NaN,
    # as with a clamp). Layout: x_fp8 has x's strides (dense x) or is contiguous.
    x_fp8 = torch.mul(x, scale.reshape(1), out=torch.empty_like(x, dtype=fp8_dtype))
    return x_fp8, scale.reciprocal()


def quantize(x: torch.Tensor, cast: CastConfig, *, pow2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale `x` [rows, inner] (an operand, inner dim last) to fp8 at the cast's granularity: (x_fp8 row-major,
    inverse scales [rows/r, inner/i] for r x i tiles: [1, 1] tensorwise, [rows, 1] axiswise, [rows, inner/128]
    1x128, [rows/128, inner/128] 128x128)."""
    rows, inner = x.shape
    r, i = {Scaling.TENSORWISE: (rows, inner), Scaling.AXISWISE: (1, inner),
            Scaling.BLOCK_1X128: (1, BLOCK), Scaling.BLOCK_128X128: (BLOCK, BLOCK)}[cast.scaling]
    tiles = x.reshape(rows // r, r, inner // i, i)
    scale = amax_to_scale(tiles.abs().amax(dim=(1, 3)), cast.fp8_dtype, pow2=pow2)
    fp8_max = FP8_MAX[cast.fp8_dtype]
    x_fp8 = (tiles.float() * scale[:, None, :, None]).clamp(-fp8_max, fp8_max).to(cast.fp8_dtype)
    return x_fp8.reshape(rows, inner), scale.reciprocal()


def _row_major(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(1) == 1 and t.stride(0) >= max(1, t.size(1)) else t.contiguous()


def _col_major(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(0) == 1 and t.stride(1) >= max(1, t.size(0)) else t.t().contiguous().t()


def _blocks_emulated(a, scale_a, b, scale_b, out_dtype):
    """A block-scaled GEMM where no kernel has one (a CPU): exact 128-long partial products
    (at most 8 significant bits each), each block scaled and summed in fp32. scale_b: [K/128, N]."""
    (M, K), N = a.shape, b.shape[1]
    partial = torch.bmm(a.float().reshape(M, K // BLOCK, BLOCK).transpose(0, 1),
                        b.float().reshape(K // BLOCK, BLOCK, N))  # [K/128, M, N]
    return (partial * scale_a.t()[:, :, None] * scale_b[:, None, :]).sum(0).to(out_dtype)


def to_mxfp8(x: torch.Tensor, rule: str = "rceil") -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, inner] -> (e4m3 [rows, inner] row-major, E8M0 scales [rows, inner/32]): one power-of-two
    scale per 32 elements (see the docstring's mxfp8); the exponent read exactly from frexp."""
    rows, inner = x.shape
    blocks = x.float().reshape(rows, inner // 32, 32)
    amax = blocks.abs().amax(-1)
    ratio = amax / 448.0 if rule == "rceil" else amax  # RCEIL's quotient in float32
    mantissa, exponent = torch.frexp(ratio)  # ratio = mantissa * 2^exponent, 0.5 <= mantissa < 1
    e = exponent - (mantissa == 0.5).int() if rule == "rceil" else exponent - 9  # ceil / floor(log2) - 8
    e = torch.where(ratio > 0, e, -127).clamp(-127, 127).float()
    e = torch.where(amax.isfinite(), e, float("nan"))  # NaN or Inf in a block: its scale is NaN
    x_fp8 = (blocks * torch.exp2(-e)[..., None]).clamp(-448.0, 448.0).to(E4M3)
    e8m0 = torch.where(e.isnan(), 255.0, e + 127).to(torch.uint8).view(torch.float8_e8m0fnu)  # the byte e + 127
    return x_fp8.reshape(rows, inner).contiguous(), e8m0


def _swizzled(scales: torch.Tensor) -> torch.Tensor:
    """Scales [rows, n] as SM100 takes them: zero-padded to 128x4 tiles, the tile's (r, c) at byte
    (r % 32) * 16 + (r // 32) * 4 + c, tiles row by row (cuBLAS's block scaling factor layout)."""
    padded = F.pad(scales.view(torch.uint8), (0, -scales.shape[1] % 4, 0, -scales.shape[0] % 128))
    tiles = padded.reshape(-1, 4, 32, padded.shape[1] // 4, 4).permute(0, 3, 2, 1, 4)
    return tiles.reshape(-1).view(torch.float8_e8m0fnu)


def _mx_gemm(a, scale_a, b, scale_b, out_dtype):
    """An MXFP8 GEMM: SM100's kernel through F.scaled_mm where torch has one; elsewhere the emulated GEMM
    (decoded operands, exact in fp32, multiplied in fp32, rounded once). scale_b: [C, I/32]."""
    if not a.is_cuda or torch.cuda.get_device_capability(a.device) >= (10, 0):
        try:  # a CPU's torch refuses it ("CPU does not support swizzle"), unless a harness serves the call
            return F.scaled_mm(a, b, _swizzled(scale_a), F.ScalingType.BlockWise1x32, _swizzled(scale_b),
                               F.ScalingType.BlockWise1x32, swizzle_a=F.SwizzleType.SWIZZLE_32_4_4,
                               swizzle_b=F.SwizzleType.SWIZZLE_32_4_4, output_dtype=out_dtype)
        except ValueError:
            if a.is_cuda:  # SM100 refused it: the error is the caller's to see
                raise

    def decoded(x, scale):  # [R, I] row-major with [R, I/32] scales
        return (x.float().reshape(x.shape[0], -1, 32) * scale.float()[..., None]).reshape(x.shape)
    return (decoded(a, scale_a) @ decoded(b.t(), scale_b).t()).to(out_dtype)


def _gemm(a, scale_a, b, scale_b, gemm: GemmConfig, out_dtype: torch.dtype) -> torch.Tensor:
    """a @ b from fp8 operands (a row-major [R, I], b column-major [I, C]) and inverse scales
    (scale_b of 1x128 tiles is [C, I/128], as cuBLASLt takes it; of MX blocks [C, I/32])."""
    kinds = {gemm.a.scaling, gemm.b.scaling}
    if kinds == {Scaling.MX_1X32}:
        return _mx_gemm(a, scale_a, b, scale_b, out_dtype)
    if kinds == {Scaling.TENSORWISE}:
        return torch._scaled_mm(a, b, scale_a=scale_a.reshape(()), scale_b=scale_b.reshape(()),
                                out_dtype=out_dtype, use_fast_accum=gemm.fast_accum)
    if Scaling.AXISWISE in kinds:  # a tensorwise partner becomes a row (column) of equal scales
        # torchao writes bf16 (so does the CUTLASS rowwise kernel torch uses below cuBLAS 12.9): cast afterwards
        scale_a, scale_b = scale_a.expand(a.shape[0], 1), scale_b.expand(1, b.shape[1])
        if gemm.fast_accum:
            return torch._scaled_mm(a, b, scale_a=scale_a.contiguous(), scale_b=scale_b.contiguous(),
                                    out_dtype=torch.bfloat16, use_fast_accum=True).to(out_dtype)
        # torchao: the rowwise kernel is slow without fast accumulation, so the tensorwise kernel
        # runs with unit scales and the (power-of-two) scales are multiplied in afterwards.
        one = scale_a.new_ones(())
        output = torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16, use_fast_accum=False)
        return output.mul_(scale_a * scale_b).to(out_dtype)  # scaled in bf16, as torchao does
    tiles_b = gemm.b.scaling is Scaling.BLOCK_1X128
    if a.device.type != "cuda":
        per_k = scale_b.t() if tiles_b else scale_b.repeat_interleave(BLOCK, dim=1)
        return _blocks_emulated(a, scale_a, b, per_k, torch.bfloat16).to(out_dtype)
    if not tiles_b and scale_b.shape[0] % 4:  # cuBLASLt: K/128 padded to a multiple of 4 (16-byte columns)
        scale_b = F.pad(scale_b.t(), (0, -scale_b.shape[0] % 4), value=1.0).t()  # padded with ones, column-major
    recipe_b = F.ScalingType.BlockWise1x128 if tiles_b else F.ScalingType.BlockWise128x128
    return F.scaled_mm(a, b, scale_a, F.ScalingType.BlockWise1x128, scale_b, recipe_b,
                       output_dtype=torch.bfloat16).to(out_dtype)  # bf16, as torchao's blockwise writes


def _cast_for_gemm(x: torch.Tensor, cast: CastConfig, pow2: bool, rule: str = "rceil"):
    """(x_fp8, inverse scales in _scaled_mm's layout) of an operand [rows, inner]."""
    if cast.scaling is Scaling.TENSORWISE and not pow2:
        return to_float8(x, cast.fp8_dtype)
    if cast.scaling is Scaling.MX_1X32:
        return to_mxfp8(x, rule)
    x_fp8, inverse = quantize(x, cast, pow2=pow2)
    if cast.scaling is Scaling.BLOCK_1X128:  # [rows, inner/128] stored column-major
        inverse = inverse.t().contiguous().t()
    return x_fp8, inverse


def _cast_once(x: torch.Tensor, first: CastConfig, second: CastConfig, config: Float8LinearConfig):
    """x's cast, made once, where two GEMMs take the same tensorwise cast (it does not depend on the GEMM); else x."""
    shared = first == second and first.scaling is Scaling.TENSORWISE
    return _cast_for_gemm(x, first, config.round_scales_to_power_of_2) if shared else x


def _t(operand):
    """The transpose of an operand: a high-precision tensor, or a kept tensorwise cast (whose one scale stays)."""
    return (operand[0].t(), operand[1]) if isinstance(operand, tuple) else operand.t()


def _run_gemm(a, b_t, gemm: GemmConfig, config: Float8LinearConfig, out_dtype):
    """One GEMM a @ b from A [R, I] and B.T [C, I], each high precision or an (x_fp8, inverse scale) cast."""
    if gemm.a.scaling is Scaling.DISABLED:
        return a @ b_t.t()
    pow2, rule = config.round_scales_to_power_of_2, config.mx_rule
    a_fp8, scale_a = a if isinstance(a, tuple) else _cast_for_gemm(a, gemm.a, pow2, rule)
    bt_fp8, scale_bt = b_t if isinstance(b_t, tuple) else _cast_for_gemm(b_t, gemm.b, pow2, rule)
    scale_b = scale_bt if gemm.b.scaling in (Scaling.BLOCK_1X128, Scaling.MX_1X32) else scale_bt.t()
    return _gemm(_row_major(a_fp8), scale_a, _col_major(bt_fp8.t()), scale_b, gemm, out_dtype)


@torch._dynamo.allow_in_graph  # torch.compile keeps this Function as one node in the graph
class _Float8Matmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_2d, weight, config: Float8LinearConfig):
        # A cast made once is saved for backward in place of the high-precision tensor (half bf16's memory).
        input_op = _cast_once(input_2d, config.output.a, config.grad_weight.b, config)
        weight_op = _cast_once(weight, config.output.b, config.grad_input.b, config)

        # ---- GEMM 1: output = input @ weight.T ------------  [M,K] x [K,N] -> [M,N]
        output = _run_gemm(input_op, weight_op, config.output, config, input_2d.dtype)
        ctx.kept = [isinstance(op, tuple) for op in (input_op, weight_op)]
        ctx.save_for_backward(*[t for op in (input_op, weight_op) for t in (op if isinstance(op, tuple) else (op,))])
        ctx.config, ctx.weight_dtype = config, weight.dtype
        return output

    @staticmethod
    def backward(ctx, grad_output):
        config, saved, n_input = ctx.config, ctx.saved_tensors, 1 + ctx.kept[0]
        input_op = saved[:n_input] if ctx.kept[0] else saved[0]
        weight_op = saved[n_input:] if ctx.kept[1] else saved[n_input]
        go_op = _cast_once(grad_output, config.grad_input.a, config.grad_weight.a, config)
        grad_input = grad_weight = None
        if ctx.needs_input_grad[0]:
            # ---- GEMM 2: grad_input = grad_output @ weight ----  [M,N] x [N,K] -> [M,K]
            grad_input = _run_gemm(go_op, _t(weight_op), config.grad_input, config, grad_output.dtype)
        if ctx.needs_input_grad[1]:
            # ---- GEMM 3: grad_weight = grad_output.T @ input --  [N,M] x [M,K] -> [N,K]
            # Computed in grad_output's dtype, then cast to the weight's (as torchao does).
            grad_weight = _run_gemm(_t(go_op), _t(input_op), config.grad_weight, config, grad_output.dtype)
            grad_weight = grad_weight.to(ctx.weight_dtype)
        return grad_input, grad_weight, None


def check_float8_operands(input_2d: torch.Tensor, weight: torch.Tensor, *, lead_shape=None,
                          config: Float8LinearConfig | None = None) -> None:
    """Raise a clear error, before any kernel runs, for operands the FP8 GEMMs cannot take."""
    config = config or Float8LinearConfig()
    for name, t in (("input", input_2d), ("weight", weight)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"fp8_impl: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in HIGH_PRECISION_DTYPES:
            raise TypeError(f"fp8_impl: {name} dtype {t.dtype} is not supported; the {config.recipe.value} recipe "
                            f"takes bfloat16, float16 or float32 (cast it with .to(torch.bfloat16))")
    if weight.dim() != 2:
        raise ValueError(f"fp8_impl: weight must be 2-D [out_features, in_features], got shape {tuple(weight.shape)}")
    if input_2d.dim() != 2:
        raise ValueError(f"fp8_impl: float8_matmul needs a 2-D input [M, K], got shape {tuple(input_2d.shape)}; "
                         f"reshape N-D input with input.reshape(-1, K) or use fp8_impl.Float8Linear")
    (M, K), (N, K_weight) = input_2d.shape, weight.shape
    if K != K_weight:
        raise ValueError(f"fp8_impl: input has K={K} features but weight expects {K_weight} "
                         f"(weight shape {tuple(weight.shape)})")
    lead = f" (the product of the input's leading dims {tuple(lead_shape)})" if lead_shape is not None else ""
    align = config.alignment
    why = {BLOCK: "block scales tile every GEMM dimension by 128", 32: "MX scales take whole blocks of 32 along "
           "every GEMM's inner dim"}.get(align, "torch._scaled_mm needs every GEMM dimension divisible by 16")
    for dim, value, role, fix in (
        ("M", M, f"tokens{lead}; the inner dim of grad_weight = grad_output.T @ input", "pad the batch or sequence"),
        ("K", K, "in_features; the inner dim of output = input @ weight.T", "pad in_features"),
        ("N", N, "out_features; the inner dim of grad_input = grad_output @ weight", "pad out_features")):
        if value % align:
            raise ValueError(
                f"fp8_impl: {dim} = {value} is not divisible by {align} ({dim} = {role}); the {config.recipe.value} "
                f"recipe needs it ({why}). Fix: {fix} to {-(-value // align) * align}, or keep this layer in "
                f"high precision with convert_to_float8_training(model, module_filter_fn=...)")


def float8_matmul(input_2d: torch.Tensor, weight: torch.Tensor, *, config=None) -> torch.Tensor:
    """Differentiable FP8 drop-in for `input_2d @ weight.T`: input_2d [M, K] and weight [N, K] bf16/fp16/fp32,
    the result [M, N] in input_2d's dtype, the gradients in the dtypes of input_2d and weight. `config` is a
    Float8LinearConfig (default: torchao's tensorwise recipe)."""
    config = config or Float8LinearConfig()
    check_float8_operands(input_2d, weight, config=config)
    return _Float8Matmul.apply(input_2d, weight, config)


__all__ = ["E4M3", "E5M2", "EPS", "FP8_MAX", "amax_to_scale", "check_float8_operands", "float8_matmul",
           "quantize", "to_float8", "to_mxfp8"]
