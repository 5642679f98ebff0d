"""Rowwise FP8 linear, function form, compact functional style.

Each GEMM is `_fp8_rowwise_gemm(A, B_t)`: both operands given row-major in
their logical [rows, inner] shape (B as its transpose), each quantized along
the inner dimension with power-of-2 e4m3 scales. Autograd saves the
high-precision input and weight.
"""
import torch

_E4M3 = torch.float8_e4m3fn
_MAX = torch.finfo(_E4M3).max


def _quant_rows(t):
    """Quantize along the last dim; returns (fp8 [R, C], inverse scale [R, 1])."""
    amax = t.abs().amax(dim=-1, keepdim=True).to(torch.float64).clamp(min=1e-12)
    s = (_MAX / amax).to(torch.float32)
    s = torch.exp2(torch.floor(torch.log2(s)))
    q = (t.to(torch.float32) * s).clamp(-_MAX, _MAX).to(_E4M3)
    return q, s.reciprocal()


def _fp8_rowwise_gemm(a, b_t, out_dtype, fast):
    """a [M, K], b_t [N, K] -> a @ b_t.T in out_dtype."""
    aq, a_inv = _quant_rows(a)
    bq, b_inv = _quant_rows(b_t)
    aq = aq.contiguous()
    bq = bq.contiguous().t()             # [K, N] column-major
    b_inv = b_inv.t()                    # [1, N]
    mm_dtype = torch.bfloat16 if out_dtype in (torch.float16, torch.float32) else out_dtype
    if fast:
        out = torch._scaled_mm(aq, bq, scale_a=a_inv, scale_b=b_inv, out_dtype=mm_dtype,
                               use_fast_accum=True)
    else:
        one = torch.ones((), device=a.device, dtype=torch.float32)
        out = torch._scaled_mm(aq, bq, scale_a=one, scale_b=one, out_dtype=mm_dtype,
                               use_fast_accum=False)
        out.mul_(a_inv * b_inv)
    return out.to(out_dtype)


class _Fn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return _fp8_rowwise_gemm(x, w, x.dtype, True)

    @staticmethod
    def backward(ctx, go):
        x, w = ctx.saved_tensors
        grad_x = _fp8_rowwise_gemm(go, w if w.shape[1] == go.shape[1] else w.t(), go.dtype, False)
        grad_w = _fp8_rowwise_gemm(go.t(), x.t(), go.dtype, False)
        return grad_x, grad_w


def fp8_rowwise_linear(input, weight, bias=None):
    shape = input.shape
    y = _Fn.apply(input.reshape(-1, shape[-1]), weight)
    y = y.reshape(*shape[:-1], weight.shape[0])
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y
