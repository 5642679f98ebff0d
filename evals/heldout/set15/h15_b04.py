"""[planted bug: grad_output.T taken with reshape]

Held-out set 15, twin h15_c07.py; labels in manifest.json.
"""
import torch
import torch.nn.functional as F

BLOCK = 128
E4M3 = torch.float8_e4m3fn
EPS = 1e-12
ST = F.ScalingType


def _colmajor_scales(s):
    """Copy s [R, C] into fp32 storage with strides exactly (1, R), also when R or C is 1."""
    out = torch.empty_strided(tuple(s.shape), (1, s.shape[0]), dtype=torch.float32, device=s.device)
    return out.copy_(s)


def _quant_tiles(t, fp8_dtype=E4M3):
    """1x128 tiles along the last dim: t [R, C] -> fp8 [R, C] row-major, inverse scales [R, C/128]."""
    fmax = torch.finfo(fp8_dtype).max
    R, C = t.shape
    tiles = t.to(torch.float32).contiguous().reshape(R, C // BLOCK, BLOCK)
    amax = tiles.abs().amax(dim=-1, keepdim=True).to(torch.float64)
    scale = (fmax / torch.clamp(amax, min=EPS)).to(torch.float32)
    q = torch.clamp(tiles * scale, -fmax, fmax).to(fp8_dtype).reshape(R, C)
    return q, _colmajor_scales(scale.reciprocal().reshape(R, C // BLOCK))


def _quant_blocks(w):
    """128x128 blocks: w [R, C] -> fp8 [R, C] row-major, inverse scales [R/128, C/128]."""
    fmax = torch.finfo(E4M3).max
    R, C = w.shape
    blocks = w.to(torch.float32).contiguous().reshape(R // BLOCK, BLOCK, C // BLOCK, BLOCK)
    amax = blocks.abs().amax(dim=(1, 3), keepdim=True).to(torch.float64)
    scale = (fmax / torch.clamp(amax, min=EPS)).to(torch.float32)
    q = torch.clamp(blocks * scale, -fmax, fmax).to(E4M3).reshape(R, C)
    return q, scale.reciprocal().reshape(R // BLOCK, C // BLOCK)


def _rhs_block_scales(s):
    """[K/128, N/128] scales of a 128x128-scaled B -> K-major, K blocks padded to a multiple of 4."""
    kb, nb = s.shape
    l4 = (kb + 3) // 4 * 4
    out = torch.empty_strided((l4, nb), (1, l4), dtype=torch.float32, device=s.device)
    out.fill_(1.0)
    out[:kb].copy_(s)
    return out


def _emulated_block_mm(a, scale_a, b, scale_b, recipe_b):
    """Same product as the block-scaled GEMM, in float64 (per-block partial sums are exact)."""
    M, K = a.shape
    N = b.shape[1]
    kb = K // BLOCK
    if b.shape[0] != K or K % BLOCK or tuple(scale_a.shape) != (M, kb):
        raise RuntimeError(f"block-scaled mm: a {tuple(a.shape)}, b {tuple(b.shape)}, scale_a {tuple(scale_a.shape)}")
    if recipe_b == ST.BlockWise128x128:
        if N % BLOCK or tuple(scale_b.shape) != ((kb + 3) // 4 * 4, N // BLOCK):
            raise RuntimeError(f"block-scaled mm: 128x128 scale_b {tuple(scale_b.shape)} for b {tuple(b.shape)}")
        sb = scale_b[:kb].to(torch.float64).repeat_interleave(BLOCK, dim=1)
    else:
        if tuple(scale_b.shape) != (N, kb):
            raise RuntimeError(f"block-scaled mm: 1x128 scale_b {tuple(scale_b.shape)} for b {tuple(b.shape)}")
        sb = scale_b.to(torch.float64).t()
    sa = scale_a.to(torch.float64)
    a64, b64 = a.to(torch.float64), b.to(torch.float64)
    out = torch.zeros(M, N, dtype=torch.float64, device=a.device)
    for k in range(kb):
        part = a64[:, k * BLOCK:(k + 1) * BLOCK] @ b64[k * BLOCK:(k + 1) * BLOCK, :]
        out += part * (sa[:, k:k + 1] * sb[k:k + 1, :])
    return out.to(torch.bfloat16)


def _block_mm(a, scale_a, recipe_a, b, scale_b, recipe_b):
    """bf16 result of a [M, K] (row-major) x b [K, N] (column-major), block-scaled."""
    try:
        return F.scaled_mm(a, b, scale_a=scale_a, scale_recipe_a=recipe_a, scale_b=scale_b,
                           scale_recipe_b=recipe_b, output_dtype=torch.bfloat16)
    except (RuntimeError, ValueError, NotImplementedError):
        if a.device.type != "cpu":
            raise
        return _emulated_block_mm(a, scale_a, b, scale_b, recipe_b)


class _BlockwiseFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        x2 = x.reshape(-1, x.shape[-1])
        xq, xs = _quant_tiles(x2)                                    # [M, K], [M, K/128]
        wq, ws = _quant_blocks(weight)                               # [N, K], [N/128, K/128]
        out = _block_mm(xq, xs, ST.BlockWise1x128, wq.t(), _rhs_block_scales(ws.t()), ST.BlockWise128x128)
        return out.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        g2 = grad_out.reshape(-1, grad_out.shape[-1])
        x2 = x.reshape(-1, x.shape[-1])

        # grad_input = grad_output @ weight
        gq, gs = _quant_tiles(g2)                                    # [M, N], [M, N/128]
        wq, ws = _quant_blocks(weight)                               # [N, K], [N/128, K/128]
        grad_x = _block_mm(gq, gs, ST.BlockWise1x128, wq.t().contiguous().t(), _rhs_block_scales(ws),
                           ST.BlockWise128x128)

        # grad_weight = grad_output.T @ input, tiles along M on both sides
        gtq, gts = _quant_tiles(g2.reshape(g2.shape[1], -1))                              # [N, M], [N, M/128]
        xtq, xts = _quant_tiles(x2.t())                              # [K, M], [K, M/128]
        grad_w = _block_mm(gtq, gts, ST.BlockWise1x128, xtq.t(), xts, ST.BlockWise1x128)
        return grad_x.to(grad_out.dtype).reshape(*grad_out.shape[:-1], x.shape[-1]), grad_w.to(grad_out.dtype)


def fp8_blockwise_linear(input, weight, bias=None):
    """F.linear(input, weight, bias) with block-scaled FP8 GEMMs (1x128 / 128x128)."""
    out = _BlockwiseFn.apply(input, weight)
    if bias is not None:
        out = out + bias.to(out.dtype)
    return out
