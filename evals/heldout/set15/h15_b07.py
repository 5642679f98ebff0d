"""[planted bug: input flattened with as_strided assuming contiguous storage]

Held-out set 15, twin h15_c03.py; labels in manifest.json.
"""
import torch
from torch import nn

E4M3 = torch.float8_e4m3fn
FMAX = torch.finfo(E4M3).max
EPS = 1e-12


def _pow2_scale(amax, fmax):
    s = (fmax / torch.clamp(amax.to(torch.float64), min=EPS)).to(torch.float32)
    return torch.exp2(torch.floor(torch.log2(s)))


def _to_fp8(t, scale, fmax):
    return torch.clamp(t.to(torch.float32) * scale, -fmax, fmax).to(E4M3)


def _row_major(t):
    return t if (t.stride(1) == 1 and t.stride(0) > 1) else t.contiguous()


def _col_major(t):
    return t if (t.stride(0) == 1 and t.stride(1) > 1) else t.t().contiguous().t()


def _gemm(a8, a_inv, b8, b_inv, out_dtype, fast_accum):
    """a8 [M, K] row-major with a_inv [M, 1]; b8 [K, N] column-major with b_inv [1, N]."""
    mm_dtype = torch.bfloat16 if out_dtype in (torch.float16, torch.float32) else out_dtype
    if fast_accum:
        out = torch._scaled_mm(a8, b8, scale_a=a_inv, scale_b=b_inv, out_dtype=mm_dtype, use_fast_accum=True)
    else:
        one = a_inv.new_ones(())
        out = torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=mm_dtype, use_fast_accum=False)
        out *= a_inv * b_inv
    return out.to(out_dtype)


class _RowwiseMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        x2 = x.as_strided((x.numel() // x.shape[-1], x.shape[-1]), (x.shape[-1], 1))
        x_s = _pow2_scale(x2.abs().amax(dim=1, keepdim=True), FMAX)       # [M, 1]
        x8 = _to_fp8(x2, x_s, FMAX)
        w_s = _pow2_scale(w.abs().amax(dim=1, keepdim=True), FMAX)        # [N, 1]
        w8 = _to_fp8(w, w_s, FMAX)
        out = _gemm(_row_major(x8), x_s.reciprocal(), _col_major(w8.t()), w_s.reciprocal().t(), x.dtype, True)
        return out.reshape(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx, go):
        x, w = ctx.saved_tensors
        go2 = go.reshape(-1, go.shape[-1])

        # grad_input = grad_output @ weight, inner dimension N
        g_amax = go2.abs().amax(dim=1, keepdim=True)                      # [M, 1]
        g_s = _pow2_scale(g_amax, FMAX)
        g8 = _to_fp8(go2, g_s, FMAX)
        wc_s = _pow2_scale(w.abs().amax(dim=0, keepdim=True), FMAX)       # [1, K]
        wc8 = _to_fp8(w, wc_s, FMAX)
        gi = _gemm(_row_major(g8), g_s.reciprocal(), _col_major(wc8), wc_s.reciprocal(), go.dtype, False)

        # grad_weight = grad_output.T @ input, inner dimension M
        x2 = x.reshape(-1, x.shape[-1])
        gt_s = _pow2_scale(go2.abs().amax(dim=0, keepdim=True), FMAX)     # [1, N]
        gt8 = _to_fp8(go2, gt_s, FMAX)
        xc_amax = x2.abs().amax(dim=0, keepdim=True)                      # [1, K]
        xc_s = _pow2_scale(xc_amax, FMAX)
        xc8 = _to_fp8(x2, xc_s, FMAX)
        gw = _gemm(_row_major(gt8.t()), gt_s.reciprocal().t(), _col_major(xc8), xc_s.reciprocal(), go.dtype, False)
        return gi.reshape(*go.shape[:-1], gi.shape[-1]), gw


class Float8RowwiseLinear(nn.Linear):
    """nn.Linear whose three GEMMs run in FP8 with rowwise scaling."""

    def forward(self, input):
        out = _RowwiseMM.apply(input, self.weight)
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out

    @classmethod
    def from_float(cls, mod):
        with torch.device("meta"):
            new = cls(mod.in_features, mod.out_features, bias=False)
        new.weight = mod.weight
        new.bias = mod.bias
        return new
