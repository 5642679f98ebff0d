"""DeepSeek-V3 style blockwise FP8 linear.

    y = blockwise_fp8_linear(x_2d, weight)          # function form
    layer = BlockwiseFp8Linear.from_float(linear)    # module form
    model = to_blockwise_fp8(model)                  # converter form

Quantization (all e4m3, exact fp32 scales, no power-of-two rounding):
    activations and gradients: 1 x 128 tiles along the GEMM's reduction dim
    weights:                   128 x 128 blocks
    grad_weight = dy.T @ x reduces over tokens, so dy and x are tiled along M.
GEMM results are written in bf16, then cast to the dtype the caller expects.
On an SM90 GPU the GEMMs run through torch.nn.functional.scaled_mm with
BlockWise1x128 / BlockWise128x128 scales; elsewhere they are emulated: one
fp32 partial product per 128-wide slice of the reduction dim, scaled by the
two operands' scales for that slice, summed in fp32.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

BLOCK = 128
FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
EPS = 1e-12


# ----------------------------------------------------------------- quantizers

def _amax_to_scale(amax):
    return (FP8_MAX / amax.to(torch.float64).clamp(min=EPS)).to(torch.float32)


def act_quant(x):
    """x [R, C] -> fp8 [R, C] row-major, inverse scales [R, C // 128] (1 x 128 tiles)."""
    R, C = x.shape
    tiles = x.float().reshape(R, C // BLOCK, BLOCK).clamp(-FP8_MAX, FP8_MAX)
    s = _amax_to_scale(tiles.abs().amax(dim=-1, keepdim=True))
    q = (tiles * s).to(FP8).reshape(R, C)
    return q, (1.0 / s).reshape(R, C // BLOCK)


def act_quant_colwise(x):
    """x [R, C] -> fp8 [R, C], inverse scales [R // 128, C] (128 x 1 tiles, along R)."""
    R, C = x.shape
    tiles = x.float().reshape(R // BLOCK, BLOCK, C)
    s = _amax_to_scale(tiles.abs().amax(dim=1, keepdim=True))
    q = (tiles * s).clamp(-FP8_MAX, FP8_MAX).to(FP8).reshape(R, C)
    return q, (1.0 / s).reshape(R // BLOCK, C)


def weight_quant(w):
    """w [N, K] -> fp8 [N, K], inverse scales [N // 128, K // 128] (128 x 128 blocks)."""
    N, K = w.shape
    blocks = w.float().reshape(N // BLOCK, BLOCK, K // BLOCK, BLOCK)
    s = _amax_to_scale(blocks.abs().amax(dim=(1, 3), keepdim=True))
    q = (blocks * s).clamp(-FP8_MAX, FP8_MAX).to(FP8).reshape(N, K)
    return q, (1.0 / s).reshape(N // BLOCK, K // BLOCK)


# ----------------------------------------------------------------------- GEMMs

def _use_kernel(t):
    return (t.is_cuda and hasattr(F, "scaled_mm")
            and torch.cuda.get_device_capability(t.device) >= (9, 0))


def _k_major_padded(s):
    """[Kb, Nb] block scales -> K-major storage, Kb padded to a multiple of 4."""
    kb, nb = s.shape
    kb_pad = (kb + 3) // 4 * 4
    out = s.new_ones(nb, kb_pad).t()
    out[:kb] = s
    return out


def _outer_major(s):
    return s.t().contiguous().t()


def _emulated(a, sa, b, sb):
    """sum_j (a[:, j] @ b[j, :]) * sa[:, j] * sb[j, :] over 128-wide slices j, in fp32.

    a [M, K] fp8, sa [M, K//128]; b [K, N] fp8, sb [K//128, N] (already expanded)."""
    M, K = a.shape
    out = torch.zeros(M, b.shape[1], dtype=torch.float32, device=a.device)
    for j in range(K // BLOCK):
        sl = slice(j * BLOCK, (j + 1) * BLOCK)
        part = a[:, sl].float() @ b[sl, :].float()
        out += part * sa[:, j:j + 1] * sb[j:j + 1, :]
    return out.to(torch.bfloat16)


def gemm_1x128_128x128(a, sa, b, sb_blocks):
    """a [M, K] (1x128 tiles, sa [M, K//128]) @ b [K, N] (128x128 blocks, sb [K//128, N//128])."""
    if _use_kernel(a):
        return F.scaled_mm(
            a.contiguous(), b.t().contiguous().t(),
            scale_a=_outer_major(sa), scale_recipe_a=F.ScalingType.BlockWise1x128,
            scale_b=_k_major_padded(sb_blocks), scale_recipe_b=F.ScalingType.BlockWise128x128,
            output_dtype=torch.bfloat16,
        )
    return _emulated(a, sa, b, sb_blocks.repeat_interleave(BLOCK, dim=1))


def gemm_1x128_1x128(a, sa, b, sb):
    """a [M, K] (1x128 tiles, sa [M, K//128]) @ b [K, N] (128x1 tiles along K, sb [K//128, N])."""
    if _use_kernel(a):
        return F.scaled_mm(
            a.contiguous(), b.t().contiguous().t(),
            scale_a=_outer_major(sa), scale_recipe_a=F.ScalingType.BlockWise1x128,
            scale_b=_outer_major(sb.t()), scale_recipe_b=F.ScalingType.BlockWise1x128,
            output_dtype=torch.bfloat16,
        )
    return _emulated(a, sa, b, sb)


# -------------------------------------------------------------------- autograd

class _BlockwiseLinear(torch.autograd.Function):

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        xq, xs = act_quant(x2)
        wq, ws = weight_quant(w)
        y = gemm_1x128_128x128(xq, xs, wq.t(), ws.t())
        return y.to(x.dtype).reshape(*lead, w.shape[0])

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        x2 = x.reshape(-1, x.shape[-1])
        dy2 = dy.reshape(-1, dy.shape[-1])

        # dx = dy @ w      (reduction over N)
        gq, gs = act_quant(dy2)
        wq, ws = weight_quant(w)
        dx = gemm_1x128_128x128(gq, gs, wq, ws)

        # dw = dy.T @ x    (reduction over M: both operands tiled along M)
        gq_m, gs_m = act_quant_colwise(dy2)        # [M/128, N]
        xq_m, xs_m = act_quant_colwise(x2)         # [M/128, K]
        dw = gemm_1x128_1x128(gq_m.t(), gs_m.t(), xq_m, xs_m)

        return dx.to(x.dtype).reshape(x.shape), dw.to(w.dtype)


def blockwise_fp8_linear(x, weight):
    return _BlockwiseLinear.apply(x, weight)


class BlockwiseFp8Linear(nn.Linear):

    def forward(self, x):
        y = _BlockwiseLinear.apply(x, self.weight)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y

    @classmethod
    def from_float(cls, mod):
        assert mod.in_features % BLOCK == 0 and mod.out_features % BLOCK == 0
        with torch.device("meta"):
            new = cls(mod.in_features, mod.out_features, bias=False)
        new.weight = mod.weight
        new.bias = mod.bias
        return new


def to_blockwise_fp8(module, **kwargs):
    if type(module) is nn.Linear:
        return BlockwiseFp8Linear.from_float(module)
    for name, child in list(module.named_children()):
        if type(child) is nn.Linear:
            setattr(module, name, BlockwiseFp8Linear.from_float(child))
        else:
            to_blockwise_fp8(child, **kwargs)
    return module
