"""[planted bug: forward caches weight.t() with `getattr(self, '_w_t', None) or ...`, which evaluates a tensor's truth value and raises on the second call.]

Copy of tw_conv.py with one small change. Original docstring:

Tensorwise FP8 linear, converter form: convert(module) swaps nn.Linear layers.

Mirrors torchao 0.18 Float8Linear "tensorwise": the autograd function takes
weight.t() as torchao does; input/weight in e4m3, grad_output in e5m2, per-tensor
dynamic scales (float64 division, float32 scale, EPS floor 1e-12), saturating casts,
inverse scales to torch._scaled_mm, fast accumulation for the output GEMM only.
Every GEMM re-quantizes its operands from the high-precision tensors.
"""
import torch
from torch import nn

EPS = 1e-12
FWD_DTYPE = torch.float8_e4m3fn
BWD_DTYPE = torch.float8_e5m2


def tensor_scale(hp, fp8_dtype):
    amax = torch.max(torch.abs(hp)).to(torch.float64)
    return (torch.finfo(fp8_dtype).max / torch.clamp(amax, min=EPS)).to(torch.float32)


def quantize(hp, fp8_dtype):
    scale = tensor_scale(hp, fp8_dtype)
    fp8_max = torch.finfo(fp8_dtype).max
    scaled = hp.to(torch.float32) * scale
    return scaled.clamp(min=-fp8_max, max=fp8_max).to(fp8_dtype), scale


def scaled_matmul(a, a_scale, b, b_scale, out_dtype, fast_accum):
    # cuBLASLt on SM90 wants A row-major and B column-major.
    if not (a.stride(1) == 1 and a.stride(0) > 1):
        a = a.contiguous()
    if b.stride(1) == 1 and b.stride(0) > 1:
        b = b.t().contiguous().t()
    inv_a = a_scale.reciprocal()
    inv_b = b_scale.reciprocal()
    return torch._scaled_mm(a, b, scale_a=inv_a, scale_b=inv_b,
                            out_dtype=out_dtype, use_fast_accum=fast_accum)


class _TensorwiseMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w_t):
        ctx.save_for_backward(x, w_t)
        x_fp8, x_s = quantize(x, FWD_DTYPE)
        w_t_fp8, w_s = quantize(w_t, FWD_DTYPE)
        x_fp8_2d = x_fp8.reshape(-1, x.shape[-1])
        out = scaled_matmul(x_fp8_2d, x_s, w_t_fp8, w_s, x.dtype, True)
        return out.reshape(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_out):
        x, w_t = ctx.saved_tensors
        g = grad_out.reshape(-1, grad_out.shape[-1])
        # grad_input = grad_output @ weight
        g_fp8, g_s = quantize(g, BWD_DTYPE)
        w_t_fp8, w_s = quantize(w_t, FWD_DTYPE)
        grad_x = scaled_matmul(g_fp8, g_s, w_t_fp8.t(), w_s, g.dtype, False)
        grad_x = grad_x.reshape(*grad_out.shape[:-1], grad_x.shape[-1])
        # grad_weight = grad_output.T @ input
        x2 = x.reshape(-1, x.shape[-1])
        g_fp8_gw, g_s_gw = quantize(g, BWD_DTYPE)
        x_fp8_gw, x_s_gw = quantize(x2, FWD_DTYPE)
        grad_w = scaled_matmul(g_fp8_gw.t(), g_s_gw, x_fp8_gw, x_s_gw, g.dtype, False)
        return grad_x, grad_w.t()


class TensorwiseFloat8Linear(nn.Linear):
    """nn.Linear whose three GEMMs run in FP8 with tensorwise dynamic scaling."""

    def forward(self, input):
        self._w_t = getattr(self, "_w_t", None) or self.weight.t()
        out = _TensorwiseMM.apply(input, self._w_t)
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


def convert(module: nn.Module, **kwargs) -> nn.Module:
    """Swap every nn.Linear in `module` (or `module` itself) for the FP8 version."""
    if isinstance(module, nn.Linear) and not isinstance(module, TensorwiseFloat8Linear):
        return TensorwiseFloat8Linear.from_float(module)
    for name, child in module.named_children():
        setattr(module, name, convert(child))
    return module
