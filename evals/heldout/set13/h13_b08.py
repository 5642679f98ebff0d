"""[planted bug: amax is taken from a bf16-rounded copy, so fp32 tensors get a scale from a rounded amax (also shows with an fp32 weight).]

Tensorwise FP8 linear, function form: ``fp8_linear(input, weight, bias=None)``.

Recipe (torchao 0.18 "tensorwise", Float8LinearConfig() defaults):
  output      = e4m3(input)      @ e4m3(weight).T   one fp32 scale per tensor, fast accumulation
  grad_input  = e5m2(grad_out)   @ e4m3(weight)     no fast accumulation
  grad_weight = e5m2(grad_out).T @ e4m3(input)      no fast accumulation
scale = fp8_max / max(amax, 1e-12) computed in float64 then rounded to float32;
_scaled_mm receives 1/scale.  Every GEMM writes the dtype of its left operand's
high-precision tensor (input dtype for output, grad_output dtype for the grads).
"""
import torch

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
AMAX_FLOOR = 1e-12


def _scale(t, fp8):
    amax = t.to(torch.bfloat16).abs().max().to(torch.float64)
    return (torch.finfo(fp8).max / torch.clamp(amax, min=AMAX_FLOOR)).to(torch.float32)


def _cast(t, fp8):
    s = _scale(t, fp8)
    top = torch.finfo(fp8).max
    return (t.to(torch.float32) * s).clamp(min=-top, max=top).to(fp8), s


def _mm(a, sa, b, sb, dtype, fast):
    # a: row-major [m, k]; b: column-major [k, n]
    return torch._scaled_mm(
        a, b, scale_a=sa.reciprocal(), scale_b=sb.reciprocal(),
        out_dtype=dtype, use_fast_accum=fast,
    )


class _TensorwiseLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        x8, sx = _cast(x, E4M3)
        w8, sw = _cast(w, E4M3)
        return _mm(x8.contiguous(), sx, w8.contiguous().t(), sw, x.dtype, True)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        g8, sg = _cast(g, E5M2)
        w8, sw = _cast(w, E4M3)
        grad_x = _mm(g8.contiguous(), sg, w8.t().contiguous().t(), sw, g.dtype, False)
        x8, sx = _cast(x, E4M3)
        grad_w = _mm(g8.t().contiguous(), sg, x8.t().contiguous().t(), sx, g.dtype, False)
        return grad_x, grad_w


def fp8_linear(input, weight, bias=None):
    out = _TensorwiseLinear.apply(input, weight)
    if bias is not None:
        out = out + bias.to(out.dtype)
    return out
