"""[planted bug: The bias is added without casting, so an fp32 bias promotes a bf16 output to fp32.]

rowwise_with_gw_hp FP8 linear, converter form: ``to_fp8_gw_hp(module) -> module``.

Recipe (torchao 0.18 "rowwise_with_gw_hp", power-of-two scales everywhere):
  output      = e4m3 x (per row, over K) @ e4m3 W.T (per column, over K), fast accumulation
  grad_input  = e4m3 g (per row, over N) @ e4m3 W (ONE tensorwise scale), unit scales in
                _scaled_mm and the bf16 result multiplied by 1/sa * 1/sb afterwards
  grad_weight = g.T @ x in the caller's precision (no fp8 at all)
The tensorwise weight cast for grad_input is made in the module's forward and kept
with the autograd context.
"""
import torch
from torch import nn

E4M3 = torch.float8_e4m3fn
LIM = torch.finfo(E4M3).max
EPS = 1e-12


def _p2(amax):
    s = (LIM / torch.clamp(amax.to(torch.float64), min=EPS)).to(torch.float32)
    return torch.exp2(torch.floor(torch.log2(s)))


def _fp8(t, s):
    return torch.clamp(t.to(torch.float32) * s, min=-LIM, max=LIM).to(E4M3)


def cast_rows(t, dim):
    s = _p2(torch.amax(t.abs(), dim=dim, keepdim=True))
    return _fp8(t, s), s


def cast_tensor(t):
    s = _p2(t.abs().max())
    return _fp8(t, s), s


def _mm(a, sa, b, sb, dtype, fast):
    ia, ib = sa.reciprocal(), sb.reciprocal()
    work = torch.bfloat16 if dtype in (torch.float16, torch.float32) else dtype
    if fast:
        r = torch._scaled_mm(a, b, scale_a=ia, scale_b=ib, out_dtype=work, use_fast_accum=True)
    else:
        u = ia.new_ones(())
        r = torch._scaled_mm(a, b, scale_a=u, scale_b=u, out_dtype=work, use_fast_accum=False)
        r *= ia * ib
    return r.to(dtype)


class _GwHp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, w_gi):
        ctx.save_for_backward(x, w)
        ctx.w_gi = w_gi
        x2 = x.reshape(-1, x.shape[-1])
        xq, xs = cast_rows(x2, -1)
        wq, ws = cast_rows(w, -1)
        y = _mm(xq.contiguous(), xs, wq.contiguous().t(), ws.t(), x.dtype, True)
        return y.reshape(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx, gy):
        x, w = ctx.saved_tensors
        g2 = gy.reshape(-1, gy.shape[-1])
        gq, gs = cast_rows(g2, -1)
        wq, ws = ctx.w_gi
        ws_k = ws.reshape(1, 1).repeat(1, w.shape[1])
        gx = _mm(gq.contiguous(), gs, wq.t().contiguous().t(), ws_k, g2.dtype, False)
        gw = torch.mm(g2.t(), x.reshape(-1, x.shape[-1]))
        return gx.reshape(*gy.shape[:-1], w.shape[1]), gw, None


class Fp8GwHpLinear(nn.Module):
    def __init__(self, lin):
        super().__init__()
        self.in_features, self.out_features = lin.in_features, lin.out_features
        self.weight, self.bias = lin.weight, lin.bias

    def forward(self, x):
        w_gi = cast_tensor(self.weight.detach())
        y = _GwHp.apply(x, self.weight, w_gi)
        return y if self.bias is None else y + self.bias


def to_fp8_gw_hp(module: nn.Module) -> nn.Module:
    if isinstance(module, nn.Linear):
        return Fp8GwHpLinear(module)
    for name, child in list(module.named_children()):
        setattr(module, name, to_fp8_gw_hp(child))
    return module
