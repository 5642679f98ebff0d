"""[planted bug: The weight is rounded to bf16 before its forward 128x128 quantization, so an fp32 master weight is quantized from a bf16 copy.]

Blockwise FP8 training, converter form: ``swap_to_blockwise_fp8(model)``.

Swaps every nn.Linear (or the module itself) for ``_BlockFP8Linear``, which follows
torchao 0.18's ``prototype.blockwise_fp8_training`` (1x128 activation and gradient tiles,
128x128 weight blocks, all e4m3, bf16 GEMM output):

    forward:   out = act_quant(x)[1x128]                 @ weight_quant_t(w)[128x128, K-major]
    backward:  dx  = act_quant(dy)[1x128]                @ weight_quant(w)[128x128, K-major]
               dw  = act_quant(dy.T)[1x128 along M]      @ act_quant_rhs(x)[128x1 along M]

The helpers mirror torchao's kernels one to one (``act_quant`` ~ act_quant_lhs,
``act_quant_rhs``, ``weight_quant`` / ``weight_quant_t`` ~ weight_quant_[transposed_]rhs):
scale = float32(448 / max(amax, 1e-12) computed in float64); data =
clamp(t.float() * scale, -448, 448) in e4m3; the GEMM gets 1 / scale.  Helpers return the
inverse scales row-major; every call site puts them into the layout ``scaled_mm`` wants:
``_col_major`` (strides exactly (1, rows), via empty_strided + copy_, also when a dim is 1)
for 1x128 scales and ``_k_major_padded`` (K-block rows padded to a multiple of 4, ones in
the padding) for 128x128 scales of the right operand.

On devices without block-scaled ``scaled_mm`` (CPU in torch 2.13) the same call is emulated
in float64 from the same fp8 operands and scales.  Output: bf16 GEMM, cast to the input
dtype; bias added after, in the output dtype.
"""
import torch
import torch.nn.functional as F
from torch import nn

E4M3 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(E4M3).max
EPS = 1e-12
TILE = 128

_SCALING = getattr(F, "ScalingType", None) or getattr(torch._C, "_ScalingType")
TILE_1x128 = _SCALING.BlockWise1x128
BLOCK_128x128 = _SCALING.BlockWise128x128


def _fp8_scale(amax):
    return (FP8_MAX / torch.clamp(amax.to(torch.float64), min=EPS)).to(torch.float32)


def _saturate(t, scale):
    return (t * scale).clamp(min=-FP8_MAX, max=FP8_MAX).to(E4M3)


@torch.no_grad()
def act_quant(t):
    """[m, k] -> (e4m3 [m, k] row-major, inverse scales [m, k/128] row-major)."""
    m, k = t.shape
    tiles = t.reshape(m, k // TILE, TILE).to(torch.float32)
    scale = _fp8_scale(torch.amax(tiles.abs(), dim=2, keepdim=True))
    return _saturate(tiles, scale).reshape(m, k).contiguous(), (1.0 / scale).reshape(m, k // TILE)


@torch.no_grad()
def act_quant_rhs(t):
    """[m, k] -> (e4m3 [m, k] column-major, inverse scales [m/128, k]); groups of 128 rows."""
    m, k = t.shape
    groups = t.reshape(m // TILE, TILE, k).to(torch.float32)
    scale = _fp8_scale(torch.amax(groups.abs(), dim=1, keepdim=True))
    data = _saturate(groups, scale).reshape(m, k)
    return data.t().contiguous().t(), (1.0 / scale).reshape(m // TILE, k)


@torch.no_grad()
def weight_quant(w):
    """[n, k] -> (e4m3 [n, k] column-major, inverse scales [n/128, k/128])."""
    n, k = w.shape
    blocks = w.reshape(n // TILE, TILE, k // TILE, TILE).to(torch.float32)
    scale = _fp8_scale(torch.amax(blocks.abs(), dim=(1, 3), keepdim=True))
    data = _saturate(blocks, scale).reshape(n, k).contiguous()
    return data.t().contiguous().t(), (1.0 / scale).reshape(n // TILE, k // TILE)


@torch.no_grad()
def weight_quant_t(w):
    """[n, k] -> (e4m3 w.T [k, n] column-major, inverse scales [k/128, n/128])."""
    n, k = w.shape
    blocks = w.reshape(n // TILE, TILE, k // TILE, TILE).to(torch.float32)
    scale = _fp8_scale(torch.amax(blocks.abs(), dim=(1, 3), keepdim=True))
    data = _saturate(blocks, scale).reshape(n, k).contiguous()
    return data.t(), (1.0 / scale).reshape(n // TILE, k // TILE).t()


def _col_major(s):
    out = torch.empty_strided(tuple(s.shape), (1, s.shape[0]), dtype=torch.float32, device=s.device)
    return out.copy_(s)


def _k_major_padded(s):
    kb, nb = s.shape
    rows = -(-kb // 4) * 4
    out = torch.empty_strided((rows, nb), (1, rows), dtype=torch.float32, device=s.device)
    out.fill_(1.0)
    out[:kb].copy_(s)
    return out


def _dequant_factors(s, recipe, shape, lhs):
    rows, cols = shape
    if recipe == TILE_1x128:
        return s.repeat_interleave(TILE, 1) if lhs else s.t().repeat_interleave(TILE, 0)
    grid = s[: cols // TILE].t() if lhs else s[: rows // TILE]
    return grid.repeat_interleave(TILE, 0).repeat_interleave(TILE, 1)


def _gemm(a, sa, ra, b, sb, rb):
    """bf16 = a @ b with block scales; float64 emulation where the device has no kernel."""
    try:
        return F.scaled_mm(a, b, sa, ra, sb, rb, output_dtype=torch.bfloat16)
    except (RuntimeError, ValueError, NotImplementedError):
        if a.is_cuda:
            raise
    a64 = a.to(torch.float64) * _dequant_factors(sa, ra, a.shape, True).to(torch.float64)
    b64 = b.to(torch.float64) * _dequant_factors(sb, rb, b.shape, False).to(torch.float64)
    return (a64 @ b64).to(torch.bfloat16)


class _BlockFP8Fn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        x2 = x.reshape(-1, x.shape[-1])
        xq, xs = act_quant(x2)
        wq_t, ws_t = weight_quant_t(weight.to(torch.bfloat16))
        y = _gemm(xq, _col_major(xs), TILE_1x128, wq_t, _k_major_padded(ws_t), BLOCK_128x128)
        return y.to(x.dtype).reshape(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1])
        x2 = x.reshape(-1, x.shape[-1])
        gq, gs = act_quant(dy2)
        wq, ws = weight_quant(weight)
        dx = _gemm(gq, _col_major(gs), TILE_1x128, wq, _k_major_padded(ws), BLOCK_128x128)
        gtq, gts = act_quant(dy2.t())
        xq, xs = act_quant_rhs(x2)
        dw = _gemm(gtq, _col_major(gts), TILE_1x128, xq, _col_major(xs.t()), TILE_1x128)
        return dx.reshape(*dy.shape[:-1], x.shape[-1]), dw


class _BlockFP8Linear(nn.Linear):
    def forward(self, x):
        y = _BlockFP8Fn.apply(x, self.weight)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y


def swap_to_blockwise_fp8(model: nn.Module, **kwargs) -> nn.Module:
    """Replace nn.Linear layers (dims multiples of 128) by blockwise FP8 linears."""
    if type(model) is nn.Linear:
        with torch.device("meta"):
            new = _BlockFP8Linear(model.in_features, model.out_features, bias=False)
        new.weight = model.weight
        new.bias = model.bias
        return new
    for name, child in list(model.named_children()):
        setattr(model, name, swap_to_blockwise_fp8(child, **kwargs))
    return model
