"""[planted bug: An Inf is not treated as NaN: the block gets the exponent of an infinite amax (clamped), the Inf saturates to 448 and the output row becomes huge or inf instead of NaN.]
(twin: s16_c03; recipe mxfp8_floor)"""
from collections import namedtuple

import torch
import torch.nn as nn
import torch.nn.functional as F

MXData = namedtuple("MXData", ["data", "scale"])  # data e4m3 [rows, k], scale uint8 [rows, k // 32]

_BS = 32
_MAX = 448.0
_EMAX_E4M3 = 8


def _floor_exponent(amax):
    """e = floor(log2(amax)) - 8 from the exponent field, clamped to [-127, 127]; amax == 0 -> -127."""
    field = (amax.contiguous().view(torch.int32) >> 23) & 0xFF
    # a subnormal or zero amax has floor(log2) <= -127, which clamps to -127 anyway
    e = torch.where(field == 0, torch.full_like(field, -127), field - 127 - _EMAX_E4M3)
    return e.clamp(-127, 127)


def _scale_value(e):
    # 2**e in float32; e >= -126 is a normal number, -127 the largest subnormal power of two
    return torch.where(e > -127, ((e + 127) << 23), torch.full_like(e, 1 << 22)).view(torch.float32)


def mx_quantize(x):
    """Blocks of 32 along the last dimension of a 2-D tensor."""
    r, c = x.shape
    v = x.float().view(r, c // _BS, _BS) if x.is_contiguous() else x.float().reshape(r, c // _BS, _BS)
    amax = v.abs().amax(-1, keepdim=True)
    nonfinite = amax.isnan()
    e = _floor_exponent(amax)
    q = (v / _scale_value(e)).clamp(-_MAX, _MAX)
    q = torch.where(nonfinite, float("nan"), q)
    scale = torch.where(nonfinite, 255, e + 127).to(torch.uint8)
    return MXData(q.to(torch.float8_e4m3fn).view(r, c), scale.view(r, c // _BS))


def _to_blocked(scale):
    rows, cols = scale.shape
    n_rt, n_ct = (rows + 127) // 128, (cols + 3) // 4
    full = torch.zeros(n_rt * 128, n_ct * 4, dtype=torch.uint8, device=scale.device)
    full[:rows, :cols] = scale
    # element (r, c) of tile (i, j) -> byte (r % 32) * 16 + (r // 32) * 4 + c of the tile
    blocked = full.view(n_rt, 4, 32, n_ct, 4).permute(0, 3, 2, 1, 4).contiguous()
    return blocked.view(-1).view(torch.float8_e8m0fnu)


def _mx_gemm(a: MXData, b_rows: MXData, out_dtype):
    """a: [m, k] blocks along k; b_rows: the B operand stored as its [n, k] transpose, blocks along k."""
    return F.scaled_mm(
        a.data,
        b_rows.data.t(),
        _to_blocked(a.scale),
        F.ScalingType.BlockWise1x32,
        _to_blocked(b_rows.scale),
        F.ScalingType.BlockWise1x32,
        swizzle_a=F.SwizzleType.SWIZZLE_32_4_4,
        swizzle_b=F.SwizzleType.SWIZZLE_32_4_4,
        output_dtype=out_dtype,
    )


class _MXFloorMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2d, weight):
        ctx.save_for_backward(x2d, weight)
        return _mx_gemm(mx_quantize(x2d), mx_quantize(weight), x2d.dtype)

    @staticmethod
    def backward(ctx, dy):
        x2d, weight = ctx.saved_tensors
        dy = dy.contiguous()
        dy_t = dy.t().contiguous()
        # grad_weight first: dy.T [N, M] x x2d [M, K], blocks along M
        dw = _mx_gemm(mx_quantize(dy_t), mx_quantize(x2d.t().contiguous()), weight.dtype)
        # grad_input: dy [M, N] x weight [N, K], blocks along N
        dx = _mx_gemm(mx_quantize(dy), mx_quantize(weight.t().contiguous()), x2d.dtype)
        return dx, dw


class MXFP8FloorLinear(nn.Linear):
    """nn.Linear whose three GEMMs run in MXFP8 with FLOOR scales."""

    @classmethod
    def from_float(cls, linear):
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features = linear.in_features
        new.out_features = linear.out_features
        new.weight = linear.weight
        new.bias = linear.bias
        return new

    def forward(self, x):
        lead = x.shape[:-1]
        y = _MXFloorMM.apply(x.reshape(-1, self.in_features), self.weight)
        y = y.view(*lead, self.out_features)
        if self.bias is not None:
            y = y + self.bias
        return y
