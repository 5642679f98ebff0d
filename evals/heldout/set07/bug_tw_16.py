"""Tensorwise FP8 nn.Linear that keeps its fp8 weight cached between calls."""
import torch
from torch import nn

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
EPS = 1e-12


@torch.no_grad()
def _quantize(t, fp8_dtype):
    fmax = torch.finfo(fp8_dtype).max
    amax = torch.max(torch.abs(t)).to(torch.float64)
    scale = (fmax / torch.clamp(amax, min=EPS)).to(torch.float32)
    data = (t.to(torch.float32) * scale).clamp(min=-fmax, max=fmax).to(fp8_dtype)
    return data, scale


class _CachedWeightFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, w_fp8, w_t_fp8, w_scale):
        x2 = x.reshape(-1, x.shape[-1])
        x_fp8, x_scale = _quantize(x2, E4M3)
        ctx.save_for_backward(x, w_t_fp8, w_scale)
        ctx.w_shape = weight.shape
        out_dtype = x.dtype
        out = torch._scaled_mm(
            x_fp8.contiguous(),
            w_fp8.t(),
            scale_a=x_scale.reciprocal(),
            scale_b=w_scale.reciprocal(),
            out_dtype=out_dtype,
            use_fast_accum=True,
        )
        return out.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_output):
        x, w_t_fp8, w_scale = ctx.saved_tensors
        go2 = grad_output.reshape(-1, grad_output.shape[-1])
        go_fp8, go_scale = _quantize(go2, E5M2)
        go_fp8 = go_fp8.contiguous()
        grad_input = torch._scaled_mm(
            go_fp8,
            w_t_fp8.t(),
            scale_a=go_scale.reciprocal(),
            scale_b=w_scale.reciprocal(),
            out_dtype=grad_output.dtype,
            use_fast_accum=False,
        )
        grad_input = grad_input.reshape(*grad_output.shape[:-1], ctx.w_shape[1])
        x_fp8, x_scale = _quantize(x.reshape(-1, x.shape[-1]), E4M3)
        grad_weight = torch._scaled_mm(
            go_fp8.t().contiguous(),
            x_fp8.t().contiguous().t(),
            scale_a=go_scale.reciprocal(),
            scale_b=x_scale.reciprocal(),
            out_dtype=grad_output.dtype,
            use_fast_accum=False,
        )
        return grad_input, grad_weight, None, None, None


class CachedFloat8Linear(nn.Linear):
    @classmethod
    def from_float(cls, mod):
        with torch.device("meta"):
            new = cls(mod.in_features, mod.out_features, bias=False)
        new.weight = mod.weight
        new.bias = mod.bias
        new._fp8_cache = {}
        return new

    def _weight_key(self):
        w = self.weight
        return (w._version, w.data_ptr(), w.dtype, w.device, tuple(w.stride()))

    def _cached(self, slot, build):
        key = self._weight_key()
        cache = self.__dict__.setdefault("_fp8_cache", {})
        entry = cache.get(slot)
        if entry is None or entry[0] != key:
            entry = (key, *build())
            cache[slot] = entry
        return entry[1:]

    def _fp8_weight(self, w):
        w_fp8, w_scale = self._cached("w", lambda: _quantize(w, E4M3))
        w_t_fp8, _ = self._cached("w_t", lambda: (w_fp8.t().contiguous(), w_scale))
        return w_fp8.contiguous(), w_t_fp8, w_scale

    def forward(self, input):
        w_fp8, w_t_fp8, w_scale = self._fp8_weight(self.weight.to(input.dtype))
        out = _CachedWeightFn.apply(input, self.weight, w_fp8, w_t_fp8, w_scale)
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out
