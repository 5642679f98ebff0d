"""Blockwise (DeepSeek-V3 style) FP8 linear, function form (author A).

``block_fp8_linear(input_2d, weight)``: activations and gradients use 1x128
tiles along the reduction dim (grad_weight: along M, for both operands), the
weight uses 128x128 blocks. e4m3 everywhere, exact fp32 scales (448 / amax,
computed in float64 then rounded to float32). The CPU has no block-scaled GEMM,
so the GEMM is emulated per 128-wide slice of the reduction dim: fp32 partial
product times the two scales, summed in fp32, result rounded to bf16, then
converted to the dtype nn.Linear would return.
"""
import torch

E4M3 = torch.float8_e4m3fn
_EPS = 1e-12
BLK = 128


def _tile_quant(t, rows, cols):
    """Quantize t [R, C] with one scale per (rows x cols) tile; returns q, inverse scales [R/rows, C/cols]."""
    R, C = t.shape
    tiles = t.reshape(R // rows, rows, C // cols, cols)
    amax = torch.abs(tiles).amax(dim=(1, 3)).to(torch.float64)
    scale = (torch.finfo(E4M3).max / torch.clamp(amax, min=_EPS)).to(torch.float32)
    top = torch.finfo(E4M3).max
    q = (tiles.to(torch.float32) * scale[:, None, :, None]).clamp(-top, top).to(E4M3)
    return q.reshape(R, C), scale.reciprocal()


def _sliced_gemm(a8, a_inv, b8, b_inv):
    """a8 [M, R], a_inv [M, R/128]; b8 [R, N], b_inv [R/128, N]; fp32 result."""
    M, R = a8.shape
    N = b8.shape[1]
    nb = R // BLK
    a3 = a8.to(torch.float32).reshape(M, nb, BLK).permute(1, 0, 2)
    b3 = b8.to(torch.float32).reshape(nb, BLK, N)
    partial = torch.bmm(a3, b3)
    partial = partial * a_inv.t().unsqueeze(-1) * b_inv.unsqueeze(1)
    return partial.sum(dim=0)


def _finish(acc, dtype):
    return acc.to(torch.bfloat16).to(dtype)


class _BlockFP8(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        x8, xs = _tile_quant(x, 1, BLK)            # [M, K/128]
        w8, ws = _tile_quant(w, BLK, BLK)          # [N/128, K/128]
        wsb = ws.t().repeat_interleave(BLK, dim=1)  # [K/128, N]
        return _finish(_sliced_gemm(x8, xs, w8.t(), wsb), x.dtype)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        g8, gs = _tile_quant(g, 1, BLK)            # [M, N/128]
        w8, ws = _tile_quant(w, BLK, BLK)          # [N/128, K/128]
        wsb = ws.repeat_interleave(BLK, dim=1)     # [N/128, K]
        grad_x = _finish(_sliced_gemm(g8, gs, w8, wsb), g.dtype)
        gt8, gts = _tile_quant(g.t(), 1, BLK)      # [N, M/128]
        xm8, xms = _tile_quant(x, 1, BLK)
        xms = xms.reshape(x.shape[0] // BLK, x.shape[1])
        grad_w = _finish(_sliced_gemm(gt8, gts, xm8, xms), g.dtype)
        return grad_x, grad_w


def block_fp8_linear(input_2d, weight):
    return _BlockFP8.apply(input_2d, weight)
