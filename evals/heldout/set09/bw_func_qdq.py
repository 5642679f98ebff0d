"""Blockwise FP8 linear (DeepSeek-V3 style), function form, quantize-dequantize.

Activations and gradients: 1x128 tiles along the GEMM's inner dimension, one
e4m3 scale per tile. Weight: 128x128 blocks. grad_weight: both operands in 1x128
tiles along M (tokens). Scales are exact: fp8_max / max(amax, 1e-12), computed
in float64 and stored as float32 (no power-of-2 rounding).

Block scales in torch._scaled_mm need cuBLAS >= 12.9 on SM90, so this version
is portable: it quantizes to e4m3, dequantizes in float32 (q * (1/s)) and runs a
float32 matmul, which is exact for the e4m3 x e4m3 products and accumulates in
fp32. Runs on CPU and CUDA alike. Every dim must be a multiple of 128.
"""
import torch

BLOCK = 128
E4M3 = torch.float8_e4m3fn
FMAX = torch.finfo(E4M3).max


def _scale(amax):
    return (FMAX / amax.to(torch.float64).clamp(min=1e-12)).to(torch.float32)


def qdq_tiles(t):
    """[R, C] -> e4m3 in 1x128 tiles along C, dequantized to float32 [R, C]."""
    r, c = t.shape
    v = t.to(torch.float32).reshape(r, c // BLOCK, BLOCK)
    s = _scale(v.abs().amax(dim=-1, keepdim=True))
    q = (v * s).clamp(-FMAX, FMAX).to(E4M3)
    return (q.to(torch.float32) * s.reciprocal()).reshape(r, c)


def qdq_blocks(w):
    """[N, K] -> e4m3 in 128x128 blocks, dequantized to float32 [N, K]."""
    n, k = w.shape
    v = w.to(torch.float32).reshape(n // BLOCK, BLOCK, k // BLOCK, BLOCK)
    s = _scale(v.abs().amax(dim=(1, 3), keepdim=True))
    q = (v * s).clamp(-FMAX, FMAX).to(E4M3)
    return (q.to(torch.float32) * s.reciprocal()).reshape(n, k)


class _BlockwiseFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        y = torch.mm(qdq_tiles(x), qdq_blocks(w).t())
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, gy):
        x, w = ctx.saved_tensors
        gx = torch.mm(qdq_tiles(gy), qdq_blocks(w))
        gw = torch.mm(qdq_tiles(gy.t()), qdq_tiles(x.t()).t())
        return gx.to(gy.dtype), gw.to(gy.dtype)


def blockwise_linear(input, weight, bias=None):
    y = _BlockwiseFn.apply(input.reshape(-1, input.shape[-1]), weight)
    y = y.reshape(*input.shape[:-1], weight.shape[0])
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y
