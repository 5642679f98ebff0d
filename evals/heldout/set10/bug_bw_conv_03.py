"""Blockwise FP8 linear, converter form: fp8 operands with their scales kept apart; the GEMM is a sum
over 128-wide K blocks of fp32 partial products, each multiplied by its operands' inverse scales."""
import torch
import torch.nn as nn

TILE = 128
E4M3 = torch.float8_e4m3fn


def quant_rows(t):
    """[R, C] -> fp8 [R, C], scales [R, C/128] (1x128 tiles along C)."""
    r, c = t.shape
    v = t.float().view(r, c // TILE, TILE) if t.is_contiguous() else t.float().reshape(r, c // TILE, TILE)
    amax = v.abs().amax(-1) if t.is_contiguous() else t.float().abs().reshape(r // TILE, TILE, c).amax(1).repeat_interleave(TILE, 0).reshape(r, c // TILE, TILE).amax(-1)
    s = (448.0 / torch.clamp(amax.double(), min=1e-12)).float()
    q = torch.clamp(v * s.unsqueeze(-1), -448.0, 448.0).to(E4M3)
    return q.reshape(r, c), s


def quant_blocks(w):
    """[N, K] -> fp8 [N, K], scales [N/128, K/128]."""
    n, k = w.shape
    v = w.float().reshape(n // TILE, TILE, k // TILE, TILE)
    amax = v.abs().amax(dim=3).amax(dim=1)
    s = (448.0 / torch.clamp(amax.double(), min=1e-12)).float()
    q = torch.clamp(v * s[:, None, :, None], -448.0, 448.0).to(E4M3)
    return q.reshape(n, k), s


def block_gemm(a, a_inv, b, b_inv):
    """a [M,K] fp8 with a_inv [M, K/128]; b [N,K] fp8 with b_inv [N, K/128]; returns fp32 a @ b.T."""
    m, k = a.shape
    out = torch.zeros(m, b.shape[0], dtype=torch.float32, device=a.device)
    for j in range(k // TILE):
        sl = slice(j * TILE, (j + 1) * TILE)
        part = a[:, sl].float() @ b[:, sl].float().t()
        out += part * a_inv[:, j:j + 1] * b_inv[:, j].unsqueeze(0)
    return out


def _round(r, dtype):
    return r.to(torch.bfloat16).to(dtype)


class _Fn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        x2 = x.reshape(-1, x.shape[-1])
        xq, xs = quant_rows(x2)
        wq, ws = quant_blocks(w)
        w_inv = ws.reciprocal().repeat_interleave(TILE, dim=0)      # [N, K/128]
        y = block_gemm(xq, xs.reciprocal(), wq, w_inv)
        return _round(y, x.dtype).reshape(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        g2 = g.reshape(-1, g.shape[-1])
        x2 = x.reshape(-1, x.shape[-1])
        gq, gs = quant_rows(g2)                                     # tiles along N
        wq, ws = quant_blocks(w)
        wt_inv = ws.t().reciprocal().repeat_interleave(TILE, dim=0)  # [K, N/128]
        gx = block_gemm(gq, gs.reciprocal(), wq.t(), wt_inv)
        gtq, gts = quant_rows(g2.t())                               # [N, M], tiles along M
        xtq, xts = quant_rows(x2.t())                               # [K, M], tiles along M
        gw = block_gemm(gtq, gts.reciprocal(), xtq, xts.reciprocal())
        return _round(gx, g.dtype).reshape(x.shape).to(x.dtype), _round(gw, g.dtype).to(w.dtype)


class BlockwiseLinear(nn.Linear):
    def forward(self, x):
        y = _Fn.apply(x, self.weight)
        return y + self.bias.to(y.dtype) if self.bias is not None else y


def convert_blockwise(module, **kwargs):
    if isinstance(module, nn.Linear) and not isinstance(module, BlockwiseLinear):
        new = BlockwiseLinear.__new__(BlockwiseLinear)
        nn.Module.__init__(new)
        new.in_features, new.out_features = module.in_features, module.out_features
        new.weight = module.weight
        new.bias = module.bias
        return new
    for name, child in module.named_children():
        setattr(module, name, convert_blockwise(child))
    return module
