"""nn.Linear replacement with rowwise (per-row / per-column) FP8 scaling, e4m3 for all
operands, following the torchao "rowwise" recipe."""
import torch
import torch.nn as nn

E4M3 = torch.float8_e4m3fn
EPS = 1e-12


def to_fp8_axiswise(hp, axis, round_pow2=False):
    """Returns (fp8, scale) with amax reduced over `axis` (keepdim)."""
    amax = torch.amax(hp.abs(), dim=axis, keepdim=True).to(torch.float64)
    scale = (torch.finfo(E4M3).max / amax.clamp(min=EPS)).to(torch.float32)
    if round_pow2:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    lim = torch.finfo(E4M3).max
    return (hp.to(torch.float32) * scale).clamp(-lim, lim).to(E4M3), scale


def _ensure_layout(a, b):
    if not (a.stride(-1) == 1 and a.stride(0) > 1):
        a = a.contiguous()
    if not (b.stride(0) == 1 and b.stride(-1) > 1):
        b = b.t().contiguous().t()
    return a, b


def _mm(a, sa, b, sb, out_dtype, fast):
    a, b = _ensure_layout(a, b)
    gemm_dtype = torch.bfloat16 if out_dtype in (torch.float16, torch.float32) else out_dtype
    if fast:
        y = torch._scaled_mm(a, b, scale_a=sa.reciprocal(), scale_b=sb.reciprocal(),
                             out_dtype=gemm_dtype, use_fast_accum=True)
    else:
        one = sa.new_ones(())
        y = torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=gemm_dtype,
                             use_fast_accum=False)
        y *= sa.reciprocal() * sb.reciprocal()
    return y.to(out_dtype)


class _RowwiseMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w_t):
        ctx.save_for_backward(x, w_t)
        x8, sx = to_fp8_axiswise(x, -1, round_pow2=True)
        w8, sw = to_fp8_axiswise(w_t, 0)
        return _mm(x8, sx, w8, sw, x.dtype, fast=True)

    @staticmethod
    def backward(ctx, go):
        x, w_t = ctx.saved_tensors
        g8, sg = to_fp8_axiswise(go, -1, round_pow2=True)
        wg8, swg = to_fp8_axiswise(w_t, -1, round_pow2=True)
        grad_x = _mm(g8, sg, wg8.t(), swg.t(), go.dtype, fast=False)
        gw8, sgw = to_fp8_axiswise(go, 0, round_pow2=True)
        xw8, sxw = to_fp8_axiswise(x, 0, round_pow2=True)
        grad_w_t = _mm(gw8.t(), sgw.t(), xw8, sxw, go.dtype, fast=False).t()
        return grad_x, grad_w_t


class RowwiseFloat8Linear(nn.Linear):
    def forward(self, x):
        y = _RowwiseMatmul.apply(x.reshape(-1, x.shape[-1]), self.weight.t())
        y = y.reshape(*x.shape[:-1], y.shape[-1])
        return y if self.bias is None else y + self.bias.to(y.dtype)

    @classmethod
    def from_float(cls, lin):
        with torch.device("meta"):
            new = cls(lin.in_features, lin.out_features, bias=False)
        new.weight, new.bias = lin.weight, lin.bias
        return new
