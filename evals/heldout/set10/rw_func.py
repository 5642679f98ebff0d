"""Rowwise FP8 linear (e4m3 everywhere, power-of-2 scales per row along each GEMM's K), function form."""
import torch

F8 = torch.float8_e4m3fn
F8_MAX = torch.finfo(F8).max


def rowwise_cast(t, dim):
    """Quantize t with one scale per slice along `dim` (amax over dim, keepdim)."""
    amax = torch.amax(torch.abs(t), dim=dim, keepdim=True).to(torch.float64)
    scale = (F8_MAX / torch.clamp(amax, min=1e-12)).to(torch.float32)
    scale = torch.exp2(torch.floor(torch.log2(scale)))
    q = (t.to(torch.float32) * scale).clamp(min=-F8_MAX, max=F8_MAX).to(F8)
    return q, scale


def rowwise_gemm(a, sa, b, sb, orig_dtype, fast):
    """a [M,K] with scale sa [M,1]; b [K,N] with scale sb [1,N]."""
    a = a.contiguous()
    b = b.t().contiguous().t()
    inv_a, inv_b = sa.reciprocal(), sb.reciprocal()
    out_dtype = torch.bfloat16 if orig_dtype in (torch.float16, torch.float32) else orig_dtype
    if fast:
        out = torch._scaled_mm(a, b, scale_a=inv_a, scale_b=inv_b, out_dtype=out_dtype,
                               use_fast_accum=True)
    else:
        one = inv_a.new_ones(())
        out = torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=out_dtype,
                               use_fast_accum=False)
        out = out * (inv_a * inv_b)
        out = out.to(out_dtype)
    return out.to(orig_dtype)


class _RowwiseLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        x2 = x.reshape(-1, x.shape[-1])
        xq, xs = rowwise_cast(x2, -1)          # [M,1]
        wq, ws = rowwise_cast(w, -1)           # [N,1]
        out = rowwise_gemm(xq, xs, wq.t(), ws.t(), x.dtype, True)
        return out.reshape(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx, go):
        x, w = ctx.saved_tensors
        go2 = go.reshape(-1, go.shape[-1])
        gq, gs = rowwise_cast(go2, -1)         # [M,1], along N
        wq, ws = rowwise_cast(w, 0)            # [1,K], along N
        grad_x = rowwise_gemm(gq, gs, wq, ws, go.dtype, False)
        x2 = x.reshape(-1, x.shape[-1])
        gq_m, gs_m = rowwise_cast(go2, 0)      # [1,N], along M
        xq_m, xs_m = rowwise_cast(x2, 0)       # [1,K], along M
        grad_w = rowwise_gemm(gq_m.t(), gs_m.t(), xq_m, xs_m, go.dtype, False)
        return grad_x.reshape(x.shape).to(x.dtype), grad_w.to(w.dtype)


def fp8_linear_rowwise(input, weight, bias=None):
    y = _RowwiseLinearFn.apply(input, weight)
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y
