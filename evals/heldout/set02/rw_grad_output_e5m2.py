"""Rowwise-scaled FP8 training linear (e4m3 activations/weights, e5m2 gradients, power-of-two scales).

Each of the three GEMMs quantizes its operands from the saved high-precision tensors along
that GEMM's reduction dimension:

    fprop  y  = x  @ W.T      x scaled per token (over K),   W per output channel (over K)
    dgrad  dx = dy @ W        dy per token (over N),         W per input channel (over N)
    wgrad  dW = dy.T @ x      dy per output channel (over M), x per input channel (over M)

fprop uses the fast-accumulation rowwise kernel; dgrad / wgrad call the kernel with unit
scales and apply the scales to the result. fp16 / fp32 results are produced in bf16 first.

    layer = RowwiseFloat8Linear.from_float(nn_linear)
    model = convert_to_rowwise_fp8(model)
"""
import torch
from torch import nn

FP8 = torch.float8_e4m3fn
GRAD_FP8 = torch.float8_e5m2
EPS = 1e-12
FAST_ACCUM = {"fprop": True, "dgrad": False, "wgrad": False}


def scale_along(t, dim, fp8_dtype=FP8):
    """Power-of-two scale with `dim` reduced (kept as size 1)."""
    amax = torch.amax(torch.abs(t), dim=dim, keepdim=True).to(torch.float64)
    scale = (torch.finfo(fp8_dtype).max / torch.clamp(amax, min=EPS)).to(torch.float32)
    return torch.exp2(torch.floor(torch.log2(scale)))


def quantize_along(t, dim, fp8_dtype=FP8):
    """-> (fp8 data, inverse scale); the scale has `dim` of size 1."""
    scale = scale_along(t, dim, fp8_dtype)
    fmax = torch.finfo(fp8_dtype).max
    data = torch.clamp(t.to(torch.float32) * scale, -fmax, fmax).to(fp8_dtype)
    return data, scale.reciprocal()


def rowwise_mm(a, a_inv, b, b_inv, out_dtype, gemm):
    """a [M,K] fp8 with a_inv [M,1]; b [K,N] fp8 with b_inv [1,N]."""
    if not (a.stride(1) == 1 and a.stride(0) >= a.size(1)):
        a = a.contiguous()
    if not (b.stride(0) == 1 and b.stride(1) >= b.size(0)):
        b = b.t().contiguous().t()
    mm_dtype = torch.bfloat16 if out_dtype in (torch.float16, torch.float32) else out_dtype
    if FAST_ACCUM[gemm]:
        # the rowwise kernel wants [M,1] / [1,N] scales with unit inner stride
        a_inv = a_inv.clone(memory_format=torch.contiguous_format)
        b_inv = b_inv.clone(memory_format=torch.contiguous_format)
        out = torch._scaled_mm(a, b, scale_a=a_inv, scale_b=b_inv, out_dtype=mm_dtype,
                               use_fast_accum=True)
    else:
        rescale = a_inv * b_inv
        unit = a_inv.new_ones(())
        out = torch._scaled_mm(a, b, scale_a=unit, scale_b=unit, out_dtype=mm_dtype,
                               use_fast_accum=False)
        out *= rescale
    if mm_dtype != out_dtype:
        out = out.to(out_dtype)
    return out


class _RowwiseLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        x2d = x.reshape(-1, x.shape[-1])
        x_q, x_inv = quantize_along(x2d, -1)
        w_q, w_inv = quantize_along(weight, -1)
        y = rowwise_mm(x_q, x_inv, w_q.t(), w_inv.t(), x.dtype, "fprop")
        return y.reshape(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        K = x.shape[-1]
        dy2d = dy.reshape(-1, dy.shape[-1])
        # dgrad
        dy_q, dy_inv = quantize_along(dy2d, -1, GRAD_FP8)
        w_q, w_inv = quantize_along(weight, 0)
        dx = rowwise_mm(dy_q, dy_inv, w_q, w_inv, dy.dtype, "dgrad")
        dx = dx.reshape(*dy.shape[:-1], K)
        # wgrad
        dyc_q, dyc_inv = quantize_along(dy2d, 0, GRAD_FP8)
        x_q, x_inv = quantize_along(x.reshape(-1, K), 0)
        dw = rowwise_mm(dyc_q.t(), dyc_inv.t(), x_q, x_inv, dy.dtype, "wgrad")
        return dx, dw


class RowwiseFloat8Linear(nn.Linear):
    def forward(self, x):
        y = _RowwiseLinearFn.apply(x, self.weight)
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


def convert_to_rowwise_fp8(model, **kwargs):
    if type(model) is nn.Linear:
        return RowwiseFloat8Linear.from_float(model)
    for name, child in model.named_children():
        setattr(model, name, convert_to_rowwise_fp8(child, **kwargs))
    return model
