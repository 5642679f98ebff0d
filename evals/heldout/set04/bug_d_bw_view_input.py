"""Blockwise FP8 training by module swap (author D).

``convert_to_blockwise(model)`` walks the model and replaces each nn.Linear with
a ``BlockwiseFP8Linear`` wrapper that keeps the very same weight/bias
Parameters. Numerics (DeepSeek-V3): activations and gradients quantized in 1x128
tiles along each GEMM's reduction dim, weight in 128x128 blocks, e4m3, scale =
448 / amax (float64 -> float32). The block-scaled GEMM is emulated slice by
slice: fp32 partial products scaled and accumulated in fp32, result rounded to
bf16 and returned in nn.Linear's dtype.
"""
import torch
from torch import nn

_F8 = torch.float8_e4m3fn
_MAX = float(torch.finfo(_F8).max)
_B = 128


def _qscale(amax):
    return (_MAX / amax.double().clamp(min=1e-12)).float()


def quant_rows(t):
    """1x128 tiles along dim 1 of t [R, C]: payload [R, C], inverse scales [R, C/128]."""
    R, C = t.shape
    g = t.reshape(R, C // _B, _B)
    s = _qscale(g.abs().amax(dim=2))
    q = (g.float() * s.unsqueeze(2)).clamp(-_MAX, _MAX).to(_F8)
    return q.reshape(R, C), 1.0 / s


def quant_cols(t):
    """128x1 tiles along dim 0 of t [R, C]: inverse scales [R/128, C]."""
    q, inv = quant_rows(t.t())
    return q.t(), inv.t()


def quant_blocks(t):
    """128x128 blocks of t [R, C]: inverse scales [R/128, C/128]."""
    R, C = t.shape
    g = t.reshape(R // _B, _B, C // _B, _B)
    s = _qscale(g.abs().amax(dim=(1, 3)))
    q = (g.float() * s[:, None, :, None]).clamp(-_MAX, _MAX).to(_F8)
    return q.reshape(R, C), 1.0 / s


def block_gemm(a, a_inv, b, b_inv):
    """sum over reduction slices k: (a[:, k] @ b[k, :]) * a_inv[:, k] * b_inv[k, :]."""
    acc = None
    for k in range(a.shape[1] // _B):
        lo, hi = k * _B, (k + 1) * _B
        p = torch.mm(a[:, lo:hi].float(), b[lo:hi, :].float())
        p = p * a_inv[:, k:k + 1]
        p = p * b_inv[k:k + 1, :]
        acc = p if acc is None else acc + p
    return acc.bfloat16()


class _BlockwiseLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        x2 = x.view(-1, x.shape[-1])
        xq, xi = quant_rows(x2)
        wq, wi = quant_blocks(weight)
        out = block_gemm(xq, xi, wq.t(), wi.t().repeat_interleave(_B, dim=1))
        return out.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        g2 = grad.reshape(-1, grad.shape[-1])
        x2 = x.reshape(-1, x.shape[-1])
        gq, gi = quant_rows(g2)
        wq, wi = quant_blocks(weight)
        dx = block_gemm(gq, gi, wq, wi.repeat_interleave(_B, dim=1)).to(grad.dtype)
        gtq, gti = quant_rows(g2.t())
        xq, xi = quant_cols(x2)
        dw = block_gemm(gtq, gti, xq, xi).to(grad.dtype)
        return dx.reshape(*grad.shape[:-1], x.shape[-1]), dw


class BlockwiseFP8Linear(nn.Module):
    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias

    def forward(self, x):
        y = _BlockwiseLinearFn.apply(x, self.weight)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y


def convert_to_blockwise(model, **kwargs):
    if isinstance(model, nn.Linear):
        return BlockwiseFP8Linear(model)
    for name, child in model.named_children():
        if isinstance(child, nn.Linear):
            setattr(model, name, BlockwiseFP8Linear(child))
        else:
            convert_to_blockwise(child)
    return model
