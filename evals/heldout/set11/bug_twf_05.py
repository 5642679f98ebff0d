"""[planted bug: the weight is reinterpreted with reshape instead of transposed for the forward GEMM.] Tensorwise FP8 linear, function form: fp8_linear(input, weight, bias=None)."""
import torch

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2


def _scale(x, dtype):
    amax = x.abs().max().to(torch.float64)
    return (torch.finfo(dtype).max / torch.clamp(amax, min=1e-12)).to(torch.float32)


def _quant(x, scale, dtype):
    fmax = torch.finfo(dtype).max
    return (x.to(torch.float32) * scale).clamp(min=-fmax, max=fmax).to(dtype)


def _gemm(a, sa, b, sb, out_dtype, fast):
    if not (a.stride(0) > a.stride(1) and a.stride(1) == 1):
        a = a.contiguous()
    if b.stride(0) > b.stride(1) and b.stride(1) == 1:
        b = b.t().contiguous().t()
    return torch._scaled_mm(a, b, scale_a=sa.reciprocal(), scale_b=sb.reciprocal(),
                            out_dtype=out_dtype, use_fast_accum=fast)


class _TensorwiseMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        sx = _scale(x, E4M3)
        sw = _scale(weight, E4M3)
        xq = _quant(x, sx, E4M3)
        wq = _quant(weight, sw, E4M3)
        out = _gemm(xq.reshape(-1, x.shape[-1]), sx, wq.reshape(wq.shape[1], wq.shape[0]), sw, x.dtype, True)
        return out.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        go = grad_out.reshape(-1, grad_out.shape[-1])
        sgo = _scale(go, E5M2)
        goq = _quant(go, sgo, E5M2)
        sw = _scale(weight, E4M3)
        wq = _quant(weight, sw, E4M3)
        grad_x = _gemm(goq, sgo, wq, sw, go.dtype, False)
        grad_x = grad_x.reshape(*grad_out.shape[:-1], grad_x.shape[-1])
        x2 = x.reshape(-1, x.shape[-1])
        sx = _scale(x2, E4M3)
        xq = _quant(x2, sx, E4M3)
        grad_w = _gemm(goq.t(), sgo, xq, sx, go.dtype, False)
        return grad_x, grad_w


def fp8_linear(input, weight, bias=None):
    out = _TensorwiseMM.apply(input, weight)
    if bias is not None:
        out = out + bias.to(out.dtype)
    return out
