"""Correct FP8 linear, "rowwise" recipe (held-out reference; written from the recipe).

Numerics follow torchao 0.18's Float8Linear with Float8LinearConfig.from_recipe_name("rowwise"):
  * input, weight and grad_output all float8_e4m3fn
  * axiswise scales: amax over the GEMM's inner dimension, one scale per row of A
    ([M, 1]) and per column of B ([1, N]); scale = 448 / clamp(amax in float64, 1e-12)
    as float32, then rounded DOWN to a power of two: exp2(floor(log2(scale)))
  * every GEMM re-quantizes from the high-precision tensors along its own inner dim
  * output GEMM: scales go into _scaled_mm, use_fast_accum=True
  * grad_input / grad_weight GEMMs (no fast accumulation): _scaled_mm with unit
    scales, then the result is multiplied by (1/scale_a) * (1/scale_b) (torchao does
    this because the rowwise kernel without fast-accum is slow; the scales are powers
    of two so the rescale is exact)
  * _scaled_mm with rowwise scales runs with a bf16 output; fp16/fp32 results are cast
    back afterwards.
The high-precision grad_weight variant lives in correct_rowwise_with_gw_hp.py and reuses
the helpers defined here.
"""
import torch
import torch.nn as nn

E4M3 = torch.float8_e4m3fn
EPS = 1e-12


def pow2_floor(scale):
    return torch.exp2(torch.floor(torch.log2(scale)))


def axiswise_to_fp8(t, dim, fp8_dtype=E4M3):
    """Quantize t with one scale per slice along `dim` (amax reduced over dim, keepdim)."""
    amax = torch.amax(torch.abs(t), dim=dim, keepdim=True).to(torch.float64)
    scale = (torch.finfo(fp8_dtype).max / torch.clamp(amax, min=EPS)).to(torch.float32)
    scale = pow2_floor(scale)
    fmax = torch.finfo(fp8_dtype).max
    return (t.to(torch.float32) * scale).clamp(min=-fmax, max=fmax).to(fp8_dtype), scale


def tensorwise_to_fp8(t, fp8_dtype=E4M3):
    amax = torch.abs(t).max().to(torch.float64)
    scale = pow2_floor((torch.finfo(fp8_dtype).max / torch.clamp(amax, min=EPS)).to(torch.float32))
    fmax = torch.finfo(fp8_dtype).max
    return (t.to(torch.float32) * scale).clamp(min=-fmax, max=fmax).to(fp8_dtype), scale


def row_major(t):
    s0, s1 = t.stride()
    return t if (s1 == 1 and s0 > s1) else t.contiguous()


def col_major(t):
    s0, s1 = t.stride()
    return t.t().contiguous().t() if (s1 == 1 and s0 > s1) else t


def _gemm_dtype(dtype):
    return torch.bfloat16 if dtype in (torch.float16, torch.float32) else dtype


def rowwise_mm(a8, sa, b8, sb, out_dtype, fast_accum):
    """a8 [M,K] with sa [M,1]; b8 [K,N] with sb [1,N]."""
    a8, b8 = row_major(a8), col_major(b8)
    inv_a, inv_b = sa.reciprocal(), sb.reciprocal()
    if fast_accum:
        out = torch._scaled_mm(a8, b8, scale_a=inv_a, scale_b=inv_b,
                               out_dtype=_gemm_dtype(out_dtype), use_fast_accum=True)
    else:
        post = inv_a * inv_b
        one = inv_a.new_ones(())
        out = torch._scaled_mm(a8, b8, scale_a=one, scale_b=one,
                               out_dtype=_gemm_dtype(out_dtype), use_fast_accum=False)
        out *= post
    return out.to(out_dtype)


def output_gemm(x, w):
    x8, sx = axiswise_to_fp8(x, -1)          # [M,1]
    wt8, sw = axiswise_to_fp8(w.t(), 0)      # [1,N]
    return rowwise_mm(x8, sx, wt8, sw, x.dtype, True)


def grad_input_gemm(go, w):
    g8, sg = axiswise_to_fp8(go, -1)         # [M,1]
    w8, sw = axiswise_to_fp8(w, 0)           # amax over N -> [1,K]
    return rowwise_mm(g8, sg, w8, sw, go.dtype, False)


def grad_weight_gemm(go, x):
    g8, sg = axiswise_to_fp8(go, 0)          # amax over M -> [1,N]
    x8, sx = axiswise_to_fp8(x, 0)           # amax over M -> [1,K]
    return rowwise_mm(g8.t(), sg.t(), x8, sx, go.dtype, False)


class _RowwiseLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return output_gemm(x, w)

    @staticmethod
    def backward(ctx, go):
        x, w = ctx.saved_tensors
        return grad_input_gemm(go, w), grad_weight_gemm(go, x)


def fp8_linear(input_2d, weight):
    """function form"""
    return _RowwiseLinearFn.apply(input_2d, weight)


class Float8LinearRW(nn.Linear):
    def forward(self, x):
        out = fp8_linear(x.reshape(-1, x.shape[-1]), self.weight)
        out = out.reshape(*x.shape[:-1], out.shape[-1])
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out

    @classmethod
    def from_float(cls, lin):
        with torch.device("meta"):
            new = cls(lin.in_features, lin.out_features, bias=False)
        new.weight, new.bias = lin.weight, lin.bias
        return new


def convert(module, **kwargs):
    """converter form"""
    if type(module) is nn.Linear:
        return Float8LinearRW.from_float(module)
    for name, child in module.named_children():
        setattr(module, name, convert(child))
    return module
