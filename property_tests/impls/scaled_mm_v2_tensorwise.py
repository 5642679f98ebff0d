"""A correct tensorwise FP8 linear written with torch.nn.functional.scaled_mm (aten._scaled_mm_v2), as a user
might write it: torchao's numerics (e4m3 input and weight, e5m2 grad_output, one scale per tensor, the
output GEMM with fast accumulation). It must be bitwise equal to torchao:tensorwise on every device."""

import torch
import torch.nn.functional as F

TENSORWISE = F.ScalingType.TensorWise


def _cast(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(x in fp8, the inverse scale): scale = fp8_max / amax, the quotient in float64 rounded once to fp32."""
    fp8_max = torch.finfo(dtype).max
    amax = x.abs().max().to(torch.float64)
    scale = (fp8_max / torch.clamp(amax, min=1e-12)).to(torch.float32)
    return (x.to(torch.float32) * scale).clamp(-fp8_max, fp8_max).to(dtype), scale.reciprocal()


def _mm(a, scale_a, b, scale_b, out_dtype, fast):
    return F.scaled_mm(a, b, scale_a, TENSORWISE, scale_b, TENSORWISE, output_dtype=out_dtype, use_fast_accum=fast)


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_2d, weight):
        x, x_inv = _cast(input_2d, torch.float8_e4m3fn)
        w, w_inv = _cast(weight, torch.float8_e4m3fn)
        ctx.save_for_backward(x, x_inv, w, w_inv)
        ctx.weight_dtype = weight.dtype
        return _mm(x.contiguous(), x_inv, w.contiguous().t(), w_inv, input_2d.dtype, True)  # [M, K] @ [K, N]

    @staticmethod
    def backward(ctx, grad_output):
        x, x_inv, w, w_inv = ctx.saved_tensors
        g, g_inv = _cast(grad_output, torch.float8_e5m2)
        # [M, N] @ [N, K], then [N, M] @ [M, K]: A row-major, B column-major, as cuBLASLt takes them
        grad_input = _mm(g.contiguous(), g_inv, w.t().contiguous().t(), w_inv, grad_output.dtype, False)
        grad_weight = _mm(g.t().contiguous(), g_inv, x.t().contiguous().t(), x_inv, grad_output.dtype, False)
        return grad_input, grad_weight.to(ctx.weight_dtype)


def matmul(input_2d: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return _Linear.apply(input_2d, weight)
