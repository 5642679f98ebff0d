"""Tensorwise FP8 linear as a plain function: functional helpers and one autograd.Function."""
import torch

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
EPS = 1e-12


def _amax_to_scale(amax, fp8_dtype):
    amax = amax.to(torch.float64)
    return (torch.finfo(fp8_dtype).max / torch.clamp(amax, min=EPS)).to(torch.float32)


def _saturate(t32, fp8_dtype):
    fmax = torch.finfo(fp8_dtype).max
    return t32.clamp(min=-fmax, max=fmax).to(fp8_dtype)


def _quantize(t, fp8_dtype):
    scale = _amax_to_scale(torch.max(torch.abs(t)), fp8_dtype)
    return _saturate(t.to(torch.float32) * scale, fp8_dtype), scale


def _quantize_weight(w):
    flat = w.reshape(-1)
    data, scale = _quantize(flat, E4M3)
    return data.view(w.shape), scale


def _mm(a, a_scale, b, b_scale, out_dtype, fast_accum):
    return torch._scaled_mm(
        a,
        b,
        scale_a=a_scale.reciprocal(),
        scale_b=b_scale.reciprocal(),
        out_dtype=out_dtype,
        use_fast_accum=fast_accum,
    )


class _Fp8TensorwiseMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        x2 = x.reshape(-1, x.shape[-1])
        x_amax = torch.max(torch.abs(x2))
        x_scale = _amax_to_scale(x_amax, E4M3)
        x_fp8 = _saturate(x2.to(torch.float32) * x_scale, E4M3)
        w_fp8, w_scale = _quantize_weight(w)
        ctx.save_for_backward(x, w)
        out = _mm(x_fp8.contiguous(), x_scale, w_fp8.t(), w_scale, x.dtype, True)
        return out.reshape(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx, grad_output):
        x, w = ctx.saved_tensors
        go2 = grad_output.reshape(-1, grad_output.shape[-1])
        go_fp8, go_scale = _quantize(go2, E4M3)
        w_fp8, w_scale = _quantize_weight(w)
        grad_input = _mm(
            go_fp8.contiguous(), go_scale, w_fp8.t().contiguous().t(), w_scale,
            grad_output.dtype, False,
        )
        grad_input = grad_input.reshape(*grad_output.shape[:-1], w.shape[1])

        x2 = x.reshape(-1, x.shape[-1])
        x_fp8, x_scale = _quantize(x2, E4M3)
        grad_weight = _mm(
            go_fp8.t().contiguous(), go_scale, x_fp8.t().contiguous().t(), x_scale,
            grad_output.dtype, False,
        )
        return grad_input, grad_weight


def fp8_linear(input, weight, bias=None):
    out = _Fp8TensorwiseMatmul.apply(input, weight)
    if bias is not None:
        out = out + bias.to(out.dtype)
    return out
