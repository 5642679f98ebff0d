"""[planted bug: The output GEMM's out_dtype is hard-coded to bf16, so an fp32 (or fp16) input gets a bf16 output.]

Copy of tw_fn.py with one small change. Original docstring:

Tensorwise FP8 linear, function form: fp8_linear(input, weight, bias=None).

Dynamic per-tensor scaling as torchao 0.18's Float8Linear "tensorwise" recipe:
e4m3 input and weight, e5m2 grad_output, scale = fp8_max / max|x| (float64 then
float32), saturating cast, inverse scales to torch._scaled_mm, fast accumulation
on the output GEMM only. A is handed over row-major and B column-major.
"""
import torch

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
EPS = 1e-12


def _amax_to_scale(amax, fp8_dtype):
    amax = amax.to(torch.float64)
    scale = torch.finfo(fp8_dtype).max / torch.clamp(amax, min=EPS)
    return scale.to(torch.float32)


def _to_fp8(x, fp8_dtype):
    """Per-tensor dynamic cast: returns (fp8 data with x's strides, scale)."""
    amax = torch.max(torch.abs(x))
    scale = _amax_to_scale(amax, fp8_dtype)
    fp8_max = torch.finfo(fp8_dtype).max
    data = (x.to(torch.float32) * scale).clamp(min=-fp8_max, max=fp8_max).to(fp8_dtype)
    return data, scale


def _is_row_major(t):
    return t.stride(1) == 1 and t.stride(0) > t.stride(1)


def _gemm(a, a_scale, b, b_scale, out_dtype, use_fast_accum):
    """a [M,K] @ b [K,N] in fp8 (cuBLASLt: a row-major, b column-major)."""
    if not _is_row_major(a):
        a = a.contiguous()
    if _is_row_major(b):
        b = b.t().contiguous().t()
    return torch._scaled_mm(
        a,
        b,
        scale_a=a_scale.reciprocal(),
        scale_b=b_scale.reciprocal(),
        out_dtype=out_dtype,
        use_fast_accum=use_fast_accum,
    )


class _Fp8LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        x_fp8, x_scale = _to_fp8(x, E4M3)
        w_fp8, w_scale = _to_fp8(weight, E4M3)
        x_2d = x_fp8.reshape(-1, x.shape[-1])
        wt_fp8 = w_fp8.t()
        out = _gemm(x_2d, x_scale, wt_fp8, w_scale, torch.bfloat16, True)
        return out.reshape(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_output):
        x, weight = ctx.saved_tensors
        go = grad_output.reshape(-1, grad_output.shape[-1])
        go_fp8, go_scale = _to_fp8(go, E5M2)
        w_fp8, w_scale = _to_fp8(weight, E4M3)
        grad_input = _gemm(go_fp8, go_scale, w_fp8, w_scale, go.dtype, False)
        grad_input = grad_input.reshape(*grad_output.shape[:-1], grad_input.shape[-1])
        x_2d = x.reshape(-1, x.shape[-1])
        x_fp8, x_scale = _to_fp8(x_2d, E4M3)
        grad_weight = _gemm(go_fp8.t(), go_scale, x_fp8, x_scale, go.dtype, False)
        return grad_input, grad_weight


def fp8_linear(input, weight, bias=None):
    """F.linear with tensorwise FP8 GEMMs (forward and backward)."""
    out = _Fp8LinearFn.apply(input, weight)
    if bias is not None:
        out = out + bias.to(out.dtype)
    return out
