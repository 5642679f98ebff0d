"""[planted bug: fp32 results are written directly by _scaled_mm instead of through torchao's bf16 output, so fp32 models get differently rounded results.]

Copy of rw_fn.py with one small change. Original docstring:

Rowwise FP8 linear, function form: rowwise_linear(input, weight, bias=None).

Same recipe as torchao 0.18 Float8Linear "rowwise" (bitwise): e4m3 everywhere,
axiswise scales along each GEMM's inner dimension, scales rounded down to powers
of 2, re-quantization from high precision for every GEMM. Output GEMM: rowwise
scales inside torch._scaled_mm, fast accumulation. grad_input / grad_weight: unit
scales in the GEMM, row and column scales applied to the bf16 result afterwards.
"""
import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
EPS = 1e-12


def quantize_along(t, dim):
    """Cast t to e4m3 with one power-of-2 scale per slice reduced over `dim`."""
    amax = torch.amax(torch.abs(t), dim=dim, keepdim=True)
    scale = FP8_MAX / torch.clamp(amax.to(torch.float64), min=EPS)
    scale = scale.to(torch.float32)
    scale = torch.exp2(torch.floor(torch.log2(scale)))
    q = torch.clamp(t.to(torch.float32) * scale, min=-FP8_MAX, max=FP8_MAX).to(FP8)
    return q, scale


def _as_lhs(t):
    return t if (t.stride(1) == 1 and t.stride(0) > 1) else t.contiguous()


def _as_rhs(t):
    return t.t().contiguous().t() if (t.stride(1) == 1 and t.stride(0) > 1) else t


def mm_rowwise(a, sa, b, sb, out_dtype, fast_accum):
    a, b = _as_lhs(a), _as_rhs(b)
    hp = torch.bfloat16 if out_dtype == torch.float16 else out_dtype
    if fast_accum:
        y = torch._scaled_mm(a, b, scale_a=sa.reciprocal(), scale_b=sb.reciprocal(),
                             out_dtype=hp, use_fast_accum=True)
    else:
        one = sa.new_ones(())
        y = torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=hp,
                             use_fast_accum=False)
        y *= sa.reciprocal() * sb.reciprocal()
    return y.to(out_dtype)


class RowwiseMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        K = x.shape[-1]
        xq, xs = quantize_along(x.reshape(-1, K), -1)
        wq, ws = quantize_along(w.t(), 0)
        y = mm_rowwise(xq, xs, wq, ws, x.dtype, True)
        return y.reshape(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        K, N = x.shape[-1], dy.shape[-1]
        dy2 = dy.reshape(-1, N)
        x2 = x.reshape(-1, K)
        dyq, dys = quantize_along(dy2, -1)
        wq, ws = quantize_along(w, 0)
        dx = mm_rowwise(dyq, dys, wq, ws, dy.dtype, False)
        dyq_t, dys_t = quantize_along(dy2, 0)
        xq_t, xs_t = quantize_along(x2, 0)
        dw = mm_rowwise(dyq_t.t(), dys_t.t(), xq_t, xs_t, dy.dtype, False)
        return dx.reshape(*dy.shape[:-1], K), dw


def rowwise_linear(input, weight, bias=None):
    out = RowwiseMM.apply(input, weight)
    if bias is not None:
        out = out + bias.to(out.dtype)
    return out
