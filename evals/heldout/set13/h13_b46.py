"""[planted bug: The 1x128 scales are handed to scaled_mm row-major instead of M-major (rejected once K spans more than one 128 block).]

Blockwise FP8 linear, converter form: ``convert_blockwise(module) -> module``.

Recipe: torchao 0.18 prototype.blockwise_fp8_training (DeepSeek-V3 1x128 / 128x128):
  forward      y  = q1x128(x)   @ q128x128(W).T
  grad_input   dx = q1x128(dy)  @ q128x128(W)
  grad_weight  dW = q1x128(dy.T) @ q128x1(x)      (both grouped along the token dim M)
Group scale: s = float32(448 / max(amax, 1e-12)) with the division in float64;
values e4m3(clamp(v * s, -448, 448)); GEMM scales are float32 1/s.  GEMMs write the
activation dtype (torchao: bf16).  On CUDA: torch.nn.functional.scaled_mm with the
BlockWise recipes and the scale layouts cuBLASLt wants (1x128 scales M-major, 128x128
scales K-major with the K-block count padded to a multiple of 4).  On other devices:
an emulated block GEMM, fp32 partial product per 128-wide K block, scaled, summed in
fp32.  The 128x128 weight quantisation is made once per forward, in the module, and
reused by the backward.
"""
import torch
import torch.nn.functional as F
from torch import nn

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
TILE = 128
_ST = getattr(F, "ScalingType", getattr(torch._C, "_ScalingType", None))


def _use_cublas(t):
    return t.is_cuda


def quantize(t, gr, gc):
    """(gr x gc) groups of a 2-D tensor -> (fp8 [R,C] row-major, inverse scales [R/gr, C/gc])."""
    r, c = t.shape
    blocks = t.float().reshape(r // gr, gr, c // gc, gc)
    amax = torch.amax(blocks.abs(), dim=3, keepdim=True).amax(dim=1, keepdim=True)
    s = (FP8_MAX / amax.to(torch.float64).clamp(min=1e-12)).to(torch.float32)
    q = (blocks * s).clamp(-FP8_MAX, FP8_MAX).to(FP8).reshape(r, c)
    return q, s.reciprocal().reshape(r // gr, c // gc)


def _k_major_padded(s):
    kb, nb = s.shape
    padded = torch.ones(nb, (kb + 3) // 4 * 4, dtype=s.dtype, device=s.device).t()
    padded[:kb, :] = s
    return padded


def block_gemm(a, sa, b, sb, rhs_blocks, dtype):
    """a [m,k] fp8, sa [m,k/128]; b [k,n] fp8 with sb [k/128, n/128] if rhs_blocks else [k/128, n]."""
    if _use_cublas(a):
        sa_cm = sa.contiguous()
        if rhs_blocks:
            return F.scaled_mm(a, b, sa_cm, _ST.BlockWise1x128, _k_major_padded(sb),
                               _ST.BlockWise128x128, output_dtype=dtype)
        return F.scaled_mm(a, b, sa_cm, _ST.BlockWise1x128, sb.t(), _ST.BlockWise1x128,
                           output_dtype=dtype)
    kblocks = a.shape[1] // TILE
    col_scale = sb.repeat_interleave(TILE, dim=1) if rhs_blocks else sb
    out = None
    for i in range(kblocks):
        ks = slice(i * TILE, (i + 1) * TILE)
        part = torch.mm(a[:, ks].float(), b[ks, :].float()) * sa[:, i:i + 1] * col_scale[i:i + 1]
        out = part if out is None else out + part
    return out.to(dtype)


class _Fn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, wq, ws):
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1]).contiguous()
        ctx.save_for_backward(x2, wq, ws)
        ctx.lead = lead
        xq, xs = quantize(x2, 1, TILE)
        y = block_gemm(xq, xs, wq.t(), ws.t(), True, x.dtype)
        return y.reshape(*lead, y.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        x2, wq, ws = ctx.saved_tensors
        d2 = dy.reshape(-1, dy.shape[-1]).contiguous()
        dq, ds = quantize(d2, 1, TILE)
        dx = block_gemm(dq, ds, wq.t().contiguous().t(), ws, True, d2.dtype)
        dtq, dts = quantize(d2.t().contiguous(), 1, TILE)
        xq, xs = quantize(x2, TILE, 1)
        dw = block_gemm(dtq, dts, xq.t().contiguous().t(), xs, False, d2.dtype)
        return dx.reshape(*ctx.lead, dx.shape[-1]), dw, None, None


class BlockwiseFp8Linear(nn.Module):
    def __init__(self, lin):
        super().__init__()
        self.in_features, self.out_features = lin.in_features, lin.out_features
        self.weight = lin.weight
        self.bias = lin.bias

    def forward(self, x):
        wq, ws = quantize(self.weight.detach().contiguous(), TILE, TILE)
        y = _Fn.apply(x, self.weight, wq, ws)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y


def convert_blockwise(module: nn.Module) -> nn.Module:
    if isinstance(module, nn.Linear):
        return BlockwiseFp8Linear(module)
    for name, child in list(module.named_children()):
        setattr(module, name, convert_blockwise(child))
    return module
