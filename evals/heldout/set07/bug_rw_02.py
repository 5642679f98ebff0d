"""Rowwise FP8 linear as a function, driven by a frozen dataclass recipe."""
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Fp8Format:
    dtype: torch.dtype
    max: float


E4M3 = Fp8Format(torch.float8_e4m3fn, 448.0)
E5M2 = Fp8Format(torch.float8_e5m2, 57344.0)


@dataclass(frozen=True)
class RowwiseRecipe:
    input: Fp8Format = E4M3
    weight: Fp8Format = E4M3
    grad_output: Fp8Format = E4M3
    grad_output_for_grad_weight: Fp8Format = E5M2
    pow2_scales: bool = True
    eps: float = 1e-12
    fast_accum_output: bool = True


RECIPE = RowwiseRecipe()


def _quantize(t, fmt: Fp8Format, dim: int, recipe: RowwiseRecipe = RECIPE):
    """Scale along `dim` (keepdim). Returns (fp8 data with t's layout, fp32 scale)."""
    amax = torch.amax(torch.abs(t), dim=dim, keepdim=True).to(torch.float64)
    scale = (fmt.max / torch.clamp(amax, min=recipe.eps)).to(torch.float32)
    if recipe.pow2_scales:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    data = (t.to(torch.float32) * scale).clamp(min=-fmt.max, max=fmt.max).to(fmt.dtype)
    return data, scale


def _rowwise_mm(a, a_scale, b, b_scale, out_dtype, fast_accum):
    """a [m,k] with a_scale [m,1]; b [k,n] with b_scale [1,n]."""
    if a.stride(-1) != 1:
        a = a.contiguous()
    if b.stride(0) != 1:
        b = b.t().contiguous().t()
    a_inv = a_scale.reciprocal()
    b_inv = b_scale.reciprocal()
    mm_dtype = torch.bfloat16 if out_dtype in (torch.float16, torch.float32) else out_dtype
    if fast_accum:
        out = torch._scaled_mm(
            a, b, scale_a=a_inv, scale_b=b_inv, out_dtype=mm_dtype, use_fast_accum=True
        )
    else:
        one = a_inv.new_ones(())
        out = torch._scaled_mm(
            a, b, scale_a=one, scale_b=one, out_dtype=mm_dtype, use_fast_accum=False
        )
        out *= a_inv * b_inv
    return out.to(out_dtype)


class _RowwiseLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        R = RECIPE
        x2 = x.reshape(-1, x.shape[-1])
        xq, xs = _quantize(x2, R.input, dim=-1)
        wq, ws = _quantize(w, R.weight, dim=-1)
        out = _rowwise_mm(xq, xs, wq.t(), ws.t(), x.dtype, R.fast_accum_output)
        ctx.save_for_backward(x, w)
        return out.reshape(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx, grad_output):
        R = RECIPE
        x, w = ctx.saved_tensors
        go2 = grad_output.reshape(-1, grad_output.shape[-1])
        x2 = x.reshape(-1, x.shape[-1])

        goq, gos = _quantize(go2, R.grad_output, dim=-1)
        wq, ws = _quantize(w, R.weight, dim=0)
        grad_input = _rowwise_mm(goq, gos, wq, ws, grad_output.dtype, False)
        grad_input = grad_input.reshape(x.shape)

        goq_w, gos_w = _quantize(go2, R.grad_output_for_grad_weight, dim=0)
        xq_w, xs_w = _quantize(x2, R.input, dim=0)
        grad_weight = _rowwise_mm(goq_w.t(), gos_w.t(), xq_w, xs_w, grad_output.dtype, False)
        return grad_input, grad_weight


def fp8_rowwise_linear(input, weight, bias=None):
    out = _RowwiseLinear.apply(input, weight)
    if bias is not None:
        out = out + bias.to(out.dtype)
    return out
