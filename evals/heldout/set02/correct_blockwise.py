"""Reference FP8 linear, DeepSeek-V3 style blockwise scaling (held-out set, correct).

  activations and gradients: 1x128 tiles (one scale per row and 128 consecutive elements of
  the GEMM's inner dimension); weights: 128x128 blocks; e4m3 everywhere; exact scales
  scale = 448 / max(amax, 1e-12) (float64 -> float32), the GEMMs take 1/scale.
    output      = x[M,K] (1x128 along K)          @ W.T[K,N] (128x128)
    grad_input  = grad_out[M,N] (1x128 along N)   @ W[N,K]   (128x128)
    grad_weight = grad_out.T[N,M] (1x128 along M) @ x[M,K]   (128x1, i.e. 1x128 along M)
On CUDA (SM90) the GEMMs go through torch.nn.functional.scaled_mm with BlockWise1x128 /
BlockWise128x128 scales (A scales [rows, K/128] stored row-index-major; 128x128 scales of B
[K/128 padded to a multiple of 4, N/128] stored K-major; 1x128 scales of B [N, K/128] stored
N-major). On a CPU no kernel takes block scales, so the GEMM is emulated: fp32 partial
products per 128-wide slice of the inner dimension, scaled by the two block scales and summed
in fp32, then cast to the result dtype. All dims must be multiples of 128.
"""
import torch
import torch.nn.functional as F
from torch import nn

BLOCK = 128
FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
EPS = 1e-12


def act_quant(t: torch.Tensor):
    """1x128 tiles along the last dim of a 2-D tensor -> (fp8 [R,C] row-major, 1/scale [R, C/128])."""
    R, C = t.shape
    v = t.float().reshape(R, C // BLOCK, BLOCK)
    amax = v.abs().amax(dim=-1, keepdim=True).double().clamp(min=EPS)
    scale = (FP8_MAX / amax).float()
    q = (v * scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).reshape(R, C)
    return q, scale.reciprocal().squeeze(-1)


def weight_quant(w: torch.Tensor):
    """128x128 blocks -> (fp8 [R,C] row-major, 1/scale [R/128, C/128])."""
    R, C = w.shape
    v = w.float().reshape(R // BLOCK, BLOCK, C // BLOCK, BLOCK)
    amax = v.abs().amax(dim=(1, 3), keepdim=True).double().clamp(min=EPS)
    scale = (FP8_MAX / amax).float()
    q = (v * scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).reshape(R, C)
    return q, scale.reciprocal().reshape(R // BLOCK, C // BLOCK)


def _emulated_gemm(a, a_s, b, b_s, out_dtype):
    """a [M,Kd] fp8 with a_s [M, Kd/128]; b [Kd,N] fp8 with b_s [Kd/128, N] (per k-block, per column)."""
    acc = torch.zeros(a.shape[0], b.shape[1], dtype=torch.float32, device=a.device)
    for kb in range(a.shape[1] // BLOCK):
        k = slice(kb * BLOCK, (kb + 1) * BLOCK)
        part = a[:, k].float() @ b[k, :].float()
        acc += part * a_s[:, kb:kb + 1] * b_s[kb:kb + 1, :]
    return acc.to(out_dtype)


def _mn_major(s):
    """[rows, blocks] scales stored with the row index contiguous."""
    return s.t().contiguous().t()


def _k_major_padded(s):
    """128x128 scales of B as [Kblocks, Nblocks], Kblocks contiguous, padded to a multiple of 4."""
    kb, nb = s.shape
    kb_pad = (kb + 3) // 4 * 4
    out = s.new_ones(nb, kb_pad).t()
    out[:kb] = s
    return out


def _gpu_gemm(a, a_s, b, b_s, recipe_b, out_dtype):
    return F.scaled_mm(a, b, scale_a=_mn_major(a_s), scale_recipe_a=F.ScalingType.BlockWise1x128,
                       scale_b=b_s, scale_recipe_b=recipe_b, output_dtype=out_dtype)


def gemm_output(xq, xs, wq, ws, out_dtype):
    if xq.is_cuda:
        return _gpu_gemm(xq, xs, wq.t(), _k_major_padded(ws.t()), F.ScalingType.BlockWise128x128, out_dtype)
    return _emulated_gemm(xq, xs, wq.t(), ws.t().repeat_interleave(BLOCK, dim=1), out_dtype)


def gemm_grad_input(gq, gs, wq, ws, out_dtype):
    if gq.is_cuda:
        return _gpu_gemm(gq, gs, wq.t().contiguous().t(), _k_major_padded(ws),
                         F.ScalingType.BlockWise128x128, out_dtype)
    return _emulated_gemm(gq, gs, wq, ws.repeat_interleave(BLOCK, dim=1), out_dtype)


def gemm_grad_weight(gtq, gts, xtq, xts, out_dtype):
    """gtq [N,M] with gts [N, M/128]; xtq [K,M] with xts [K, M/128] (x tiled along M)."""
    if gtq.is_cuda:
        return _gpu_gemm(gtq, gts, xtq.t(), _mn_major(xts), F.ScalingType.BlockWise1x128, out_dtype)
    return _emulated_gemm(gtq, gts, xtq.t(), xts.t(), out_dtype)


class _BlockwiseMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        xq, xs = act_quant(x)
        wq, ws = weight_quant(w)
        return gemm_output(xq, xs, wq, ws, x.dtype)

    @staticmethod
    def backward(ctx, go):
        x, w = ctx.saved_tensors
        gq, gs = act_quant(go)
        wq, ws = weight_quant(w)
        dx = gemm_grad_input(gq, gs, wq, ws, go.dtype)
        gtq, gts = act_quant(go.t())
        xtq, xts = act_quant(x.t())
        dw = gemm_grad_weight(gtq, gts, xtq, xts, go.dtype)
        return dx, dw


def fp8_linear(x2d, weight):
    return _BlockwiseMM.apply(x2d, weight)


class BlockwiseFp8Linear(nn.Linear):
    def forward(self, x):
        y = _BlockwiseMM.apply(x.reshape(-1, x.shape[-1]), self.weight)
        y = y.reshape(*x.shape[:-1], y.shape[-1])
        return y if self.bias is None else y + self.bias.to(y.dtype)

    @classmethod
    def from_float(cls, lin):
        with torch.device("meta"):
            m = cls(lin.in_features, lin.out_features, bias=False)
        m.weight, m.bias = lin.weight, lin.bias
        return m


def convert(module, **kwargs):
    if isinstance(module, nn.Linear) and not isinstance(module, BlockwiseFp8Linear):
        return BlockwiseFp8Linear.from_float(module)
    for n, c in list(module.named_children()):
        setattr(module, n, convert(c, **kwargs))
    return module
