"""[planted bug: Scales are rounded to the nearest power of two instead of down, so rows whose scale rounds up saturate (every operand of every GEMM).]

Rowwise FP8 linear, function form: ``rowwise_fp8_mm(input_2d, weight)`` (no bias).

Recipe: torchao 0.18 "rowwise" (Float8LinearConfig.from_recipe_name("rowwise")).
All three operands are e4m3.  Per GEMM, each operand gets an axiswise power-of-two
scale, the amax reduced over that GEMM's contraction dimension:
    output      x (over K)    x  W (over K)    fast accumulation, scales given to _scaled_mm
    grad_input  g (over N)    x  W (over N)    unit scales, result * (1/sa)(1/sb) in bf16
    grad_weight g (over M)    x  x (over M)    unit scales, result * (1/sa)(1/sb) in bf16
A float32 or float16 caller gets a bf16 GEMM result converted back (torchao's workaround).
"""
import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
EPS = 1e-12


def quantize_axiswise(t, reduce_dim):
    amax = t.abs().amax(dim=reduce_dim, keepdim=True).to(torch.float64)
    scale = (FP8_MAX / amax.clamp(min=EPS)).to(torch.float32)
    scale = torch.exp2(torch.round(torch.log2(scale)))
    q = (t.to(torch.float32) * scale).clamp(min=-FP8_MAX, max=FP8_MAX).to(FP8)
    return q, scale


def _col_major(t):
    return t.t().contiguous().t()


def scaled_gemm(a, sa, b, sb, want, fast):
    inv_a, inv_b = sa.reciprocal(), sb.reciprocal()
    gemm_dtype = torch.bfloat16 if want in (torch.float16, torch.float32) else want
    if fast:
        r = torch._scaled_mm(a, b, scale_a=inv_a, scale_b=inv_b, out_dtype=gemm_dtype,
                             use_fast_accum=True)
    else:
        unit = inv_a.new_ones(())
        r = torch._scaled_mm(a, b, scale_a=unit, scale_b=unit, out_dtype=gemm_dtype,
                             use_fast_accum=False)
        r *= inv_a * inv_b
    return r.to(want)


class RowwiseFp8MM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        xq, xs = quantize_axiswise(x, 1)          # [M,1]
        wq, ws = quantize_axiswise(w, 1)          # [N,1]
        return scaled_gemm(xq.contiguous(), xs, _col_major(wq.t()), ws.t(), x.dtype, True)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        gq, gs = quantize_axiswise(g, 1)          # [M,1]
        wq, ws = quantize_axiswise(w, 0)          # [1,K]
        dx = scaled_gemm(gq.contiguous(), gs, _col_major(wq), ws, g.dtype, False)
        gq, gs = quantize_axiswise(g, 0)          # [1,N]
        xq, xs = quantize_axiswise(x, 0)          # [1,K]
        dw = scaled_gemm(gq.t().contiguous(), gs.t(), _col_major(xq), xs, g.dtype, False)
        return dx, dw


def rowwise_fp8_mm(input_2d, weight):
    return RowwiseFp8MM.apply(input_2d, weight)
