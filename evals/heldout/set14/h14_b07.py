"""[planted bug: grad_output is flattened with as_strided assuming contiguous storage, so a non-contiguous grad_output is read in storage order.]

rowwise_with_gw_hp FP8 linear, module form: ``GwHpFloat8Linear.from_float(linear)``.

torchao 0.18's ``rowwise_with_gw_hp`` recipe:

* output      = input (e4m3, axiswise along K) @ weight.T (e4m3, axiswise along K),
                rowwise ``_scaled_mm`` with fast accumulation;
* grad_input  = grad_output (e4m3, axiswise along N) @ weight (e4m3, tensorwise): the
                tensorwise scale is repeated into a [1, K] row so both operands are
                "rowwise", then, because the accumulation is slow, the GEMM runs with unit
                scales and the result is multiplied by the outer product of the inverses;
* grad_weight = grad_output.T @ input in high precision (no fp8 at all).

Scales: ``fp8_max / max(amax, eps)`` with eps 1e-12, in float64, rounded to float32 and
down to a power of two.  ``_scaled_gemm`` reproduces torchao's generic float8 mm: A
row-major, B column-major, rowwise output in bf16 for fp16/fp32 activations.
"""
import torch
from torch import nn

E4M3 = torch.float8_e4m3fn
EPS = 1e-12


@torch.no_grad()
def _cast(t, dim, fp8_dtype=E4M3, eps=EPS):
    """fp8 copy of ``t`` and its power-of-two scale; ``dim=None`` means one scale."""
    fmax = torch.finfo(fp8_dtype).max
    if dim is None:
        amax = torch.max(torch.abs(t))
    else:
        amax = torch.amax(torch.abs(t), dim=dim, keepdim=True)
    scale = (fmax / torch.clamp(amax.to(torch.float64), min=eps)).to(torch.float32)
    scale = torch.exp2(torch.floor(torch.log2(scale)))
    data = (t.to(torch.float32) * scale).clamp(min=-fmax, max=fmax).to(fp8_dtype)
    return data, scale


def _row_major(t):
    return t.stride(0) > t.stride(1) and t.stride(1) == 1


def _scaled_gemm(a8, sa, b8, sb, out_dtype, fast_accum):
    """a8 [m,k] @ b8 [k,n]; sa is [m,1] or a scalar, sb is [1,n] or a scalar."""
    if not _row_major(a8):
        a8 = a8.contiguous()
    if _row_major(b8):
        b8 = b8.t().contiguous().t()
    if sa.dim() == 0 and sb.dim() == 2:
        sa = sa.repeat(a8.shape[0]).reshape(-1, 1)
    elif sa.dim() == 2 and sb.dim() == 0:
        sb = sb.repeat(b8.shape[1]).reshape(1, -1)
    inv_a, inv_b = sa.reciprocal(), sb.reciprocal()
    rowwise = inv_a.dim() == 2
    mm_dtype = out_dtype
    if rowwise and out_dtype in (torch.float16, torch.float32):
        mm_dtype = torch.bfloat16
    post = None
    if rowwise and not fast_accum:
        post = inv_a * inv_b
        inv_a = inv_a.new_ones(())
        inv_b = inv_a.new_ones(())
    out = torch._scaled_mm(a8, b8, scale_a=inv_a, scale_b=inv_b, out_dtype=mm_dtype,
                           use_fast_accum=fast_accum)
    if post is not None:
        out *= post
    return out.to(out_dtype)


class _GwHpMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        k = x.shape[-1]
        x2 = x.reshape(-1, k)
        x8, sx = _cast(x2, -1)
        w8t, sw = _cast(weight.t(), 0)
        out = _scaled_gemm(x8, sx, w8t, sw, x.dtype, True)
        return out.reshape(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        k, n = x.shape[-1], grad_out.shape[-1]
        g2 = grad_out.as_strided((grad_out.numel() // n, n), (n, 1))
        x2 = x.reshape(-1, k)
        g8, sg = _cast(g2, -1)
        w8t, sw = _cast(weight.t(), None)
        grad_x = _scaled_gemm(g8, sg, w8t.t(), sw, grad_out.dtype, False)
        grad_w = torch.mm(g2.t(), x2)
        return grad_x.reshape(*grad_out.shape[:-1], k), grad_w


class GwHpFloat8Linear(nn.Linear):
    """nn.Linear with the rowwise_with_gw_hp FP8 recipe."""

    def forward(self, x):
        out = _GwHpMatmul.apply(x, self.weight)
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
