"""[planted bug: The unit-scale grad_input product is converted to the caller's dtype before the rescale, so with fp16 it overflows to inf.]

rowwise_with_gw_hp FP8 linear, module form: ``GwHpFloat8Linear.from_float(nn.Linear)``.

Follows torchao 0.18 Float8LinearConfig.from_recipe_name("rowwise_with_gw_hp"):
  * output:      input axiswise over K (e4m3) @ weight.T axiswise over K (e4m3),
                 fast accumulation, scales handed to _scaled_mm;
  * grad_input:  grad_output axiswise over N (e4m3) @ weight tensorwise (e4m3);
                 torchao repeats the weight's single scale along K, runs _scaled_mm
                 with unit scales and multiplies the bf16 product by 1/sa * 1/sb;
  * grad_weight: grad_output.T @ input with torch.mm in high precision.
All scales are rounded down to powers of two.  fp16/fp32 products are formed in
bf16 and converted back (torchao's _scaled_mm output-dtype workaround).
"""
import torch
from torch import nn

F8 = torch.float8_e4m3fn
F8_MAX = torch.finfo(F8).max


def scale_of(amax):
    s = F8_MAX / torch.clamp(amax.to(torch.float64), min=1e-12)
    s = s.to(torch.float32)
    return torch.exp2(torch.floor(torch.log2(s)))


def to_f8(t, s):
    return (t.to(torch.float32) * s).clamp(min=-F8_MAX, max=F8_MAX).to(F8)


def gemm(a, sa, b, sb, out_dtype, fast_accum):
    inv_a, inv_b = sa.reciprocal(), sb.reciprocal()
    mm_dtype = torch.bfloat16 if out_dtype in (torch.float16, torch.float32) else out_dtype
    if fast_accum:
        out = torch._scaled_mm(a, b, scale_a=inv_a, scale_b=inv_b, out_dtype=mm_dtype,
                               use_fast_accum=fast_accum)
    else:
        ones = inv_a.new_ones(())
        out = torch._scaled_mm(a, b, scale_a=ones, scale_b=ones, out_dtype=mm_dtype,
                               use_fast_accum=fast_accum)
        out = out.to(out_dtype) * (inv_a * inv_b)
    return out.to(out_dtype)


class GwHpMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        x2d = x.reshape(-1, x.shape[-1])
        sx = scale_of(x2d.abs().amax(dim=-1, keepdim=True))      # [M,1]
        sw = scale_of(w.abs().amax(dim=-1, keepdim=True))        # [N,1]
        out = gemm(to_f8(x2d, sx).contiguous(), sx, to_f8(w, sw).contiguous().t(), sw.t(),
                   x.dtype, True)
        return out.reshape(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_out):
        x, w = ctx.saved_tensors
        go = grad_out.reshape(-1, grad_out.shape[-1])
        sg = scale_of(go.abs().amax(dim=-1, keepdim=True))       # [M,1]
        sw = scale_of(w.abs().max())                             # tensorwise
        sw_row = sw.repeat(w.shape[1]).reshape(1, -1)            # [1,K]
        w8 = to_f8(w, sw)
        grad_x = gemm(to_f8(go, sg).contiguous(), sg, w8.t().contiguous().t(), sw_row,
                      go.dtype, False)
        grad_w = torch.mm(go.t(), x.reshape(-1, x.shape[-1]))
        return grad_x.reshape(*grad_out.shape[:-1], grad_x.shape[-1]), grad_w


class GwHpFloat8Linear(nn.Linear):
    @classmethod
    def from_float(cls, mod):
        with torch.device("meta"):
            new = cls(mod.in_features, mod.out_features, bias=False)
        new.weight = mod.weight
        new.bias = mod.bias
        return new

    def forward(self, input):
        out = GwHpMatmul.apply(input, self.weight)
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out
