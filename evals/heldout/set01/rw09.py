"""Rowwise FP8 linear with a persistent fp8 weight (for gradient accumulation).

The weight is quantized once and reused by every micro-batch; call
`refresh_fp8_weights(model)` after each optimizer step."""
import torch
import torch.nn as nn

FP8 = torch.float8_e4m3fn
LIM = torch.finfo(FP8).max


def _q(t, dim):
    amax = t.abs().amax(dim=dim, keepdim=True).double().clamp(min=1e-12)
    s = torch.exp2(torch.floor(torch.log2((LIM / amax).float())))
    return (t.float() * s).clamp(-LIM, LIM).to(FP8), s


def _mm_rowwise(a, sa, b, sb, out_dtype, fast):
    a = a if (a.stride(1) == 1 and a.stride(0) > 1) else a.contiguous()
    b = b if (b.stride(0) == 1 and b.stride(1) > 1) else b.t().contiguous().t()
    dt = torch.bfloat16 if out_dtype in (torch.float16, torch.float32) else out_dtype
    if fast:
        r = torch._scaled_mm(a, b, scale_a=sa.reciprocal(), scale_b=sb.reciprocal(), out_dtype=dt,
                             use_fast_accum=True)
    else:
        u = sa.new_ones(())
        r = torch._scaled_mm(a, b, scale_a=u, scale_b=u, out_dtype=dt, use_fast_accum=False)
        r *= sa.reciprocal() * sb.reciprocal()
    return r.to(out_dtype)


class _PersistentW(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, w8, ws):
        ctx.save_for_backward(x, weight)
        xq, xs = _q(x, -1)
        return _mm_rowwise(xq, xs, w8.t(), ws.t(), x.dtype, True)

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        gq, gs = _q(g, -1)
        wq, wsc = _q(weight, 0)
        dx = _mm_rowwise(gq, gs, wq, wsc, g.dtype, False)
        gq0, gs0 = _q(g, 0)
        xq0, xs0 = _q(x, 0)
        dw = _mm_rowwise(gq0.t(), gs0.t(), xq0, xs0, g.dtype, False)
        return dx, dw, None, None


class PersistentFp8Linear(nn.Linear):
    def refresh(self):
        with torch.no_grad():
            self._w8, self._ws = _q(self.weight, -1)
        self._w_id = id(self.weight)

    def forward(self, x):
        if getattr(self, "_w_id", None) != id(self.weight):
            self.refresh()
        y = _PersistentW.apply(x.reshape(-1, x.shape[-1]), self.weight, self._w8, self._ws)
        y = y.reshape(*x.shape[:-1], y.shape[-1])
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y


def refresh_fp8_weights(model):
    for m in model.modules():
        if isinstance(m, PersistentFp8Linear):
            m.refresh()


def to_persistent_fp8(model, **kwargs):
    if type(model) is nn.Linear:
        with torch.device("meta"):
            new = PersistentFp8Linear(model.in_features, model.out_features, bias=False)
        new.weight, new.bias = model.weight, model.bias
        return new
    for name, child in list(model.named_children()):
        setattr(model, name, to_persistent_fp8(child))
    return model
