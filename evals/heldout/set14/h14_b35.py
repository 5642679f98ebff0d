"""[planted bug: The blockwise output keeps the GEMM's bf16 dtype (as the torchao prototype does) instead of the input dtype.]

Blockwise FP8 linear (DeepSeek-V3 style), module form: ``BlockwiseFloat8Linear.from_float``.

Semantics of torchao 0.18's ``prototype.blockwise_fp8_training`` (``fp8_blockwise_mm``):

    output      = x8 [M,K] (1x128 tiles along K)   @ w8.T [K,N] (128x128 blocks)
    grad_input  = g8 [M,N] (1x128 tiles along N)   @ w8   [N,K] (128x128 blocks)
    grad_weight = g8t [N,M] (1x128 tiles along M)  @ x8   [M,K] (128x1 groups along M)

Everything is e4m3.  Per tile / block: ``scale = fp32(448 / max(amax, 1e-12) in float64)``,
``q = clamp(t.float() * scale, -448, 448).to(e4m3)``, and the GEMM gets the float32
reciprocal ``1 / scale``.  GEMMs produce bf16 (the prototype's ``out_dtype``) with plain
(slow) accumulation; the result is cast to the activation dtype, the bias (torchao's
prototype has none) is added afterwards in that dtype.  All dims must be multiples of 128.

GEMMs go through ``torch.nn.functional.scaled_mm`` with BlockWise1x128 / BlockWise128x128
recipes, whose SM90 contract is strict about scale layouts:

* 1x128 scales of an [m, k] operand: shape [m, k/128], strides exactly (1, m);
* 128x128 scales of the [k, n] right operand: shape [round_up(k/128, 4), n/128] (K-block
  dimension padded to a multiple of 4), strides exactly (1, rows);
* A row-major, B column-major.

Scales are therefore built with ``torch.empty_strided`` + ``copy_`` (``.t().contiguous().t()``
does not give those strides when a dimension is 1).  Where the device has no block-scaled
GEMM (torch 2.13 on CPU raises) the same call is emulated in float64 from the very same
fp8 operands and scales, then rounded to the output dtype.
"""
import torch
import torch.nn.functional as F
from torch import nn

E4M3 = torch.float8_e4m3fn
FMAX = torch.finfo(E4M3).max
EPS = 1e-12
BLOCK = 128

_ST = getattr(F, "ScalingType", None) or getattr(torch._C, "_ScalingType")
BW1x128 = _ST.BlockWise1x128
BW128x128 = _ST.BlockWise128x128


def _scale_from_amax(amax):
    return (FMAX / torch.clamp(amax.to(torch.float64), min=EPS)).to(torch.float32)


def _col_major(s):
    """2-D float32 scale in column-major storage: strides exactly (1, rows)."""
    out = torch.empty_strided(tuple(s.shape), (1, s.shape[0]), dtype=torch.float32, device=s.device)
    out.copy_(s)
    return out


def _pad_k_blocks(s):
    """128x128 scale of the right operand, [kb, nb] -> [round_up(kb, 4), nb], K-major."""
    kb, nb = s.shape
    l4 = (kb + 3) // 4 * 4
    out = torch.empty_strided((l4, nb), (1, l4), dtype=torch.float32, device=s.device)
    out.fill_(1.0)
    out[:kb].copy_(s)
    return out


@torch.no_grad()
def _quant_1x128(t):
    """[m, k] -> fp8 [m, k] row-major (whatever the layout of ``t``), inverse scales
    [m, k/128] column-major."""
    m, k = t.shape
    tiles = t.reshape(m, k // BLOCK, BLOCK).to(torch.float32)
    scale = _scale_from_amax(tiles.abs().amax(dim=-1, keepdim=True))
    data = (tiles * scale).clamp(min=-FMAX, max=FMAX).to(E4M3).reshape(m, k).contiguous()
    return data, _col_major((1.0 / scale).reshape(m, k // BLOCK))


@torch.no_grad()
def _quant_128x1(t):
    """[m, k] -> fp8 [m, k] column-major with one scale per 128 rows of each column;
    inverse scales returned as the right operand's [k, m/128], column-major."""
    m, k = t.shape
    groups = t.reshape(m // BLOCK, BLOCK, k).to(torch.float32)
    scale = _scale_from_amax(groups.abs().amax(dim=1, keepdim=True))
    data = (groups * scale).clamp(min=-FMAX, max=FMAX).to(E4M3).reshape(m, k)
    inv = (1.0 / scale).reshape(m // BLOCK, k)
    return data.t().contiguous().t(), _col_major(inv.t())


@torch.no_grad()
def _quant_128x128(w):
    """[r, c] -> fp8 [r, c] (contiguous), inverse scales [r/128, c/128]."""
    r, c = w.shape
    blocks = w.reshape(r // BLOCK, BLOCK, c // BLOCK, BLOCK).to(torch.float32)
    scale = _scale_from_amax(blocks.abs().amax(dim=(1, 3), keepdim=True))
    data = (blocks * scale).clamp(min=-FMAX, max=FMAX).to(E4M3).reshape(r, c).contiguous()
    return data, (1.0 / scale).reshape(r // BLOCK, c // BLOCK)


def _expand(s, recipe, rows, cols, lhs):
    """Per-element dequantization factors of an operand [rows, cols]."""
    if recipe == BW1x128:
        return s.repeat_interleave(BLOCK, 1) if lhs else s.t().repeat_interleave(BLOCK, 0)
    grid = s[: cols // BLOCK].t() if lhs else s[: rows // BLOCK]
    return grid.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)


def _emulated_block_mm(a, sa, ra, b, sb, rb, out_dtype):
    m, k = a.shape
    n = b.shape[1]
    a64 = a.to(torch.float64) * _expand(sa, ra, m, k, True).to(torch.float64)
    b64 = b.to(torch.float64) * _expand(sb, rb, k, n, False).to(torch.float64)
    return (a64 @ b64).to(out_dtype)


def _block_mm(a, sa, ra, b, sb, rb, out_dtype=torch.bfloat16):
    try:
        return F.scaled_mm(a, b, sa, ra, sb, rb, output_dtype=out_dtype)
    except (RuntimeError, ValueError, NotImplementedError):
        if a.is_cuda:
            raise
    return _emulated_block_mm(a, sa, ra, b, sb, rb, out_dtype)


class _BlockwiseMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        k = x.shape[-1]
        x8, sx = _quant_1x128(x.reshape(-1, k))
        w8, sw = _quant_128x128(weight)                    # [N,K], [N/128, K/128]
        out = _block_mm(x8, sx, BW1x128, w8.t(), _pad_k_blocks(sw.t()), BW128x128)
        return out.reshape(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        k, n = x.shape[-1], grad_out.shape[-1]
        g2 = grad_out.reshape(-1, n)
        # grad_input = grad_output @ weight: 1x128 along N, weight blocks K-major along N
        g8, sg = _quant_1x128(g2)
        w8, sw = _quant_128x128(weight)
        grad_x = _block_mm(g8, sg, BW1x128, w8.t().contiguous().t(), _pad_k_blocks(sw), BW128x128)
        # grad_weight = grad_output.T @ input: both 1x128 along M
        gt8, sgt = _quant_1x128(g2.t())
        x8, sx = _quant_128x1(x.reshape(-1, k))
        grad_w = _block_mm(gt8, sgt, BW1x128, x8, sx, BW1x128)
        return grad_x.reshape(*grad_out.shape[:-1], k), grad_w


class BlockwiseFloat8Linear(nn.Linear):
    """nn.Linear with DeepSeek-V3 style 1x128 / 128x128 blockwise FP8 GEMMs."""

    def forward(self, x):
        out = _BlockwiseMatmul.apply(x, self.weight)
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out

    @classmethod
    def from_float(cls, mod):
        if mod.in_features % BLOCK or mod.out_features % BLOCK:
            raise ValueError("blockwise FP8 needs in/out features divisible by 128")
        with torch.device("meta"):
            new = cls(mod.in_features, mod.out_features, bias=False)
        new.weight = mod.weight
        new.bias = mod.bias
        return new
