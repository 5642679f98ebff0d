"""[planted bug: The input is flattened with view(-1, K), which raises for an N-D input whose storage cannot be viewed that way (e.g. the last two dims transposed).]

Rowwise FP8 linear, module form: ``RowwiseFloat8Linear.from_float(linear)``.

torchao 0.18's ``rowwise`` recipe (``Float8LinearConfig.from_recipe_name("rowwise")``):

* input, weight and grad_output are all cast to e4m3 with AXISWISE scales: one scale per
  row of the GEMM's left operand and per column of its right operand, always taken along
  that GEMM's inner dimension (K for the output, N for grad_input, M for grad_weight);
* ``scale = fp8_max / max(amax, 1e-12)`` (float64 -> float32) rounded DOWN to a power of two;
* each GEMM re-quantizes from the high-precision input / weight / grad_output;
* output GEMM: ``_scaled_mm`` with rowwise scales [M,1] x [1,N] and fast accumulation;
  grad GEMMs (slow accumulation): the tensorwise kernel with unit scales followed by a
  multiplication with the outer product of the inverse scales (torchao's work-around for
  the slow rowwise CUTLASS kernel; exact because the scales are powers of two);
* the rowwise kernel writes bf16 only, so fp16 / fp32 activations get a bf16 GEMM output
  cast back to their dtype.

The module computes the weight's forward scale and hands it to the autograd function.
"""
import torch
from torch import nn

E4M3 = torch.float8_e4m3fn
F8_MAX = torch.finfo(E4M3).max
EPS = 1e-12


@torch.no_grad()
def _axis_scale(t, dim):
    amax = torch.amax(torch.abs(t), dim=dim, keepdim=True).to(torch.float64)
    scale = (F8_MAX / torch.clamp(amax, min=EPS)).to(torch.float32)
    return torch.exp2(torch.floor(torch.log2(scale)))


@torch.no_grad()
def _apply_scale(t, scale):
    return (t.to(torch.float32) * scale).clamp(min=-F8_MAX, max=F8_MAX).to(E4M3)


def _cast(t, dim):
    scale = _axis_scale(t, dim)
    return _apply_scale(t, scale), scale


def _is_row_major(t):
    return t.stride(0) > t.stride(1) and t.stride(1) == 1


def _rowwise_mm(a, sa, b, sb, out_dtype, fast_accum):
    """a [m,k] with scales sa [m,1]; b [k,n] with scales sb [1,n]."""
    if not _is_row_major(a):
        a = a.contiguous()
    if _is_row_major(b):
        b = b.t().contiguous().t()
    inv_a, inv_b = sa.reciprocal(), sb.reciprocal()
    mm_dtype = torch.bfloat16 if out_dtype in (torch.float16, torch.float32) else out_dtype
    if fast_accum:
        out = torch._scaled_mm(a, b, scale_a=inv_a, scale_b=inv_b, out_dtype=mm_dtype,
                               use_fast_accum=True)
    else:
        post = inv_a * inv_b
        one = inv_a.new_ones(())
        out = torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=mm_dtype,
                               use_fast_accum=False)
        out *= post
    return out.to(out_dtype)


class _RowwiseLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, w_scale):
        ctx.save_for_backward(x, weight)
        k = x.shape[-1]
        x2 = x.view(-1, k)
        x8, sx = _cast(x2, -1)                      # [M,K], [M,1]
        w8t = _apply_scale(weight.t(), w_scale)     # [K,N] with [1,N]
        out = _rowwise_mm(x8, sx, w8t, w_scale, x.dtype, True)
        return out.reshape(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        k, n = x.shape[-1], grad_out.shape[-1]
        g2 = grad_out.reshape(-1, n)
        g8, sg = _cast(g2, -1)                      # [M,N], [M,1]  for grad_input (inner dim N)
        g8m, sgm = _cast(g2, 0)                     # [M,N], [1,N]  for grad_weight (inner dim M)
        # grad_input = grad_output @ weight, inner dim N
        w8t, swn = _cast(weight.t(), -1)            # [K,N], [K,1]
        grad_x = _rowwise_mm(g8, sg, w8t.t(), swn.t(), grad_out.dtype, False)
        # grad_weight = grad_output.T @ input, inner dim M
        x8m, sxm = _cast(x.reshape(-1, k), 0)       # [M,K], [1,K]
        grad_w = _rowwise_mm(g8m.t(), sgm.t(), x8m, sxm, grad_out.dtype, False)
        return grad_x.reshape(*grad_out.shape[:-1], k), grad_w, None


class RowwiseFloat8Linear(nn.Linear):
    """nn.Linear with torchao-style rowwise FP8 GEMMs (power-of-two scales)."""

    def forward(self, x):
        w_scale = _axis_scale(self.weight.t(), 0)   # [1, N]: one scale per output feature
        out = _RowwiseLinearFn.apply(x, self.weight, w_scale)
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
