"""convert_linears_to_fp8(model): swaps nn.Linear for an FP8 (tensorwise) module whose
bias add is fused into the fp8 GEMM epilogue (torch._scaled_mm's `bias=` argument)."""
import torch
import torch.nn as nn


def _amax_scale(t, dtype):
    return (torch.finfo(dtype).max / t.abs().max().double().clamp(min=1e-12)).float()


def _fp8(t, dtype):
    s = _amax_scale(t, dtype)
    m = torch.finfo(dtype).max
    return (t.float() * s).clamp(-m, m).to(dtype), s.reciprocal()


class _Fp8AddMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, b):
        ctx.save_for_backward(x, w)
        ctx.has_bias = b is not None
        x8, xi = _fp8(x, torch.float8_e4m3fn)
        w8, wi = _fp8(w, torch.float8_e4m3fn)
        # cuBLASLt fuses bf16/fp16 bias only (no bias with a float32 output)
        fuse = b is not None and x.dtype in (torch.bfloat16, torch.float16)
        y = torch._scaled_mm(x8.contiguous(), w8.t(), scale_a=xi, scale_b=wi,
                             bias=b.to(x.dtype) if fuse else None,
                             out_dtype=x.dtype, use_fast_accum=True)
        if b is not None and not fuse:
            y = y + b.to(y.dtype)
        return y

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        g8, gi = _fp8(g, torch.float8_e5m2)
        w8, wi = _fp8(w, torch.float8_e4m3fn)
        x8, xi = _fp8(x, torch.float8_e4m3fn)
        dx = torch._scaled_mm(g8.contiguous(), w8.t().contiguous().t(), scale_a=gi, scale_b=wi,
                              out_dtype=g.dtype, use_fast_accum=False)
        dw = torch._scaled_mm(g8.t().contiguous(), x8.t().contiguous().t(), scale_a=gi,
                              scale_b=xi, out_dtype=g.dtype, use_fast_accum=False)
        db = g.sum(0) if ctx.has_bias else None
        return dx, dw, db


class Fp8LinearFusedBias(nn.Module):
    def __init__(self, lin: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = lin.in_features, lin.out_features
        self.weight, self.bias = lin.weight, lin.bias

    def forward(self, x):
        x2 = x.reshape(-1, self.in_features)
        y = _Fp8AddMM.apply(x2, self.weight.contiguous(), self.bias)
        y = y.reshape(*x.shape[:-1], self.out_features)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y


def convert_linears_to_fp8(module, **kwargs):
    if isinstance(module, nn.Linear):
        return Fp8LinearFusedBias(module)
    for name, child in list(module.named_children()):
        setattr(module, name, convert_linears_to_fp8(child, **kwargs))
    return module
