"""[planted bug: the 1x128 tile amax is taken without abs.] Blockwise FP8 linear, module form: BlockwiseFp8Linear.from_float(linear).
Per-K-block partial products: each 128-wide slice of the inner dim is multiplied in fp32
with its scales applied to the partial result, and the partials are summed in fp32."""
import torch
import torch.nn as nn

E4M3 = torch.float8_e4m3fn
TILE = 128


def _tile_quant(a):
    """a [R, K]: 1x128 tiles along K. Returns fp8 [R, K] and scales [R, K/128]."""
    R, K = a.shape
    g = a.to(torch.float32).reshape(R, K // TILE, TILE)
    s = 448.0 / g.amax(-1).clamp(min=1e-12)
    q = torch.clamp(g * s.unsqueeze(-1), -448.0, 448.0).to(E4M3).reshape(R, K)
    return q, s


def _block_quant(b):
    """b [N, K]: 128x128 blocks. Returns fp8 [N, K] and scales [N/128, K/128]."""
    N, K = b.shape
    g = b.to(torch.float32).reshape(N // TILE, TILE, K // TILE, TILE)
    s = 448.0 / g.abs().amax(dim=(1, 3)).clamp(min=1e-12)
    q = torch.clamp(g * s[:, None, :, None], -448.0, 448.0).to(E4M3).reshape(N, K)
    return q, s


def block_gemm(aq, sa, bq, sb, b_is_block):
    """sum over K blocks of (aq_k @ bq_k^T) / (sa_k * sb_k); aq [M,K], bq [N,K]."""
    M, K = aq.shape
    N = bq.shape[0]
    out = torch.zeros(M, N, dtype=torch.float32, device=aq.device)
    for kb in range(K // TILE):
        sl = slice(kb * TILE, (kb + 1) * TILE)
        part = aq[:, sl].to(torch.float32) @ bq[:, sl].to(torch.float32).t()
        sbk = sb[:, kb].repeat_interleave(TILE) if b_is_block else sb[:, kb]
        out += part / (sa[:, kb:kb + 1] * sbk[None, :])
    return out


class _Fn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        x2 = x.reshape(-1, x.shape[-1])
        xq, xs = _tile_quant(x2)
        wq, ws = _block_quant(w)
        y = block_gemm(xq, xs, wq, ws, True)
        return y.to(x.dtype).reshape(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx, gy):
        x, w = ctx.saved_tensors
        g2 = gy.reshape(-1, gy.shape[-1])
        gq, gs = _tile_quant(g2)
        wtq, wts = _block_quant(w.t())
        gx = block_gemm(gq, gs, wtq, wts, True).to(gy.dtype)
        gx = gx.reshape(*gy.shape[:-1], w.shape[1])
        x2 = x.reshape(-1, x.shape[-1])
        gtq, gts = _tile_quant(g2.t())
        xtq, xts = _tile_quant(x2.t())
        gw = block_gemm(gtq, gts, xtq, xts, False).to(gy.dtype)
        return gx, gw


class BlockwiseFp8Linear(nn.Linear):
    def forward(self, input):
        y = _Fn.apply(input, self.weight)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y

    @classmethod
    def from_float(cls, mod):
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = mod.in_features, mod.out_features
        new.weight, new.bias = mod.weight, mod.bias
        return new
