"""Rowwise FP8 linear built on a tiny fp8 tensor wrapper that carries its scale and the
axis its amax was reduced over, so quantized tensors can be reused across GEMMs when
their scaling axis already matches what the GEMM needs."""
from dataclasses import dataclass

import torch

E4M3 = torch.float8_e4m3fn


@dataclass
class AxisFp8:
    data: torch.Tensor      # fp8
    scale: torch.Tensor     # keepdim-shaped; hp = data / scale
    axis: int               # dim reduced when computing amax (0 or -1)

    @staticmethod
    def quantize(hp, axis):
        fmax = torch.finfo(E4M3).max
        amax = hp.abs().amax(dim=axis, keepdim=True).double().clamp(min=1e-12)
        scale = torch.exp2(torch.floor(torch.log2((fmax / amax).float())))
        return AxisFp8((hp.float() * scale).clamp(-fmax, fmax).to(E4M3), scale, axis)

    def t(self):
        return AxisFp8(self.data.t(), self.scale.t(), self.axis)


def _mm(a: torch.Tensor, a_scale, b: torch.Tensor, b_scale, out_dtype, fast):
    a = a if a.stride(1) == 1 else a.contiguous()
    b = b if b.stride(0) == 1 else b.t().contiguous().t()
    mm_dtype = torch.bfloat16 if out_dtype in (torch.float16, torch.float32) else out_dtype
    if fast:
        out = torch._scaled_mm(a, b, scale_a=a_scale.reciprocal(), scale_b=b_scale.reciprocal(),
                               out_dtype=mm_dtype, use_fast_accum=True)
    else:
        ones = a_scale.new_ones(())
        out = torch._scaled_mm(a, b, scale_a=ones, scale_b=ones, out_dtype=mm_dtype)
        out *= a_scale.reciprocal() * b_scale.reciprocal()
    return out.to(out_dtype)


class AxisFp8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        x8 = AxisFp8.quantize(x, -1)           # [M,K], scales [M,1]
        w8t = AxisFp8.quantize(w, -1).t()      # [K,N], scales [1,N]
        ctx.save_for_backward(x, w)
        ctx.w8t = w8t
        return _mm(x8.data, x8.scale, w8t.data, w8t.scale, x.dtype, True)

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        dy8 = AxisFp8.quantize(dy, -1)
        # grad_input = dy @ W needs W scaled along N. If the forward copy of W.T was
        # already scaled along its last dim (N), reuse it instead of casting W again.
        w8t = ctx.w8t
        if w8t.axis == -1 and w8t.scale.numel() == w.shape[1]:
            b_data, b_scale = w8t.data.t(), w8t.scale.reshape(1, -1)
        else:
            w8 = AxisFp8.quantize(w, 0)
            b_data, b_scale = w8.data, w8.scale
        dx = _mm(dy8.data, dy8.scale, b_data, b_scale, dy.dtype, False)
        dyT = AxisFp8.quantize(dy, 0).t()      # [N,M], scales [N,1]
        x0 = AxisFp8.quantize(x, 0)            # [M,K], scales [1,K]
        dw = _mm(dyT.data, dyT.scale, x0.data, x0.scale, dy.dtype, False)
        del ctx.w8t
        return dx, dw


def axis_fp8_linear(x, w):
    return AxisFp8Linear.apply(x, w)
