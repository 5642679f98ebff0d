"""Blockwise FP8 linear, nn.Linear drop-in (held-out set 15, correct twin c08).

Float8BlockwiseLinear.from_float(linear) mirrors torchao 0.18's prototype
Float8BlockwiseLinear (fp8_blockwise_mm) with torch.nn.functional.scaled_mm, and also
accepts a bias, fp16/fp32 inputs and non-contiguous tensors:

    activations and gradients: 1x128 tiles along the GEMM's inner dimension (e4m3)
    weight:                    128x128 blocks (e4m3)
    grad_weight's input:       128x1 groups along M, stored column-major

Scale tensors are fp32 with strides (1, rows); a 128x128-scaled B operand gets K-major
scales whose K-block count is padded to a multiple of 4 (padding 1.0).  On a CPU, where
torch 2.13 has no block-scaled GEMM, the failed call is followed by a float64 product of
the same fp8 operands and scales, rounded to bf16.
"""
import torch
import torch.nn.functional as F
from torch import nn

BLOCK = 128
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
EPS = 1e-12
TILE_1x128 = F.ScalingType.BlockWise1x128
BLOCK_128x128 = F.ScalingType.BlockWise128x128


def _strided_scales(s):
    out = torch.empty_strided((s.shape[0], s.shape[1]), (1, s.shape[0]), dtype=torch.float32, device=s.device)
    out.copy_(s)
    return out


def _act_quant_lhs(x):
    """x [R, C] -> fp8 [R, C] row-major, inverse scales [R, C/128] for 1x128 tiles."""
    R, C = x.shape
    t = x.to(torch.float32).contiguous().reshape(R, C // BLOCK, BLOCK)
    s = (FP8_MAX / t.abs().amax(dim=2, keepdim=True).to(torch.float64).clamp(min=EPS)).to(torch.float32)
    q = (t * s).clamp(-FP8_MAX, FP8_MAX).to(FP8).reshape(R, C)
    return q, _strided_scales(s.reciprocal().reshape(R, C // BLOCK))


def _act_quant_rhs(x):
    """x [M, K] -> fp8 [M, K] column-major, inverse scales [K, M/128] for 128x1 groups along M."""
    M, K = x.shape
    g = x.to(torch.float32).reshape(M // BLOCK, BLOCK, K)
    s = (FP8_MAX / g.abs().amax(dim=1, keepdim=True).to(torch.float64).clamp(min=EPS)).to(torch.float32)
    q = (g * s).clamp(-FP8_MAX, FP8_MAX).to(FP8).reshape(M, K)
    return q.t().contiguous().t(), _strided_scales(s.reciprocal().reshape(M // BLOCK, K).t())


def _weight_quant(w):
    """w [N, K] -> fp8 [N, K] row-major, inverse scales [N/128, K/128] for 128x128 blocks."""
    N, K = w.shape
    b = w.to(torch.float32).contiguous().reshape(N // BLOCK, BLOCK, K // BLOCK, BLOCK)
    s = (FP8_MAX / b.abs().amax(dim=(1, 3), keepdim=True).to(torch.float64).clamp(min=EPS)).to(torch.float32)
    q = (b * s).clamp(-FP8_MAX, FP8_MAX).to(FP8).reshape(N, K)
    return q, s.reciprocal().reshape(N // BLOCK, K // BLOCK)


def _pad_k_major(s):
    """Scales [Kb, Nb] of a 128x128 B operand -> [round_up(Kb, 4), Nb], strides (1, rows)."""
    kb, nb = s.shape
    rows = -(-kb // 4) * 4
    out = torch.empty_strided((rows, nb), (1, rows), dtype=torch.float32, device=s.device)
    out.fill_(1.0)
    out[:kb, :] = s
    return out


def _fallback_mm(a, sa, b, sb, recipe_b):
    """CPU stand-in for the block-scaled GEMM: float64 over 128-wide K blocks, then bf16."""
    M, K = a.shape
    N = b.shape[1]
    kb = K // BLOCK
    ok_a = b.shape[0] == K and K % BLOCK == 0 and tuple(sa.shape) == (M, kb)
    if recipe_b == BLOCK_128x128:
        ok_b = N % BLOCK == 0 and tuple(sb.shape) == (-(-kb // 4) * 4, N // BLOCK)
    else:
        ok_b = tuple(sb.shape) == (N, kb)
    if not (ok_a and ok_b):
        raise RuntimeError(f"invalid block-scaled operands: a {tuple(a.shape)} b {tuple(b.shape)} "
                           f"scale_a {tuple(sa.shape)} scale_b {tuple(sb.shape)}")
    if recipe_b == BLOCK_128x128:
        sb_k = sb[:kb].double().repeat_interleave(BLOCK, dim=1)     # [kb, N]
    else:
        sb_k = sb.double().t()                                       # [kb, N]
    sa_k = sa.double()
    a64 = a.double()
    b64 = b.double()
    acc = torch.zeros((M, N), dtype=torch.float64, device=a.device)
    for k in range(kb):
        ks = slice(k * BLOCK, (k + 1) * BLOCK)
        acc += (a64[:, ks] @ b64[ks, :]) * (sa_k[:, k:k + 1] * sb_k[k:k + 1, :])
    return acc.to(torch.bfloat16)


def _scaled_mm_blockwise(a, sa, b, sb, recipe_b):
    try:
        return F.scaled_mm(a, b, scale_a=sa, scale_recipe_a=TILE_1x128, scale_b=sb,
                           scale_recipe_b=recipe_b, output_dtype=torch.bfloat16)
    except (RuntimeError, ValueError, NotImplementedError):
        if not a.is_cpu:
            raise
        return _fallback_mm(a, sa, b, sb, recipe_b)


class _Fp8BlockwiseMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight):
        x2 = x.reshape(-1, x.shape[-1])
        xq, xs = _act_quant_lhs(x2)
        wq, ws = _weight_quant(weight)
        out = _scaled_mm_blockwise(xq, xs, wq.t(), _pad_k_major(ws.t()), BLOCK_128x128)
        ctx.save_for_backward(x, weight)
        return out.reshape(*x.shape[:-1], out.shape[-1]).to(x.dtype)

    @staticmethod
    def backward(ctx, grad_output):
        x, weight = ctx.saved_tensors
        go = grad_output.reshape(-1, grad_output.shape[-1])
        x2 = x.reshape(-1, x.shape[-1])

        goq, gos = _act_quant_lhs(go)
        wq, ws = _weight_quant(weight)
        grad_x = _scaled_mm_blockwise(goq, gos, wq.t().contiguous().t(), _pad_k_major(ws), BLOCK_128x128)

        got_q, got_s = _act_quant_lhs(go.t())
        xq, xs = _act_quant_rhs(x2)
        grad_w = _scaled_mm_blockwise(got_q, got_s, xq, xs, TILE_1x128)

        grad_x = grad_x.reshape(*grad_output.shape[:-1], grad_x.shape[-1])
        return grad_x.to(grad_output.dtype), grad_w.to(grad_output.dtype)


class Float8BlockwiseLinear(nn.Linear):
    """nn.Linear with 1x128 / 128x128 block-scaled FP8 GEMMs (dims multiples of 128)."""

    def forward(self, x):
        y = _Fp8BlockwiseMM.apply(x, self.weight)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y

    @classmethod
    def from_float(cls, mod):
        with torch.device("meta"):
            new = cls(mod.in_features, mod.out_features, bias=False)
        new.weight = mod.weight
        new.bias = mod.bias
        return new
