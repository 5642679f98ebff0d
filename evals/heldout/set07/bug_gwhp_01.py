"""rowwise_with_gw_hp FP8 nn.Linear drop-in that caches the fp8 weight used by grad_input."""
import torch
from torch import nn

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
EPS = 1e-12


def _pow2_scale(amax):
    s = (FP8_MAX / torch.clamp(amax.to(torch.float64), min=EPS)).to(torch.float32)
    return torch.exp2(torch.floor(torch.log2(s)))


def _cast(t, scale):
    return (t.to(torch.float32) * scale).clamp(min=-FP8_MAX, max=FP8_MAX).to(FP8)


@torch.no_grad()
def rowwise(t, dim):
    scale = _pow2_scale(torch.amax(torch.abs(t), dim=dim, keepdim=True))
    return _cast(t, scale), scale


@torch.no_grad()
def tensorwise(t):
    scale = _pow2_scale(torch.max(torch.abs(t)))
    return _cast(t, scale), scale


def _row_major(t):
    return t if (t.stride(-1) == 1 and t.stride(0) >= t.shape[-1]) else t.contiguous()


def _col_major(t):
    return t if (t.stride(0) == 1 and t.stride(1) >= t.shape[0]) else t.t().contiguous().t()


def _scaled_mm_rowwise(a, a_scale, b, b_scale, out_dtype, fast_accum):
    a_inv, b_inv = a_scale.reciprocal(), b_scale.reciprocal()
    mm_dtype = out_dtype if out_dtype == torch.bfloat16 else torch.bfloat16
    if fast_accum:
        out = torch._scaled_mm(a, b, scale_a=a_inv, scale_b=b_inv, out_dtype=mm_dtype,
                               use_fast_accum=True)
    else:
        one = a_inv.new_ones(())
        out = torch._scaled_mm(a, b, scale_a=a_inv, scale_b=b_inv, out_dtype=mm_dtype,
                               use_fast_accum=False)
        out *= a_inv * b_inv
    return out.to(out_dtype)


class _GwHpFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, w_gi_fp8, w_gi_scale):
        x2 = x.reshape(-1, x.shape[-1])
        xq, xs = rowwise(x2, -1)
        wq, ws = rowwise(weight, -1)
        out = _scaled_mm_rowwise(_row_major(xq), xs, _col_major(wq.t()), ws.t(), x.dtype, True)
        ctx.save_for_backward(x2, w_gi_fp8, w_gi_scale)
        ctx.x_shape = x.shape
        return out.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_output):
        x2, w_gi_fp8, w_gi_scale = ctx.saved_tensors
        go2 = grad_output.reshape(-1, grad_output.shape[-1])
        goq, gos = rowwise(go2, -1)
        k = w_gi_fp8.shape[1]
        w_scale_cols = w_gi_scale.repeat(k).reshape(1, -1)
        grad_input = _scaled_mm_rowwise(
            _row_major(goq), gos, w_gi_fp8, w_scale_cols, grad_output.dtype, False
        )
        grad_input = grad_input.reshape(ctx.x_shape)
        grad_weight = torch.mm(go2.t(), x2)
        return grad_input, grad_weight, None, None


class GwHpFloat8Linear(nn.Linear):
    @classmethod
    def from_float(cls, mod):
        with torch.device("meta"):
            new = cls(mod.in_features, mod.out_features, bias=False)
        new.weight = mod.weight
        new.bias = mod.bias
        return new

    def _grad_input_weight(self):
        w = self.weight
        key = (w._version, w.data_ptr(), w.dtype, tuple(w.stride()))
        cached = self.__dict__.get("_w_gi")
        if cached is None or cached[0] != key:
            w_fp8, w_scale = tensorwise(w)
            cached = (key, w_fp8.t().contiguous().t(), w_scale)
            self.__dict__["_w_gi"] = cached
        return cached[1], cached[2]

    def forward(self, input):
        w_gi_fp8, w_gi_scale = self._grad_input_weight()
        out = _GwHpFn.apply(input, self.weight, w_gi_fp8, w_gi_scale)
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out
