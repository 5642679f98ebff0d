"""rowwise_with_gw_hp FP8 linear as a single function.

Scaling helpers: `_rowwise_scale` (power-of-two, as the rowwise kernels want exact
rescaling) and `_tensor_scale` (one scale per tensor)."""
import torch

F8 = torch.float8_e4m3fn
F8MAX = torch.finfo(F8).max
EPS = 1e-12


def _rowwise_scale(t, dim):
    amax = t.abs().amax(dim=dim, keepdim=True).to(torch.float64)
    s = (F8MAX / amax.clamp(min=EPS)).to(torch.float32)
    return torch.exp2(torch.floor(torch.log2(s)))


def _tensor_scale(t):
    amax = t.abs().max().to(torch.float64)
    return (F8MAX / amax.clamp(min=EPS)).to(torch.float32)


def _to_f8(t, s):
    return (t.to(torch.float32) * s).clamp(-F8MAX, F8MAX).to(F8)


def _a_layout(t):
    return t if t.stride(1) == 1 and t.stride(0) > 1 else t.contiguous()


def _b_layout(t):
    return t.t().contiguous().t() if t.stride(1) == 1 and t.stride(0) > 1 else t


def _out(dt):
    return torch.bfloat16 if dt in (torch.float16, torch.float32) else dt


class GwHpLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        sx = _rowwise_scale(x, -1)
        sw = _rowwise_scale(w, -1)
        y = torch._scaled_mm(_a_layout(_to_f8(x, sx)), _b_layout(_to_f8(w, sw).t()),
                             scale_a=sx.reciprocal(), scale_b=sw.reciprocal().t(),
                             out_dtype=_out(x.dtype), use_fast_accum=True)
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, go):
        x, w = ctx.saved_tensors
        sg = _rowwise_scale(go, -1)
        sw = _tensor_scale(w)
        unit = torch.ones((), device=go.device)
        gi = torch._scaled_mm(_a_layout(_to_f8(go, sg)), _b_layout(_to_f8(w, sw)),
                              scale_a=unit, scale_b=unit, out_dtype=_out(go.dtype),
                              use_fast_accum=False)
        gi *= sg.reciprocal() * sw.reciprocal().expand(1, w.shape[1])
        gw = torch.mm(go.t(), x)
        return gi.to(go.dtype), gw


def gwhp_fp8_linear(x, w):
    return GwHpLinearFn.apply(x, w)
