"""Rowwise FP8 linear, function form: ``rowwise_fp8_linear(input, weight, bias=None)``.

Same numerics as torchao 0.18's ``rowwise`` recipe, written as one autograd function:

    output      = x8[M,K] (scale per row of x, along K)   @ w8t[K,N] (scale per column, along K)
    grad_input  = g8[M,N] (scale per row, along N)          @ w8[N,K]  (scale per column, along N)
    grad_weight = g8t[N,M] (scale per row of g.T, along M)  @ x8[M,K]  (scale per column, along M)

All three operands are e4m3; scales are ``fp8_max / max(amax, 1e-12)`` in float64, rounded
to float32 and then down to a power of two.  The output GEMM passes the rowwise scales to
``_scaled_mm`` with fast accumulation; the two gradient GEMMs use slow accumulation through
the tensorwise kernel (unit scales) and rescale the result afterwards, as torchao does.
``_scaled_mm`` with rowwise scales only writes bf16, so the GEMM output dtype is mapped
through ``_MM_OUT_DTYPE`` and cast back.
"""
import torch

E4M3 = torch.float8_e4m3fn
EPS = 1e-12

# output dtype of the rowwise _scaled_mm for each activation dtype (cast back afterwards)
_MM_OUT_DTYPE = {
    torch.bfloat16: torch.bfloat16,
    torch.float16: torch.bfloat16,
    torch.float32: torch.bfloat16,
}


def _pow2_floor(s):
    return torch.exp2(torch.floor(torch.log2(s)))


@torch.no_grad()
def _quant_along(t, dim, fp8_dtype=E4M3, round_pow2=True):
    """Cast ``t`` to fp8 with one scale per slice reduced along ``dim``."""
    fmax = torch.finfo(fp8_dtype).max
    amax = torch.amax(torch.abs(t), dim=dim, keepdim=True).to(torch.float64)
    scale = (fmax / torch.clamp(amax, min=EPS)).to(torch.float32)
    if round_pow2:
        scale = _pow2_floor(scale)
    data = (t.to(torch.float32) * scale).clamp(min=-fmax, max=fmax).to(fp8_dtype)
    return data, scale


def _lhs(t):
    return t if (t.stride(0) > t.stride(1) and t.stride(1) == 1) else t.contiguous()


def _rhs(t):
    return t.t().contiguous().t() if (t.stride(0) > t.stride(1) and t.stride(1) == 1) else t


def _mm_rowwise_fast(a, sa, b, sb, out_dtype):
    out = torch._scaled_mm(_lhs(a), _rhs(b), scale_a=sa.reciprocal(), scale_b=sb.reciprocal(),
                           out_dtype=_MM_OUT_DTYPE[out_dtype], use_fast_accum=True)
    return out.to(out_dtype)


def _mm_rowwise_slow(a, sa, b, sb, out_dtype):
    inv_a = sa.reciprocal()
    post = inv_a * sb.reciprocal()
    one = inv_a.new_ones(())
    out = torch._scaled_mm(_lhs(a), _rhs(b), scale_a=one, scale_b=one,
                           out_dtype=_MM_OUT_DTYPE[out_dtype], use_fast_accum=False)
    out *= post
    return out.to(out_dtype)


class _RowwiseFP8Matmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        x2 = x.reshape(-1, x.shape[-1])
        xq, xs = _quant_along(x2, -1)
        wq, ws = _quant_along(w.t(), 0)
        y = _mm_rowwise_fast(xq, xs, wq, ws, x.dtype)
        return y.reshape(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1])
        x2 = x.reshape(-1, x.shape[-1])
        gq, gs = _quant_along(dy2, -1)
        wq, ws = _quant_along(w.t(), -1)
        dx = _mm_rowwise_slow(gq, gs, wq.t(), ws.t(), dy.dtype)
        gtq, gts = _quant_along(dy2, 0)
        xq, xs = _quant_along(x2, 0)
        dw = _mm_rowwise_slow(gtq.t(), gts.t(), xq, xs, dy.dtype)
        return dx.reshape(*dy.shape[:-1], x.shape[-1]), dw


def rowwise_fp8_linear(input, weight, bias=None):
    """``F.linear`` with torchao-style rowwise FP8 GEMMs."""
    out = _RowwiseFP8Matmul.apply(input, weight)
    if bias is not None:
        out = out + bias.to(out.dtype)
    return out
