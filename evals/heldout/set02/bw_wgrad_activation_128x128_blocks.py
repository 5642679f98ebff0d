"""DeepSeek-V3 style blockwise FP8 linear (1x128 activation tiles, 128x128 weight blocks).

    fprop : y  = act_quant(x)            @ weight_quant(W).T
    dgrad : dx = act_quant(dy)           @ weight_quant(W)
    wgrad : dW = act_quant(dy.T)         @ act_quant(x.T).T      (tiles along the token dim)

On an SM90 GPU the GEMMs go to torch.nn.functional.scaled_mm (BlockWise1x128 /
BlockWise128x128); elsewhere `fp8_gemm` reproduces the kernel: one fp32 partial product per
128-wide slice of the reduction dim, multiplied by the two block scales, summed in fp32.
All dims must be multiples of 128.
"""
import torch
import torch.nn.functional as F
from torch import nn

BLOCK = 128
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


def act_quant(x, dtype=FP8):
    """x [R, C] -> (fp8 [R, C], s [R, C // 128]) with x ~= fp8 * s per 1x128 tile."""
    fmax = torch.finfo(dtype).max
    R, C = x.shape
    tiles = x.float().view(R, C // BLOCK, BLOCK) if x.is_contiguous() else \
        x.float().reshape(R, C // BLOCK, BLOCK)
    amax = tiles.abs().amax(dim=-1, keepdim=True).double()
    scale = (fmax / torch.clamp(amax, min=1e-12)).float()
    y = (tiles * scale).clamp(-fmax, fmax).to(dtype).view(R, C)
    return y, scale.reciprocal().squeeze(-1)


def weight_quant(w):
    """w [R, C] -> (fp8 [R, C], s [R // 128, C // 128]) per 128x128 block."""
    R, C = w.shape
    blocks = w.float().reshape(R // BLOCK, BLOCK, C // BLOCK, BLOCK)
    amax = blocks.abs().amax(dim=(1, 3), keepdim=True).double()
    scale = (FP8_MAX / torch.clamp(amax, min=1e-12)).float()
    y = (blocks * scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).reshape(R, C)
    return y, scale.reciprocal().reshape(R // BLOCK, C // BLOCK)


def fp8_gemm(a, a_s, b, b_s, out_dtype):
    """a [M, Kd] with a_s [M, Kd/128]; b [Kd, N] with b_s [Kd/128, N]."""
    M, Kd = a.shape
    out = torch.zeros(M, b.shape[1], dtype=torch.float32, device=a.device)
    for i in range(Kd // BLOCK):
        ks = slice(i * BLOCK, (i + 1) * BLOCK)
        partial = a[:, ks].float() @ b[ks, :].float()
        out += partial * a_s[:, i:i + 1] * b_s[i:i + 1, :]
    return out.to(out_dtype)


def _scale_128x128_for_cublas(s_kn):
    """[K/128, N/128] -> K-major, K/128 padded to a multiple of 4 (cuBLASLt layout)."""
    kb, nb = s_kn.shape
    padded = s_kn.new_ones(nb, (kb + 3) // 4 * 4).t()
    padded[:kb] = s_kn
    return padded


def _cuda_gemm(a, a_s, b, b_s, b_recipe, out_dtype):
    return F.scaled_mm(a, b, scale_a=a_s.t().contiguous().t(),
                       scale_recipe_a=F.ScalingType.BlockWise1x128,
                       scale_b=b_s, scale_recipe_b=b_recipe, output_dtype=out_dtype)


def linear_fwd(xq, xs, wq, ws, out_dtype):
    if xq.is_cuda:
        return _cuda_gemm(xq, xs, wq.t(), _scale_128x128_for_cublas(ws.t()),
                          F.ScalingType.BlockWise128x128, out_dtype)
    return fp8_gemm(xq, xs, wq.t(), ws.t().repeat_interleave(BLOCK, dim=1), out_dtype)


def linear_dgrad(gq, gs, wq, ws, out_dtype):
    if gq.is_cuda:
        return _cuda_gemm(gq, gs, wq.t().contiguous().t(), _scale_128x128_for_cublas(ws),
                          F.ScalingType.BlockWise128x128, out_dtype)
    return fp8_gemm(gq, gs, wq, ws.repeat_interleave(BLOCK, dim=1), out_dtype)


def linear_wgrad(gtq, gts, xtq, xts, out_dtype):
    if gtq.is_cuda:
        return _cuda_gemm(gtq, gts, xtq.t(), xts.t().contiguous().t(),
                          F.ScalingType.BlockWise1x128, out_dtype)
    return fp8_gemm(gtq, gts, xtq.t(), xts.t(), out_dtype)


class _BlockFp8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        xq, xs = act_quant(x)
        wq, ws = weight_quant(weight)
        return linear_fwd(xq, xs, wq, ws, x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        gq, gs = act_quant(dy)
        wq, ws = weight_quant(weight)
        dx = linear_dgrad(gq, gs, wq, ws, dy.dtype)
        gtq, gts = act_quant(dy.t())
        xq_b, xs_b = weight_quant(x)       # x as the RHS of a 1x128 x 128x128 GEMM
        dw = linear_dgrad(gtq, gts, xq_b, xs_b, dy.dtype)
        return dx, dw


def block_fp8_linear(x, weight):
    return _BlockFp8Linear.apply(x, weight)


class BlockFp8Linear(nn.Linear):
    def forward(self, x):
        y = _BlockFp8Linear.apply(x.reshape(-1, self.in_features), self.weight)
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    @classmethod
    def from_float(cls, mod):
        with torch.device("meta"):
            new = cls(mod.in_features, mod.out_features, bias=False)
        new.weight = mod.weight
        new.bias = mod.bias
        return new


def convert_block_fp8(model, **kwargs):
    if isinstance(model, nn.Linear) and not isinstance(model, BlockFp8Linear):
        return BlockFp8Linear.from_float(model)
    for name, child in list(model.named_children()):
        setattr(model, name, convert_block_fp8(child, **kwargs))
    return model
