"""In-place float8 (tensorwise) conversion of every nn.Linear in a model.

    model = convert(model)                      # all linears
    model = convert(model, skip=lambda fqn, m: fqn.endswith("lm_head"))

The conversion retypes modules in place (``__class__`` swap), so parameters,
hooks and state_dict keys are untouched.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

FP8_FWD = torch.float8_e4m3fn   # activations and weights
FP8_BWD = torch.float8_e5m2     # gradients


def amax_scale(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    bound = torch.finfo(dtype).max
    amax = torch.minimum(t.detach().abs().amax(), 6 * t.detach().float().std()).double()
    return (bound / amax.clamp_min(1e-12)).float()


def to_float8(t: torch.Tensor, dtype: torch.dtype):
    bound = torch.finfo(dtype).max
    s = amax_scale(t, dtype)
    q = torch.clamp(t.detach().float() * s, -bound, bound).to(dtype)
    return q, s


def mm_float8(a, sa, b, sb, out_dtype, fast_accum=False):
    """a @ b for float8 a [m, k] and b [k, n] with multiplicative scales sa, sb."""
    if not (a.stride(1) == 1 and a.stride(0) > 1):
        a = a.contiguous()
    if b.stride(1) == 1 and b.stride(0) > 1:
        b = b.t().contiguous().t()
    return torch._scaled_mm(a, b, scale_a=sa.reciprocal(), scale_b=sb.reciprocal(),
                            out_dtype=out_dtype, use_fast_accum=fast_accum)


class _Float8Mm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, inp, weight):
        flat = inp.reshape(-1, inp.shape[-1])
        xq, xs = to_float8(flat, FP8_FWD)
        wq, ws = to_float8(weight, FP8_FWD)
        out = mm_float8(xq, xs, wq.t(), ws, inp.dtype, fast_accum=True)
        ctx.save_for_backward(inp, weight)
        return out.view(*inp.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dout):
        inp, weight = ctx.saved_tensors
        d2 = dout.reshape(-1, dout.shape[-1])
        dq, ds = to_float8(d2, FP8_BWD)
        d_inp = d_weight = None
        if ctx.needs_input_grad[0]:
            wq, ws = to_float8(weight, FP8_FWD)
            d_inp = mm_float8(dq, ds, wq, ws, dout.dtype)
            d_inp = d_inp.view(*inp.shape[:-1], inp.shape[-1])
        if ctx.needs_input_grad[1]:
            x2 = inp.reshape(-1, inp.shape[-1])
            xq, xs = to_float8(x2, FP8_FWD)
            d_weight = mm_float8(dq.t(), ds, xq, xs, dout.dtype)
        return d_inp, d_weight


class Float8LinearTW(nn.Linear):
    """An nn.Linear whose matmuls run in float8; created by ``convert``."""

    def forward(self, x):
        y = _Float8Mm.apply(x, self.weight)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y


def convert(model: nn.Module, skip=None) -> nn.Module:
    for fqn, mod in model.named_modules():
        if type(mod) is nn.Linear and not (skip and skip(fqn, mod)):
            mod.__class__ = Float8LinearTW
    return model
