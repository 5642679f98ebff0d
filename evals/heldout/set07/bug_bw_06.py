"""Blockwise FP8 linear (1x128 / 128x128 scales) installed by a converter; per-K-block accumulation."""
import torch
from torch import nn

BLOCK = 128
FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)
EPS = 1e-12


def tile_scale(tiles, dims):
    amax = torch.amax(torch.abs(tiles), dim=dims, keepdim=True).to(torch.float64)
    return (FP8_MAX / torch.clamp(amax, min=EPS)).to(torch.float32)


def cast(tiles, scale):
    return (tiles.to(torch.float32) * scale).clamp(min=-FP8_MAX, max=FP8_MAX).to(FP8)


def quant_act(t):
    """[r, c] -> fp8 [r, c] + inverse scales [r, c // 128] (1x128 tiles along c)."""
    r, c = t.shape
    tiles = t.reshape(-1, BLOCK)
    s = tile_scale(tiles, -1)
    return cast(tiles, s).reshape(r, c), s.reciprocal().reshape(r, c // BLOCK)


@torch.no_grad()
def quant_weight(w):
    """[n, k] -> fp8 [n, k] + inverse scales [n // 128, k // 128]."""
    n, k = w.shape
    blocks = w.reshape(n // BLOCK, BLOCK, k // BLOCK, BLOCK)
    s = tile_scale(blocks, (1, 3))
    return cast(blocks, s).reshape(n, k), s.reciprocal().reshape(n // BLOCK, k // BLOCK)


def block_scaled_mm(a, a_inv, b, b_inv, out_dtype):
    """a [m, k] fp8 with a_inv [m, k/128]; b [k, n] fp8 with b_inv [k/128, n]."""
    m, k = a.shape
    acc = torch.zeros(m, b.shape[1], dtype=torch.float32, device=a.device)
    for kb in range(k // BLOCK):
        sl = slice(kb * BLOCK, (kb + 1) * BLOCK)
        part = torch.mm(a[:, sl].to(torch.float32), b[sl, :].to(torch.float32))
        acc += part * (a_inv[:, kb:kb + 1] * b_inv[kb:kb + 1, :])
    return acc.to(out_dtype)


class _BlockFp8Fn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2, weight, wq, w_inv, wq_kmajor, bias):
        xq, x_inv = quant_act(x2)
        ctx.save_for_backward(x2, wq_kmajor, w_inv)
        ctx.has_bias = bias is not None
        out_dtype = x2.dtype
        out = block_scaled_mm(xq, x_inv, wq.t(), w_inv.t().repeat_interleave(BLOCK, dim=1),
                              out_dtype)
        if bias is not None:
            out = out + bias.to(out.dtype)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x2, wq_kmajor, w_inv = ctx.saved_tensors
        m, n = grad_out.shape
        g_tiles = grad_out.reshape(-1, BLOCK)
        g_s = tile_scale(g_tiles, -1)
        gq = cast(g_tiles, g_s).reshape(m, n)
        g_inv = g_s.reciprocal().reshape(m, n // BLOCK)
        grad_x = block_scaled_mm(gq, g_inv, wq_kmajor.t(),
                                 w_inv.repeat_interleave(BLOCK, dim=1), grad_out.dtype)
        gtq, gt_inv = quant_act(grad_out.t())
        xtq, xt_inv = quant_act(x2.t())
        grad_w = block_scaled_mm(gtq, gt_inv, xtq.t(), xt_inv.t(), grad_out.dtype)
        grad_b = grad_out.sum(0) if ctx.has_bias else None
        return grad_x, grad_w, None, None, None, grad_b


class BlockFp8Linear(nn.Linear):
    @classmethod
    def from_float(cls, mod):
        with torch.device("meta"):
            new = cls(mod.in_features, mod.out_features, bias=False)
        new.weight = mod.weight
        new.bias = mod.bias
        return new

    def _key(self):
        w = self.weight
        return (w._version, w.data_ptr(), w.dtype, tuple(w.shape), tuple(w.stride()))

    def _fp8_weight(self):
        key = self._key()
        fwd = self.__dict__.get("_fwd_cache")
        if fwd is None or fwd[0] != key:
            fwd = (key, *quant_weight(self.weight))
            self.__dict__["_fwd_cache"] = fwd
        bkey = (self.weight.data_ptr(), tuple(self.weight.shape))
        bwd = self.__dict__.get("_bwd_cache")
        if bwd is None or bwd[0] != bkey:
            bwd = (bkey, fwd[1].t().contiguous())
            self.__dict__["_bwd_cache"] = bwd
        return fwd[1], fwd[2], bwd[1]

    def forward(self, input):
        x2 = input.reshape(-1, input.shape[-1])
        wq, w_inv, wq_kmajor = self._fp8_weight()
        out = _BlockFp8Fn.apply(x2, self.weight, wq, w_inv, wq_kmajor, self.bias)
        return out.reshape(*input.shape[:-1], self.out_features)


def convert(model: nn.Module) -> nn.Module:
    if isinstance(model, nn.Linear) and not isinstance(model, BlockFp8Linear):
        return BlockFp8Linear.from_float(model)
    for name, child in list(model.named_children()):
        setattr(model, name, convert(child))
    return model
