"""Reference FP8 linear, "rowwise_with_gw_hp" recipe (held-out set, correct).

Matches torchao 0.18 Float8LinearConfig.from_recipe_name("rowwise_with_gw_hp"):
  output      = input (e4m3, per row along K)  @ weight.T (e4m3, per column along K)   fast accum
  grad_input  = grad_output (e4m3, per row along N) @ weight (e4m3, ONE tensorwise scale)
  grad_weight = grad_output.T @ input in high precision (plain torch.mm, no fp8)
All scales are powers of two (rounded down). The grad_input GEMM runs with unit scales; the
outer product of the inverse scales is multiplied into its (bf16) result afterwards.
"""
import torch
from torch import nn

E4M3 = torch.float8_e4m3fn
MAX = torch.finfo(E4M3).max


def _pow2_scale(amax):
    s = (MAX / amax.double().clamp(min=1e-12)).float()
    return torch.exp2(torch.floor(torch.log2(s)))


def quant_rows(t, dim):
    """Axiswise: amax along `dim` (kept). Returns (fp8, inverse scale)."""
    s = _pow2_scale(t.abs().amax(dim=dim, keepdim=True))
    return (t.float() * s).clamp(-MAX, MAX).to(E4M3), s.reciprocal()


def quant_tensor(t):
    s = _pow2_scale(t.abs().max())
    return (t.float() * s).clamp(-MAX, MAX).to(E4M3), s.reciprocal()


def _lhs(t):
    return t if (t.stride(1) == 1 and t.stride(0) >= t.size(1)) else t.contiguous()


def _rhs(t):
    return t if (t.stride(0) == 1 and t.stride(1) >= t.size(0)) else t.t().contiguous().t()


def _kernel_dtype(dt):
    return torch.bfloat16 if dt in (torch.float16, torch.float32) else dt


class _GwHpMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        xq, xs = quant_rows(x, -1)
        wq, ws = quant_rows(w, -1)
        y = torch._scaled_mm(_lhs(xq), _rhs(wq.t()), scale_a=xs, scale_b=ws.t(),
                             out_dtype=_kernel_dtype(x.dtype), use_fast_accum=True)
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, go):
        x, w = ctx.saved_tensors
        gq, gs = quant_rows(go, -1)                       # [M,1]
        wq, ws = quant_tensor(w)                          # scalar
        ws_row = ws.repeat(w.shape[1]).reshape(1, -1)     # [1,K]
        post = gs * ws_row
        one = gs.new_ones(())
        dx = torch._scaled_mm(_lhs(gq), _rhs(wq), scale_a=one, scale_b=one,
                              out_dtype=_kernel_dtype(go.dtype), use_fast_accum=False)
        dx *= post
        dx = dx.to(go.dtype)
        dw = torch.mm(go.t(), x)                          # high precision
        return dx, dw


def fp8_linear(x2d, weight):
    return _GwHpMM.apply(x2d, weight)


class RowwiseGwHpFp8Linear(nn.Linear):
    def forward(self, x):
        shp = x.shape
        y = _GwHpMM.apply(x.reshape(-1, shp[-1]), self.weight).reshape(*shp[:-1], -1)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y

    @classmethod
    def from_float(cls, lin):
        with torch.device("meta"):
            m = cls(lin.in_features, lin.out_features, bias=False)
        m.weight = lin.weight
        m.bias = lin.bias
        return m


def convert(module, **kwargs):
    if isinstance(module, nn.Linear) and not isinstance(module, RowwiseGwHpFp8Linear):
        return RowwiseGwHpFp8Linear.from_float(module)
    for n, c in list(module.named_children()):
        setattr(module, n, convert(c, **kwargs))
    return module
