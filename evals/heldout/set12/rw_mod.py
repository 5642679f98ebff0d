"""Rowwise FP8 linear, module form: RowwiseFloat8Linear.from_float(linear).

torchao 0.18 Float8Linear "rowwise" recipe, bit for bit: input, weight and
grad_output all e4m3; one scale per row of A and per column of B, taken along the
GEMM's inner dimension (axiswise amax, keepdim), rounded down to a power of 2;
each GEMM re-quantizes from the saved high-precision tensors. The output GEMM
passes the rowwise scales to torch._scaled_mm with fast accumulation; the two
backward GEMMs (no fast accumulation) run with unit scales and multiply the
scales in afterwards, as torchao does. torch._scaled_mm's rowwise kernels only
write bf16, so fp16/fp32 results go through bf16.
"""
import torch
from torch import nn

E4M3 = torch.float8_e4m3fn
EPS = 1e-12


def _axiswise_scale(hp, dim):
    amax = torch.amax(torch.abs(hp), dim=dim, keepdim=True).to(torch.float64)
    scale = (torch.finfo(E4M3).max / torch.clamp(amax, min=EPS)).to(torch.float32)
    return torch.exp2(torch.floor(torch.log2(scale)))


def _cast(hp, dim):
    """e4m3 cast with one power-of-2 scale per slice reduced over `dim`."""
    scale = _axiswise_scale(hp, dim)
    fp8_max = torch.finfo(E4M3).max
    data = (hp.to(torch.float32) * scale).clamp(min=-fp8_max, max=fp8_max).to(E4M3)
    return data, scale


def _rowwise_mm(a, a_scale, b, b_scale, out_dtype, fast_accum):
    """a [M,K] (scale [M,1]) @ b [K,N] (scale [1,N])."""
    if not (a.stride(1) == 1 and a.stride(0) > a.stride(1)):
        a = a.contiguous()
    if b.stride(1) == 1 and b.stride(0) > b.stride(1):
        b = b.t().contiguous().t()
    inv_a = a_scale.reciprocal()
    inv_b = b_scale.reciprocal()
    post = None
    if not fast_accum:
        post = inv_a * inv_b
        inv_a = inv_a.new_ones(())
        inv_b = inv_a.new_ones(())
    mm_dtype = torch.bfloat16 if out_dtype in (torch.float16, torch.float32) else out_dtype
    out = torch._scaled_mm(a, b, scale_a=inv_a, scale_b=inv_b, out_dtype=mm_dtype,
                           use_fast_accum=fast_accum)
    if post is not None:
        out *= post
    return out.to(out_dtype)


class _RowwiseLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        x2 = x.reshape(-1, x.shape[-1])
        x_fp8, x_scale = _cast(x2, -1)
        w_t = weight.t()
        w_fp8, w_scale = _cast(w_t, 0)
        out = _rowwise_mm(x_fp8, x_scale, w_fp8, w_scale, x.dtype, True)
        return out.reshape(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_output):
        x, weight = ctx.saved_tensors
        go = grad_output.reshape(-1, grad_output.shape[-1])
        # grad_input = grad_output @ weight: scales along N
        go_fp8, go_scale = _cast(go, -1)
        w_fp8, w_scale = _cast(weight, 0)
        grad_input = _rowwise_mm(go_fp8, go_scale, w_fp8, w_scale, go.dtype, False)
        grad_input = grad_input.reshape(*grad_output.shape[:-1], grad_input.shape[-1])
        # grad_weight = grad_output.T @ input: scales along M
        x2 = x.reshape(-1, x.shape[-1])
        go_fp8_m, go_scale_m = _cast(go, 0)
        x_fp8_m, x_scale_m = _cast(x2, 0)
        grad_weight = _rowwise_mm(go_fp8_m.t(), go_scale_m.t(), x_fp8_m, x_scale_m,
                                  go.dtype, False)
        return grad_input, grad_weight


class RowwiseFloat8Linear(nn.Linear):
    def forward(self, input):
        out = _RowwiseLinearFn.apply(input, self.weight)
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out

    @classmethod
    def from_float(cls, linear):
        with torch.device("meta"):
            mod = cls(linear.in_features, linear.out_features, bias=False)
        mod.weight = linear.weight
        mod.bias = linear.bias
        return mod
