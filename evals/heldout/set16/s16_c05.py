"""[correct: MXFP8 (recipe mxfp8, RCEIL) with an emulated GEMM and no scaled_mm call: each operand is
quantized exactly as MX-SPEC.md says (blocks of 32 along the contraction dim, e8m0 scales, e4m3
elements), dequantized to float32, multiplied in float32 and rounded to the output dtype once]"""
import torch

BLOCK = 32
FP8_MAX = 448.0


def _exp2i(e):
    e = e.to(torch.int32)
    return torch.where(e >= -126, (e + 127) << 23, torch.full_like(e, 1 << 22)).view(torch.float32)


def mx_fake_quant(x):
    """Quantize-dequantize x [rows, k] along k: returns float32 values q * 2**e."""
    rows, k = x.shape
    xb = x.float().reshape(rows, k // BLOCK, BLOCK)
    amax = xb.abs().amax(-1)
    special = ~torch.isfinite(amax)
    m, ex = torch.frexp(amax / FP8_MAX)
    e = torch.where(m == 0.5, ex - 1, ex)
    e = torch.where(amax > 0, e, torch.full_like(e, -127)).clamp(-127, 127)
    s = _exp2i(e)[..., None]
    q = (xb / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
    deq = q * s
    deq = torch.where(special[..., None], torch.full_like(deq, float("nan")), deq)
    return deq.reshape(rows, k)


def _emulated_mm(a, b_t, out_dtype):
    """A [m, k] and B^T [n, k], both quantized along k; fp32 product, one rounding to out_dtype."""
    return torch.matmul(mx_fake_quant(a), mx_fake_quant(b_t).t()).to(out_dtype)


class _EmulatedMXLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return _emulated_mm(x, w, x.dtype)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        g = g.contiguous()
        gx = _emulated_mm(g, w.t().contiguous(), x.dtype)
        gw = _emulated_mm(g.t().contiguous(), x.t().contiguous(), w.dtype)
        return gx, gw


def fp8_linear(input_2d, weight):
    return _EmulatedMXLinear.apply(input_2d, weight)
