"""FP8 (tensorwise) linear whose quantization is a registered custom op, so torch.compile
treats the cast as one opaque kernel."""
import torch
import torch.nn as nn


def _register():
    @torch.library.custom_op("heldout_tw12::quantize_fp8", mutates_args=())
    def quantize_fp8(x: torch.Tensor, fp8_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        fmax = torch.finfo(fp8_dtype).max
        amax = x.abs().max().to(torch.float64)
        scale = (fmax / amax).to(torch.float32)
        q = (x.to(torch.float32) * scale).clamp(-fmax, fmax).to(fp8_dtype)
        return q, scale.reciprocal()

    @quantize_fp8.register_fake
    def _(x, fp8_dtype):
        return torch.empty_like(x, dtype=fp8_dtype), x.new_empty((), dtype=torch.float32)

    return quantize_fp8


try:  # the op survives a re-import of this file
    quantize_fp8 = torch.ops.heldout_tw12.quantize_fp8
except (AttributeError, RuntimeError):
    quantize_fp8 = _register()


def _as_a(t):
    return t if (t.stride(1) == 1 and t.stride(0) > 1) else t.contiguous()


def _as_b(t):
    return t.t().contiguous().t() if (t.stride(1) == 1 and t.stride(0) > 1) else t


class _Float8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        xq, xinv = quantize_fp8(x, torch.float8_e4m3fn)
        wq, winv = quantize_fp8(w, torch.float8_e4m3fn)
        return torch._scaled_mm(_as_a(xq), _as_b(wq.t()), scale_a=xinv, scale_b=winv,
                                out_dtype=x.dtype, use_fast_accum=True)

    @staticmethod
    def backward(ctx, go):
        x, w = ctx.saved_tensors
        gq, ginv = quantize_fp8(go, torch.float8_e5m2)
        wq, winv = quantize_fp8(w, torch.float8_e4m3fn)
        xq, xinv = quantize_fp8(x, torch.float8_e4m3fn)
        gi = torch._scaled_mm(_as_a(gq), _as_b(wq), scale_a=ginv, scale_b=winv,
                              out_dtype=go.dtype, use_fast_accum=False)
        gw = torch._scaled_mm(_as_a(gq.t()), _as_b(xq), scale_a=ginv, scale_b=xinv,
                              out_dtype=go.dtype, use_fast_accum=False)
        return gi, gw


class OpFloat8Linear(nn.Linear):
    @classmethod
    def from_float(cls, mod):
        with torch.device("meta"):
            new = cls(mod.in_features, mod.out_features, bias=mod.bias is not None)
        new.weight = mod.weight
        new.bias = mod.bias
        return new

    def forward(self, x):
        y = _Float8Linear.apply(x.flatten(0, -2), self.weight)
        y = y.view(*x.shape[:-1], -1)
        return y if self.bias is None else y + self.bias.to(y.dtype)
