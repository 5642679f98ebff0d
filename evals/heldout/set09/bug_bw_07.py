"""Blockwise FP8 linear, module form, per-K-block partial products.

Same recipe as DeepSeek-V3's fine-grained scaling: 1x128 activation/gradient
tiles along the inner dim, 128x128 weight blocks, e4m3, exact fp32 scales; the
grad_weight GEMM tiles both operands 1x128 along M. Each GEMM is computed as a
sum over 128-wide blocks of the inner dimension: the fp8 block product is taken
in float32 (exact products, fp32 accumulation) and then multiplied by the two
inverse scales of that block, accumulated in float32 (what a block-scaled GEMM
kernel does with its promotion to fp32 every 128 elements). The forward saves the
fp8 weight and its block scales (reused by grad_input) and the high-precision
input (grad_weight needs it tiled along M). Runs on CPU and CUDA.
"""
import torch
from torch import nn

BLK = 128
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


def _inv_scale(amax):
    s = (FP8_MAX / torch.clamp(amax.to(torch.float64), min=1e-12)).to(torch.float32)
    return s, s.reciprocal()


def quant_tiles(t):
    """[R, C] -> (fp8 [R, C/128, 128], inverse scales [R, C/128])."""
    r, c = t.shape
    v = t.to(torch.float32).reshape(r, c // BLK, BLK)
    s, inv = _inv_scale(torch.amax(v.abs(), dim=2, keepdim=True))
    q = torch.clamp(v * s, -FP8_MAX, FP8_MAX).to(FP8)
    return q, inv.squeeze(2)


def quant_blocks(w):
    """[N, K] -> (fp8 [N, K], inverse block scales [N/128, K/128])."""
    n, k = w.shape
    v = w.to(torch.float32).reshape(n // BLK, BLK, k // BLK, BLK)
    s, inv = _inv_scale(torch.amax(v.abs(), dim=(1, 3), keepdim=True))
    q = torch.clamp(v * s, -FP8_MAX, FP8_MAX).to(FP8)
    return q.reshape(n, k), inv.reshape(n // BLK, k // BLK)


def block_gemm(aq, a_inv, bq, b_inv):
    """sum_kb (aq[:, kb] @ bq[:, kb].T) * a_inv[:, kb, None] * b_inv[None, :, kb].

    aq [R, nkb, 128], a_inv [R, nkb]; bq [C, nkb, 128], b_inv [C, nkb].
    """
    r, nkb, _ = aq.shape
    c = bq.shape[0]
    out = torch.zeros(r, c, dtype=torch.float32, device=aq.device)
    for kb in range(nkb):
        part = aq[:, kb, :].to(torch.float32) @ bq[:, kb, :].to(torch.float32).t()
        out += part * (a_inv[:, kb:kb + 1] * b_inv[:, kb].unsqueeze(0))
    return out


class _BlockFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2d, w):
        n, k = w.shape
        wq, w_inv = quant_blocks(w)
        ctx.save_for_backward(x2d, wq, w_inv)
        xq, x_inv = quant_tiles(x2d)
        b = wq.reshape(n, k // BLK, BLK)
        b_inv = w_inv.repeat_interleave(BLK, dim=0)               # [N, K/128]
        return block_gemm(xq, x_inv, b, b_inv).to(x2d.dtype)

    @staticmethod
    def backward(ctx, gy):
        x2d, wq, w_inv = ctx.saved_tensors
        n, k = wq.shape
        # grad_input = gy @ w: inner dim N
        gq, g_inv = quant_tiles(gy)
        b = wq.reshape(k, n // BLK, BLK)
        b_inv = w_inv.t().repeat_interleave(BLK, dim=0)           # [K, N/128]
        gx = block_gemm(gq, g_inv, b, b_inv).to(gy.dtype)
        # grad_weight = gy.T @ x: inner dim M, 1x128 tiles along M for both
        gtq, gt_inv = quant_tiles(gy.t())
        xtq, xt_inv = quant_tiles(x2d.t())
        gw = block_gemm(gtq, gt_inv, xtq, xt_inv).to(gy.dtype)
        return gx, gw


class BlockwiseFp8Linear(nn.Linear):
    def forward(self, x):
        y = _BlockFn.apply(x.reshape(-1, self.in_features), self.weight)
        y = y.reshape(*x.shape[:-1], self.out_features)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y

    @classmethod
    def from_float(cls, linear):
        with torch.device("meta"):
            m = cls(linear.in_features, linear.out_features, bias=False)
        m.weight = linear.weight
        m.bias = linear.bias
        return m
