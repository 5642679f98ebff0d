"""[planted bug: grad_input hands the GEMM grad_output's scales instead of their reciprocals, so each row comes out multiplied by scale^2.]

Copy of gwhp_conv.py with one small change. Original docstring:

rowwise_with_gw_hp FP8 linear, converter form: convert(module) -> module.

torchao 0.18 Float8Linear "rowwise_with_gw_hp", bitwise:
  output      = input (e4m3, scale per row along K) @ weight.T (e4m3, scale per
                output column along K), fast accumulation, rowwise scales in the GEMM;
  grad_input  = grad_output (e4m3, scale per row along N) @ weight (e4m3, ONE
                tensorwise scale, broadcast to a row of scales), unit scales in the
                GEMM and the scales applied to the bf16 result;
  grad_weight = grad_output.T @ input in high precision (no fp8 at all).
All scales are rounded down to powers of 2.
"""
import torch
from torch import nn

E4M3 = torch.float8_e4m3fn
EPS = 1e-12


def pow2_scale(amax):
    amax = amax.to(torch.float64)
    s = (torch.finfo(E4M3).max / torch.clamp(amax, min=EPS)).to(torch.float32)
    return torch.exp2(torch.floor(torch.log2(s)))


def cast_e4m3(hp, scale):
    m = torch.finfo(E4M3).max
    return (hp.to(torch.float32) * scale).clamp(min=-m, max=m).to(E4M3)


def cast_rowwise(hp, dim):
    scale = pow2_scale(torch.amax(torch.abs(hp), dim=dim, keepdim=True))
    return cast_e4m3(hp, scale), scale


def cast_tensorwise(hp):
    scale = pow2_scale(torch.max(torch.abs(hp)))
    return cast_e4m3(hp, scale), scale


def fp8_mm(a, inv_a, b, inv_b, out_dtype, use_fast_accum):
    """a [M,K] row-major, b [K,N] column-major; inv_a [M,1], inv_b [1,N]."""
    if not (a.stride(1) == 1 and a.stride(0) > a.stride(1)):
        a = a.contiguous()
    if b.stride(1) == 1 and b.stride(0) > b.stride(1):
        b = b.t().contiguous().t()
    post = None
    if not use_fast_accum:
        post = inv_a * inv_b
        inv_a = inv_b = torch.ones((), dtype=torch.float32, device=a.device)
    gemm_dtype = torch.bfloat16 if out_dtype in (torch.float16, torch.float32) else out_dtype
    out = torch._scaled_mm(a, b, scale_a=inv_a, scale_b=inv_b, out_dtype=gemm_dtype,
                           use_fast_accum=use_fast_accum)
    if post is not None:
        out *= post
    return out.to(out_dtype)


class _GwHpMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        x2 = x.reshape(-1, x.shape[-1])
        xq, xs = cast_rowwise(x2, -1)
        wq_t, ws = cast_rowwise(w.t(), 0)
        y = fp8_mm(xq, xs.reciprocal(), wq_t, ws.reciprocal(), x.dtype, True)
        return y.reshape(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, gy):
        x, w = ctx.saved_tensors
        gy2 = gy.reshape(-1, gy.shape[-1])
        x2 = x.reshape(-1, x.shape[-1])
        # grad_input: rowwise grad_output x tensorwise weight
        gq, gs = cast_rowwise(gy2, -1)
        wq, ws = cast_tensorwise(w)
        inv_w = ws.reciprocal().repeat(wq.shape[1]).reshape(1, -1)
        gx = fp8_mm(gq, gs, wq, inv_w, gy.dtype, False)
        gx = gx.reshape(*gy.shape[:-1], gx.shape[-1])
        # grad_weight: high precision
        gw = torch.mm(gy2.t(), x2)
        return gx, gw


class GwHpFloat8Linear(nn.Linear):
    def forward(self, x):
        y = _GwHpMatmul.apply(x, self.weight)
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


def convert(module: nn.Module, **kwargs) -> nn.Module:
    if isinstance(module, nn.Linear) and not isinstance(module, GwHpFloat8Linear):
        return GwHpFloat8Linear.from_float(module)
    for name, child in list(module.named_children()):
        setattr(module, name, convert(child, **kwargs))
    return module
