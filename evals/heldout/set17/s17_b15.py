"""[planted bug: The weight's per-tensor scale is computed once and cached; after an in-place update the stale global clips the grown blocks (e4m3 scale saturates at 448).]
(twin: s17_c03; recipe nvfp4)"""
import torch
import torch.nn as nn
import torch.nn.functional as F

_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def nvfp4_global(t):
    """Per-tensor decode scale: amax / (448 * 6); 1.0 when the tensor is all zero."""
    amax = t.detach().float().abs().amax()
    return torch.where(amax > 0, amax / 2688.0, torch.ones_like(amax))


def _round_e2m1(mag):
    mag = mag.clamp(max=6.0)
    fine = torch.round(mag * 2.0) / 2.0  # [0, 2): step 0.5
    mid = torch.round(mag)  # [2, 4): step 1
    coarse = torch.round(mag / 2.0) * 2.0  # [4, 6]: step 2
    return torch.where(mag < 2.0, fine, torch.where(mag < 4.0, mid, coarse))


def _blocked(scales_u8):
    rows, cols = scales_u8.shape
    pr, pc = -(-rows // 128) * 128, -(-cols // 4) * 4
    z = scales_u8.new_zeros(pr, pc)
    z[:rows, :cols] = scales_u8
    return z.view(pr // 128, 4, 32, pc // 4, 4).permute(0, 3, 2, 1, 4).reshape(-1)


def quantize(t, g=None, blocked=True):
    """t [rows, k], blocks of 16 along k. Returns (fp4x2 data [rows, k/2], e4m3 scales, fp32 global);
    the scales come in the blocked (swizzled) layout, or as [rows, k/16] with blocked=False."""
    rows, k = t.shape
    if g is None:
        g = nvfp4_global(t)
    x = t.float().reshape(rows, k // 16, 16)
    s = (x.abs().amax(-1) / 6.0 / g).clamp(max=448.0).to(torch.float8_e4m3fn)
    d = s.float() * g
    y = x / torch.where(d == 0, 1.0, d).unsqueeze(-1)
    y = torch.where((d == 0).unsqueeze(-1), 0.0, y)
    grid = torch.tensor(_GRID, device=t.device)
    codes = torch.searchsorted(grid, _round_e2m1(y.abs()).contiguous())
    codes = (codes + 8 * torch.signbit(y).long()).to(torch.uint8).reshape(rows, k)
    data = (codes[:, 0::2] + codes[:, 1::2] * 16).view(torch.float4_e2m1fn_x2)
    s_u8 = s.view(torch.uint8)
    scales = _blocked(s_u8) if blocked else s_u8.reshape(-1)
    return data, scales.view(torch.float8_e4m3fn), g


def _gemm(a, b_nk, out_dtype):
    return F.scaled_mm(
        a[0],
        b_nk[0].t(),
        [a[1], a[2]],
        [F.ScalingType.BlockWise1x16, F.ScalingType.TensorWise],
        [b_nk[1], b_nk[2]],
        [F.ScalingType.BlockWise1x16, F.ScalingType.TensorWise],
        swizzle_a=[F.SwizzleType.SWIZZLE_32_4_4, F.SwizzleType.NO_SWIZZLE],
        swizzle_b=[F.SwizzleType.SWIZZLE_32_4_4, F.SwizzleType.NO_SWIZZLE],
        output_dtype=out_dtype,
    )


class _NVFP4Fn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2d, w, bias, w_global):
        ctx.save_for_backward(x2d, w, w_global)
        ctx.has_bias = bias is not None
        y = _gemm(quantize(x2d), quantize(w, w_global), x2d.dtype)
        return y if bias is None else y + bias.to(y.dtype)

    @staticmethod
    def backward(ctx, gy):
        x2d, w, w_global = ctx.saved_tensors
        gy = gy.contiguous()
        gyt = gy.t().contiguous()
        gw = _gemm(quantize(gyt), quantize(x2d.t().contiguous()), w.dtype)
        gx = _gemm(quantize(gy), quantize(w.t().contiguous(), w_global), x2d.dtype)
        gb = gy.sum(0) if ctx.has_bias else None
        return gx, gw, gb, None


class NVFP4Linear(nn.Linear):
    @classmethod
    def from_float(cls, linear):
        mod = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta")
        mod.weight = linear.weight
        if linear.bias is not None:
            mod.bias = linear.bias
        return mod

    def forward(self, x):
        if getattr(self, "_w_global", None) is None:  # the weight amax only changes at the optimizer step
            self._w_global = nvfp4_global(self.weight)
        w_global = self._w_global
        y = _NVFP4Fn.apply(x.reshape(-1, self.in_features), self.weight, self.bias, w_global)
        return y.reshape(*x.shape[:-1], self.out_features)
