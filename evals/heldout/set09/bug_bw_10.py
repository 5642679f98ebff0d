"""Blockwise FP8 linear, converter form, batched per-block partial products.

1x128 tiles (activations, gradients; along M for grad_weight) and 128x128 weight
blocks, e4m3, exact float32 scales. Each GEMM is one batched matmul over the
inner-dimension blocks, [nkb, R, 128] @ [nkb, 128, C] in float32, scaled per
block and summed over blocks in float32. Saves the high-precision input and
weight; N-D inputs are flattened to tokens. Runs on CPU and CUDA.
"""
import torch
from torch import nn

TILE = 128
DT = torch.float8_e4m3fn
MAXV = torch.finfo(DT).max


class Fp8Operand:
    """An e4m3 operand [R, inner] with one scale per (row-group, 128-wide inner block)."""

    def __init__(self, t, row_group):
        r, c = t.shape
        v = t.to(torch.float32).reshape(r // row_group, row_group, c // TILE, TILE)
        amax = v.abs().amax(dim=(1, 3), keepdim=True).to(torch.float64)
        s = (MAXV / amax.clamp(min=1e-12)).to(torch.float32)
        self.data = (v * s).clamp(-MAXV, MAXV).to(DT).reshape(r, c)
        self.inv = s.reciprocal().reshape(r // row_group, c // TILE).repeat_interleave(row_group, 0)

    @classmethod
    def tiles(cls, t):
        return cls(t, 1)

    @classmethod
    def blocks(cls, t):
        return cls(t, TILE)


def bmm_blocks(a, b):
    """a: Fp8Operand [R, K]; b: Fp8Operand [C, K] -> a @ b.T in float32."""
    r, k = a.data.shape
    c = b.data.shape[0]
    nkb = k // TILE
    av = a.data.to(torch.float32).reshape(r, nkb, TILE).permute(1, 0, 2)   # [nkb, R, 128]
    bv = b.data.to(torch.float32).reshape(c, nkb, TILE).permute(1, 2, 0)   # [nkb, 128, C]
    parts = torch.bmm(av, bv)                                               # [nkb, R, C]
    scale = a.inv.t().unsqueeze(2) * b.inv.t().unsqueeze(1)                 # [nkb, R, C]
    return (parts * scale).sum(dim=0)


class _Fn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2, w):
        ctx.save_for_backward(x2, w)
        y = bmm_blocks(Fp8Operand.tiles(x2), getattr(w, "_fp8_blocks", None) or Fp8Operand.blocks(w))
        return y.to(x2.dtype)

    @staticmethod
    def backward(ctx, g2):
        x2, w = ctx.saved_tensors
        gx = bmm_blocks(Fp8Operand.tiles(g2), Fp8Operand.blocks(w.t()))
        gw = bmm_blocks(Fp8Operand.tiles(g2.t()), Fp8Operand.tiles(x2.t()))
        return gx.to(g2.dtype), gw.to(g2.dtype)


class BlockwiseLinear(nn.Module):
    def __init__(self, lin):
        super().__init__()
        self.in_features, self.out_features = lin.in_features, lin.out_features
        self.weight, self.bias = lin.weight, lin.bias
        lin.weight._fp8_blocks = Fp8Operand.blocks(lin.weight.detach())

    def forward(self, x):
        lead = x.shape[:-1]
        y = _Fn.apply(x.reshape(-1, self.in_features), self.weight)
        y = y.reshape(*lead, self.out_features)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y


def to_blockwise_fp8(model, **kwargs):
    if isinstance(model, nn.Linear):
        return BlockwiseLinear(model)
    for name, child in model.named_children():
        setattr(model, name, to_blockwise_fp8(child, **kwargs))
    return model
