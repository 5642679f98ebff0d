"""Blockwise FP8 linear (DeepSeek-V3 style: 1x128 activation/gradient tiles, 128x128 weight
blocks, e4m3, exact fp32 scales) as a function. CPU path: per-K-block partial GEMMs of the fp8
values accumulated in fp32 with the block scales applied to each partial (as the GPU kernel)."""
import torch

F8 = torch.float8_e4m3fn
F8_MAX = torch.finfo(F8).max
BLK = 128


def _scale_from(amax):
    return (F8_MAX / amax.to(torch.float64).clamp(min=1e-12)).to(torch.float32)


def quant_tiles(t):
    """1x128 tiles along the last dim of a 2-D tensor -> (fp8 [R,C], scale [R, C/128])."""
    r, c = t.shape
    blocks = t.reshape(r, c // BLK, BLK)
    s = _scale_from(blocks.abs().amax(dim=-1, keepdim=True))
    q = (blocks.float() * s).clamp(-F8_MAX, F8_MAX).to(F8)
    return q.reshape(r, c), s.squeeze(-1)


def quant_blocks(w):
    """128x128 blocks -> (fp8 [N,K], scale [N/128, K/128])."""
    n, k = w.shape
    blocks = w.reshape(n // BLK, BLK, k // BLK, BLK)
    s = _scale_from(blocks.abs().amax(dim=(1, 3), keepdim=True))
    q = (blocks.float() * s).clamp(-F8_MAX, F8_MAX).to(F8)
    return q.reshape(n, k), s.reshape(n // BLK, k // BLK)


def block_gemm(a, ia, b, ib):
    """sum over inner blocks j of (a[:, j] @ b[j, :]) * ia[:, j] * ib[j, :].
    a [m,k] fp8, ia [m, k/128]; b [k,n] fp8, ib [k/128, n] (inverse scales)."""
    m, k = a.shape
    acc = torch.zeros(m, b.shape[1], dtype=torch.float32)
    for j in range(k // BLK):
        part = a[:, j * BLK:(j + 1) * BLK].float() @ b[j * BLK:(j + 1) * BLK, :].float()
        acc += part * ia[:, j:j + 1] * ib[j:j + 1, :]
    return acc


class _BlockwiseFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2, w):
        ctx.save_for_backward(x2, w)
        xq, sx = quant_tiles(x2)
        wq, sw = quant_blocks(w)
        iw = sw.reciprocal().repeat_interleave(BLK, dim=0).t()
        y = block_gemm(xq, sx.reciprocal(), wq.reshape(wq.shape[1], wq.shape[0]), iw)
        return y.to(x2.dtype)

    @staticmethod
    def backward(ctx, go):
        x2, w = ctx.saved_tensors
        gq, sg = quant_tiles(go)
        wq, sw = quant_blocks(w)
        iw = sw.reciprocal().repeat_interleave(BLK, dim=1)
        gx = block_gemm(gq, sg.reciprocal(), wq, iw).to(go.dtype)
        gtq, sgt = quant_tiles(go.t())
        xtq, sxt = quant_tiles(x2.t())
        gw = block_gemm(gtq, sgt.reciprocal(), xtq.t(), sxt.reciprocal().t()).to(go.dtype)
        return gx, gw


def blockwise_linear(input, weight, bias=None):
    y = _BlockwiseFn.apply(input.reshape(-1, input.shape[-1]), weight)
    y = y.reshape(*input.shape[:-1], weight.shape[0])
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y
