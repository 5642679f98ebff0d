"""Correct FP8 linear, "tensorwise" recipe (held-out reference; written from the recipe).

Numerics follow torchao 0.18's Float8Linear with Float8LinearConfig.from_recipe_name("tensorwise"):
  * input, weight -> float8_e4m3fn; grad_output -> float8_e5m2; one scale per tensor
  * amax = max|x|; scale = fp8_max / clamp(amax in float64, 1e-12), stored as float32
  * x_fp8 = clamp(x.float() * scale, -fp8_max, fp8_max).to(fp8)
  * torch._scaled_mm(A row-major, B column-major, scale_a=1/scale_a, scale_b=1/scale_b)
  * use_fast_accum: True for the output GEMM, False for grad_input and grad_weight
  * every GEMM's out_dtype is the dtype of its A operand's high-precision tensor
    (input for the output GEMM, grad_output for both backward GEMMs); autograd casts
    grad_weight to the weight's dtype.

Forms: `fp8_linear` (function), `Float8LinearTW` (module with from_float), `convert` (converter).
"""
import torch
import torch.nn as nn

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
EPS = 1e-12


def tensorwise_scale(t, fp8_dtype):
    amax = torch.abs(t).max().to(torch.float64)
    return (torch.finfo(fp8_dtype).max / torch.clamp(amax, min=EPS)).to(torch.float32)


def to_fp8(t, fp8_dtype):
    """Returns (fp8 data, scale); the data keeps t's memory layout."""
    scale = tensorwise_scale(t, fp8_dtype)
    fmax = torch.finfo(fp8_dtype).max
    return (t.to(torch.float32) * scale).clamp(min=-fmax, max=fmax).to(fp8_dtype), scale


def _row_major(t):
    s0, s1 = t.stride()
    return t if (s1 == 1 and s0 > s1) else t.contiguous()


def _col_major(t):
    s0, s1 = t.stride()
    return t.t().contiguous().t() if (s1 == 1 and s0 > s1) else t


def _mm(a8, sa, b8, sb, out_dtype, fast):
    return torch._scaled_mm(_row_major(a8), _col_major(b8),
                            scale_a=sa.reciprocal(), scale_b=sb.reciprocal(),
                            out_dtype=out_dtype, use_fast_accum=fast)


class _TensorwiseLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        x8, sx = to_fp8(x, E4M3)
        wt8, sw = to_fp8(w.t(), E4M3)
        return _mm(x8, sx, wt8, sw, x.dtype, True)

    @staticmethod
    def backward(ctx, grad_out):
        x, w = ctx.saved_tensors
        g8, sg = to_fp8(grad_out, E5M2)
        w8, sw = to_fp8(w, E4M3)
        grad_x = _mm(g8, sg, w8, sw, grad_out.dtype, False)
        x8, sx = to_fp8(x, E4M3)
        grad_w = _mm(g8.t(), sg, x8, sx, grad_out.dtype, False)
        return grad_x, grad_w


def fp8_linear(input_2d, weight):
    """function form: input_2d [M, K] @ weight[N, K].T -> [M, N]"""
    return _TensorwiseLinearFn.apply(input_2d, weight)


class Float8LinearTW(nn.Linear):
    """module form"""

    def forward(self, x):
        lead = x.shape[:-1]
        out = fp8_linear(x.reshape(-1, x.shape[-1]), self.weight)
        out = out.reshape(*lead, out.shape[-1])
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out

    @classmethod
    def from_float(cls, lin):
        with torch.device("meta"):
            new = cls(lin.in_features, lin.out_features, bias=False)
        new.weight = lin.weight
        new.bias = lin.bias
        return new


def convert(module, **kwargs):
    """converter form: swaps every nn.Linear child (or a root nn.Linear)."""
    if type(module) is nn.Linear:
        return Float8LinearTW.from_float(module)
    for name, child in module.named_children():
        setattr(module, name, convert(child))
    return module
