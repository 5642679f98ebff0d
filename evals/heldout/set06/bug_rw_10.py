"""nn.Linear drop-in running its three GEMMs with row-wise FP8 scaling.

The cast of every operand of every GEMM is looked up in CASTS, keyed by
(gemm, operand), in the spirit of torchao's per-GEMM cast configs.
"""
import enum

import torch
import torch.nn as nn


class Gemm(enum.Enum):
    OUTPUT = "output"
    GRAD_INPUT = "grad_input"
    GRAD_WEIGHT = "grad_weight"


E4M3 = torch.float8_e4m3fn

# (gemm, operand) -> (float8 dtype, round scale down to a power of two)
CASTS = {
    (Gemm.OUTPUT, "input"): (E4M3, True),
    (Gemm.OUTPUT, "weight"): (E4M3, True),
    (Gemm.GRAD_INPUT, "grad_output"): (E4M3, True),
    (Gemm.GRAD_INPUT, "weight"): (E4M3, True),
    (Gemm.GRAD_WEIGHT, "grad_output"): (E4M3, True),
    (Gemm.GRAD_WEIGHT, "input"): (E4M3, False),
}
FAST_ACCUM = {Gemm.OUTPUT: True, Gemm.GRAD_INPUT: False, Gemm.GRAD_WEIGHT: False}
AMAX_EPS = 1e-12


@torch.no_grad()
def axiswise_cast(hp, gemm, operand, reduce_dim):
    dtype, pow2 = CASTS[(gemm, operand)]
    fmax = torch.finfo(dtype).max
    amax = torch.amax(torch.abs(hp), dim=reduce_dim, keepdim=True).to(torch.float64)
    scale = (fmax / torch.clamp(amax, min=AMAX_EPS)).to(torch.float32)
    if pow2:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    fp8 = torch.clamp(hp.to(torch.float32) * scale, min=-fmax, max=fmax).to(dtype)
    return fp8, scale


def gemm_rowwise(gemm, a, a_scale, b, b_scale, out_dtype):
    """a [M, K] row-scaled by a_scale [M, 1]; b [K, N] column-scaled by b_scale [1, N]."""
    if not (a.stride(1) == 1 and a.stride(0) > a.stride(1)):
        a = a.contiguous()
    if b.stride(1) == 1 and b.stride(0) > b.stride(1):
        b = b.t().contiguous().t()
    a_inv = a_scale.reciprocal()
    b_inv = b_scale.reciprocal()
    wide = out_dtype in (torch.float16, torch.float32)
    mm_dtype = torch.bfloat16 if wide else out_dtype
    if FAST_ACCUM[gemm]:
        res = torch._scaled_mm(a, b, scale_a=a_inv, scale_b=b_inv,
                               out_dtype=mm_dtype, use_fast_accum=True)
    else:
        post = a_inv * b_inv
        ones = a_inv.new_ones(())
        res = torch._scaled_mm(a, b, scale_a=ones, scale_b=ones,
                               out_dtype=mm_dtype, use_fast_accum=False)
        res *= post
    if wide:
        res = res.to(out_dtype)
    return res


class _RowwiseMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight_t):
        ctx.save_for_backward(x, weight_t)
        x_fp8, x_s = axiswise_cast(x, Gemm.OUTPUT, "input", -1)
        w_fp8, w_s = axiswise_cast(weight_t, Gemm.OUTPUT, "weight", 0)
        lead = x.shape[:-1]
        out = gemm_rowwise(Gemm.OUTPUT, x_fp8.reshape(-1, x.shape[-1]), x_s.reshape(-1, 1),
                           w_fp8, w_s, x.dtype)
        return out.reshape(*lead, out.shape[-1])

    @staticmethod
    def backward(ctx, grad_output):
        x, weight_t = ctx.saved_tensors
        go = grad_output.reshape(-1, grad_output.shape[-1])
        grad_x = grad_wt = None
        if ctx.needs_input_grad[0]:
            g_fp8, g_s = axiswise_cast(go, Gemm.GRAD_INPUT, "grad_output", -1)
            w_fp8, w_s = axiswise_cast(weight_t, Gemm.GRAD_INPUT, "weight", -1)
            grad_x = gemm_rowwise(Gemm.GRAD_INPUT, g_fp8, g_s, w_fp8.t(), w_s.t(), grad_output.dtype)
            grad_x = grad_x.reshape(*grad_output.shape[:-1], grad_x.shape[-1])
        if ctx.needs_input_grad[1]:
            x2 = x.reshape(-1, x.shape[-1])
            g_fp8, g_s = axiswise_cast(go, Gemm.GRAD_WEIGHT, "grad_output", 0)
            x_fp8, x_s = axiswise_cast(x2, Gemm.GRAD_WEIGHT, "input", 0)
            grad_w = gemm_rowwise(Gemm.GRAD_WEIGHT, g_fp8.t(), g_s.t(), x_fp8, x_s, grad_output.dtype)
            grad_wt = grad_w.t()
        return grad_x, grad_wt


class RowwiseFloat8Linear(nn.Linear):
    def forward(self, input):
        output = _RowwiseMatmul.apply(input, self.weight.t())
        if self.bias is not None:
            output = output + self.bias.to(output.dtype)
        return output

    @classmethod
    def from_float(cls, mod):
        with torch.device("meta"):
            new_mod = cls(mod.in_features, mod.out_features, bias=False)
        new_mod.weight = mod.weight
        new_mod.bias = mod.bias
        return new_mod
