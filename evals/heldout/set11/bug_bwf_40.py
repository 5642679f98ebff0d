"""[planted bug: the output is always bf16 instead of the input dtype.] Blockwise FP8 linear (1x128 activation/gradient tiles, 128x128 weight blocks, e4m3, exact
fp32 scales), function form: blockwise_fp8_linear(input, weight, bias=None).
Quantize-dequantize, then an fp32 matmul; the result is cast to the input dtype."""
import torch

F8 = torch.float8_e4m3fn
FMAX = 448.0
B = 128


def qdq_tiles(t):
    """1x128 tiles along the last (inner) dim of a 2-D tensor."""
    R, C = t.shape
    tt = t.float().reshape(R, C // B, B)
    amax = tt.abs().amax(dim=-1, keepdim=True)
    s = FMAX / amax.clamp(min=1e-12)
    q = (tt * s).clamp(-FMAX, FMAX).to(F8)
    return (q.float() / s).reshape(R, C)


def qdq_blocks(t):
    """128x128 blocks of a 2-D tensor."""
    R, C = t.shape
    tt = t.float().reshape(R // B, B, C // B, B)
    amax = tt.abs().amax(dim=(1, 3), keepdim=True)
    s = FMAX / amax.clamp(min=1e-12)
    q = (tt * s).clamp(-FMAX, FMAX).to(F8)
    return (q.float() / s).reshape(R, C)


class _BlockwiseMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        y = torch.mm(qdq_tiles(x), qdq_blocks(w).t())
        return y.to(torch.bfloat16)

    @staticmethod
    def backward(ctx, gy):
        x, w = ctx.saved_tensors
        gx = torch.mm(qdq_tiles(gy), qdq_blocks(w.t()).t())
        gw = torch.mm(qdq_tiles(gy.t()), qdq_tiles(x.t()).t())
        return gx.to(gy.dtype), gw.to(gy.dtype)


def blockwise_fp8_linear(input, weight, bias=None):
    out = _BlockwiseMM.apply(input, weight)
    if bias is not None:
        out = out + bias.to(out.dtype)
    return out
