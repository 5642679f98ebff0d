"""FP8 matmul for training: tensorwise dynamic scaling and the three GEMMs of a linear layer.

How FP8 training of a linear layer works
----------------------------------------
A linear layer does three matrix multiplications (GEMMs) per training step:

    forward      output      = input       @ weight.T      [M,K] x [K,N] -> [M,N]
    backward     grad_input  = grad_output @ weight        [M,N] x [N,K] -> [M,K]
                 grad_weight = grad_output.T @ input       [N,M] x [M,K] -> [N,K]

(M is the number of tokens, the product of the input's leading dims; K = in_features;
N = out_features.) FP8 training runs each GEMM with FP8 operands on the tensor cores,
about twice the bf16 rate, and keeps the result in high precision.

FP8 has very little range (e4m3fn: max 448, 3 mantissa bits; e5m2: max 57344, 2 mantissa
bits), so each operand is *scaled* into that range first. Tensorwise dynamic scaling uses
one scale per tensor, recomputed every call from the tensor itself:

    amax  = max |x|                              (exact: a max does not round)
    scale = fp8_max / max(amax, 1e-12)           (divided in float64, stored as float32)
    x_fp8 = saturate(x.float() * scale) -> fp8   (round to nearest even, clamp to +-fp8_max)

so the largest element lands exactly on fp8_max. The GEMM gets the *inverse* scales and
undoes them in high precision: `torch._scaled_mm(a_fp8, b_fp8, 1/scale_a, 1/scale_b)`.
input and weight use e4m3 (precision matters most); grad_output uses e5m2 (gradients
have a wide dynamic range). These are exactly torchao's "tensorwise" recipe numerics, so
this module is bitwise identical to torchao's Float8Linear in eager mode.

Why each operand has the layout it has
--------------------------------------
On Hopper (SM90) cuBLASLt runs FP8 GEMMs only as "TN": the first operand A must be
row-major and the second B column-major, both with dimensions divisible by 16. A
transpose of a row-major [R,C] tensor is a column-major [C,R] view for free, so:

  * output:      A = input_fp8 [M,K] (row-major, as it comes);
                 B = weight_fp8.T [K,N] (a free view of the row-major weight).
  * grad_input:  A = grad_output_fp8 [M,N] (row-major, as it comes);
                 B = weight_fp8 [N,K] must be column-major: one transposed copy (1 byte/elt).
  * grad_weight: A = grad_output_fp8.T [N,M] must be row-major: one transposed copy;
                 B = input_fp8 [M,K] must be column-major: one transposed copy.

The inner dimension of grad_weight is M, so M must also be divisible by 16. Inputs with
other strides (a transposed or sliced activation) are quantized in their own layout and
copied only when the GEMM needs a different one. The FP8 tensors, not the high-precision
ones, are saved for backward: half the activation memory of bf16 and no second cast.
"""

from __future__ import annotations

import math

import torch

# ROCm MI300 (gfx942) uses the "fnuz" FP8 variants (no negative zero, max 240 for e4m3);
# everything else uses the OCP formats. Chosen once, like torchao does.
_IS_MI300 = bool(
    torch.version.hip
    and torch.cuda.is_available()
    and "gfx942" in torch.cuda.get_device_properties(0).gcnArchName
)
E4M3 = torch.float8_e4m3fnuz if _IS_MI300 else torch.float8_e4m3fn  # input, weight
E5M2 = torch.float8_e5m2fnuz if _IS_MI300 else torch.float8_e5m2  # grad_output
# fp8 max per format: e4m3fn 448, e5m2 57344, e4m3fnuz 240, e5m2fnuz 57344.
FP8_MAX = {dt: torch.finfo(dt).max for dt in (torch.float8_e4m3fn, torch.float8_e5m2,
                                              torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)}
EPS = 1e-12  # amax floor: an all-zero tensor gets a finite scale and quantizes to zeros
HIGH_PRECISION_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
GEMM_ALIGNMENT = 16  # torch._scaled_mm / cuBLASLt: every GEMM dimension divisible by 16


def to_float8(x: torch.Tensor, fp8_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Tensorwise dynamic scaling of `x`: returns (x_fp8, inverse_scale), x ~ x_fp8 * inverse_scale.

    Two passes over x (torchao's eager path makes six): one reduction for amax, and one
    multiply that upcasts, scales and rounds to fp8 on store.
    """
    fp8_max = FP8_MAX[fp8_dtype]
    amax = torch.linalg.vector_norm(x, ord=math.inf)  # max |x| in one pass, no |x| temporary; exact
    # float64 division, then float32: the same bits in eager and compiled code (torchao does this).
    scale = (fp8_max / torch.clamp(amax.to(torch.float64), min=EPS)).to(torch.float32)
    # The scale as a 1-element (not 0-dim) tensor makes the product float32: bf16 * 0-dim fp32
    # would stay bf16 and round x * scale in bf16. No clamp is needed: |x| <= amax, so
    # |x * scale| <= fp8_max (1 + 2^-23), which rounds to fp8_max (inf and NaN input give NaN,
    # as with a clamp). Layout: x_fp8 has x's strides (dense x) or is contiguous.
    x_fp8 = torch.mul(x, scale.reshape(1), out=torch.empty_like(x, dtype=fp8_dtype))
    return x_fp8, scale.reciprocal()


def _row_major(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(1) == 1 and t.stride(0) >= max(1, t.size(1)) else t.contiguous()


def _col_major(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(0) == 1 and t.stride(1) >= max(1, t.size(0)) else t.t().contiguous().t()


@torch._dynamo.allow_in_graph  # torch.compile keeps this Function as one node in the graph
class _Float8Matmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_2d, weight, output_fast_accum: bool, grad_fast_accum: bool):
        input_fp8, input_inv_scale = to_float8(input_2d, E4M3)
        weight_fp8, weight_inv_scale = to_float8(weight, E4M3)

        # ---- GEMM 1: output = input @ weight.T ------------  [M,K] x [K,N] -> [M,N]
        # Fast accumulation (lower-precision partial sums on Hopper) only here, as torchao:
        # the forward output tolerates it; the gradients do not.
        output = torch._scaled_mm(
            _row_major(input_fp8), _col_major(weight_fp8.t()),
            scale_a=input_inv_scale, scale_b=weight_inv_scale,
            out_dtype=input_2d.dtype, use_fast_accum=output_fast_accum,
        )
        ctx.save_for_backward(input_fp8, weight_fp8, input_inv_scale, weight_inv_scale)
        ctx.weight_dtype = weight.dtype
        ctx.grad_fast_accum = grad_fast_accum
        return output

    @staticmethod
    def backward(ctx, grad_output):
        input_fp8, weight_fp8, input_inv_scale, weight_inv_scale = ctx.saved_tensors
        grad_output_fp8, grad_output_inv_scale = to_float8(grad_output, E5M2)
        grad_input = grad_weight = None

        if ctx.needs_input_grad[0]:
            # ---- GEMM 2: grad_input = grad_output @ weight ----  [M,N] x [N,K] -> [M,K]
            grad_input = torch._scaled_mm(
                _row_major(grad_output_fp8), _col_major(weight_fp8),
                scale_a=grad_output_inv_scale, scale_b=weight_inv_scale,
                out_dtype=grad_output.dtype, use_fast_accum=ctx.grad_fast_accum,
            )
        if ctx.needs_input_grad[1]:
            # ---- GEMM 3: grad_weight = grad_output.T @ input --  [N,M] x [M,K] -> [N,K]
            # Computed in grad_output's dtype, then cast to the weight's (as torchao does).
            grad_weight = torch._scaled_mm(
                _row_major(grad_output_fp8.t()), _col_major(input_fp8),
                scale_a=grad_output_inv_scale, scale_b=input_inv_scale,
                out_dtype=grad_output.dtype, use_fast_accum=ctx.grad_fast_accum,
            ).to(ctx.weight_dtype)
        return grad_input, grad_weight, None, None


def check_float8_operands(input_2d: torch.Tensor, weight: torch.Tensor, *, lead_shape=None) -> None:
    """Raise a clear error, before any kernel runs, for operands the FP8 GEMMs cannot take."""
    for name, t in (("input", input_2d), ("weight", weight)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"fp8_impl: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in HIGH_PRECISION_DTYPES:
            raise TypeError(
                f"fp8_impl: {name} dtype {t.dtype} is not supported; the tensorwise recipe takes "
                f"bfloat16, float16 or float32 (cast it with .to(torch.bfloat16))")
    if weight.dim() != 2:
        raise ValueError(f"fp8_impl: weight must be 2-D [out_features, in_features], got shape {tuple(weight.shape)}")
    if input_2d.dim() != 2:
        raise ValueError(
            f"fp8_impl: float8_matmul needs a 2-D input [M, K], got shape {tuple(input_2d.shape)}; "
            f"reshape N-D input with input.reshape(-1, K) or use fp8_impl.Float8Linear")
    (M, K), (N, K_weight) = input_2d.shape, weight.shape
    if K != K_weight:
        raise ValueError(f"fp8_impl: input has K={K} features but weight expects {K_weight} "
                         f"(weight shape {tuple(weight.shape)})")
    lead = f" (the product of the input's leading dims {tuple(lead_shape)})" if lead_shape is not None else ""
    for dim, value, role, fix in (
        ("M", M, f"tokens{lead}; the inner dim of grad_weight = grad_output.T @ input",
         "pad the batch or sequence to a multiple of 16"),
        ("K", K, "in_features; the inner dim of output = input @ weight.T", "pad in_features"),
        ("N", N, "out_features; the inner dim of grad_input = grad_output @ weight", "pad out_features"),
    ):
        if value % GEMM_ALIGNMENT:
            padded = -(-value // GEMM_ALIGNMENT) * GEMM_ALIGNMENT
            raise ValueError(
                f"fp8_impl: {dim} = {value} is not divisible by {GEMM_ALIGNMENT} ({dim} = {role}); "
                f"torch._scaled_mm needs every GEMM dimension divisible by {GEMM_ALIGNMENT}. Fix: {fix} "
                f"(to {padded}), or keep this layer in high precision with "
                f"convert_to_float8_training(model, module_filter_fn=...)")


def float8_matmul(input_2d: torch.Tensor, weight: torch.Tensor, *, config=None) -> torch.Tensor:
    """Differentiable FP8 drop-in for `input_2d @ weight.T` (tensorwise dynamic scaling).

    input_2d: [M, K] bf16/fp16/fp32; weight: [N, K] bf16/fp16/fp32. Returns [M, N] in
    input_2d's dtype; gradients come back in the dtypes of input_2d and weight.
    `config` is an fp8_impl.Float8LinearConfig (default: torchao's tensorwise settings).
    """
    check_float8_operands(input_2d, weight)
    output_fast_accum = True if config is None else config.output_fast_accum
    grad_fast_accum = False if config is None else config.grad_fast_accum
    return _Float8Matmul.apply(input_2d, weight, output_fast_accum, grad_fast_accum)
