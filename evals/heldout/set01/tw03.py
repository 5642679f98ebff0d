"""FP8 linear (tensorwise) built on one generic scaled GEMM helper.

`_fp8_gemm(a, b)` accepts the second operand either as [inner, n] or as [n, inner]
(nn.Linear stores weights as [out, in]) and orients it itself, so callers do not need to
remember which GEMM wants which transpose.
"""
import torch

FP8_FWD = torch.float8_e4m3fn
FP8_BWD = torch.float8_e5m2


class Scaled:
    """fp8 payload + the inverse scale that dequantizes it"""

    def __init__(self, hp, dtype):
        fmax = torch.finfo(dtype).max
        amax = hp.detach().abs().max().double().clamp(min=1e-12)
        scale = (fmax / amax).float()
        self.data = (hp.detach().float() * scale).clamp(-fmax, fmax).to(dtype)
        self.inv = scale.reciprocal()

    def t(self):
        out = object.__new__(Scaled)
        out.data, out.inv = self.data.t(), self.inv
        return out


def _fp8_gemm(a: Scaled, b: Scaled, out_dtype, fast_accum):
    inner = a.data.shape[1]
    if b.data.shape[0] != inner:          # given as [n, inner]
        b = b.t()
    ad = a.data if a.data.stride(1) == 1 else a.data.contiguous()
    bd = b.data if b.data.stride(0) == 1 else b.data.t().contiguous().t()
    return torch._scaled_mm(ad, bd, scale_a=a.inv, scale_b=b.inv,
                            out_dtype=out_dtype, use_fast_accum=fast_accum)


class LinearFP8(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return _fp8_gemm(Scaled(x, FP8_FWD), Scaled(w, FP8_FWD), x.dtype, True)

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        dy8 = Scaled(dy, FP8_BWD)
        dx = _fp8_gemm(dy8, Scaled(w, FP8_FWD), dy.dtype, False)
        dw = _fp8_gemm(dy8.t(), Scaled(x, FP8_FWD), dy.dtype, False)
        return dx, dw


def linear_fp8(x, w):
    return LinearFP8.apply(x, w)
