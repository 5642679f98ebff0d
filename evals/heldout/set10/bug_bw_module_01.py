"""Blockwise FP8 linear (1x128 activation/gradient tiles, 128x128 weight blocks, e4m3, exact fp32
scales 448/amax), module form. Quantize, dequantize in fp32, then an fp32 matmul (runs on CPU and CUDA).
Results are rounded to bf16 and then cast to the input's dtype."""
import torch
import torch.nn as nn

FP8 = torch.float8_e4m3fn
FMAX = 448.0
B = 128


def _scale(amax):
    return (FMAX / amax.to(torch.float64).clamp(min=1e-12)).to(torch.float32)


def qdq_tiles(t):
    """1x128 tiles along the last dim of a 2-D tensor; returns the dequantized fp32 tensor."""
    r, c = t.shape
    tiles = t.reshape(r, c // B, B).float()
    s = _scale(tiles.abs().amax(dim=-1, keepdim=True))
    q = (tiles * s).clamp(-FMAX, FMAX).to(FP8)
    return (q.float() * s.reciprocal()).reshape(r, c)


def qdq_blocks(w):
    """128x128 blocks of a 2-D tensor."""
    n, k = w.shape
    blk = w.reshape(n // B, B, k // B, B).float()
    s = _scale(blk.abs().amax(dim=(1, 3), keepdim=True))
    q = (blk * s).clamp(-FMAX, FMAX).to(FP8)
    return (q.float() * s.reciprocal()).reshape(n, k)


def _out(r, dtype):
    return r.to(torch.bfloat16).to(dtype)


class _BlockwiseFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        x2 = x.reshape(-1, x.shape[-1])
        y = torch.mm(qdq_tiles(x2), qdq_blocks(w).t())
        return _out(y, x.dtype).reshape(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        g2 = g.reshape(-1, g.shape[-1])
        x2 = x.reshape(-1, x.shape[-1])
        gx = torch.mm(qdq_tiles(g2), qdq_blocks(w))
        gw = torch.mm(qdq_tiles(g2.t()), qdq_tiles(x2))
        return _out(gx, g.dtype).reshape(x.shape).to(x.dtype), _out(gw, g.dtype).to(w.dtype)


class BlockwiseFP8Linear(nn.Linear):
    @classmethod
    def from_float(cls, linear):
        with torch.device("meta"):
            m = cls(linear.in_features, linear.out_features, bias=False)
        m.weight = linear.weight
        m.bias = linear.bias
        return m

    def forward(self, x):
        y = _BlockwiseFn.apply(x, self.weight)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y
