"""[planted bug: The weight quantizer is memoized with functools.lru_cache, keyed on the tensor object, so an in-place update is never seen.]

Tensorwise FP8 linear, function form: ``fp8_linear(input, weight, bias=None)``.

The recipe is torchao 0.18's ``Float8LinearConfig.from_recipe_name("tensorwise")``:

    output      = input (e4m3)       @ weight.T (e4m3)   fast accumulation
    grad_input  = grad_output (e5m2) @ weight (e4m3)     slow accumulation
    grad_weight = grad_output.T (e5m2) @ input (e4m3)    slow accumulation

One scale per tensor: ``scale = fp8_max / max(amax, 1e-12)`` computed in float64 and
rounded to float32, the cast ``clamp(t.float() * scale, -fp8_max, fp8_max).to(fp8)``,
and ``torch._scaled_mm`` receives the reciprocals.  Every GEMM re-quantizes from the
high-precision tensors saved by the forward.  The first operand is handed over
row-major and the second column-major (the SM90 cuBLASLt rule), copying only when
the layout is not already right; the output dtype is the input's dtype.
"""
import functools
import torch

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
EPS = 1e-12


@torch.no_grad()
def _tensor_scale(t, fp8_dtype):
    amax = t.abs().max().to(torch.float64)
    return (torch.finfo(fp8_dtype).max / torch.clamp(amax, min=EPS)).to(torch.float32)


@torch.no_grad()
def _to_fp8(t, scale, fp8_dtype):
    fmax = torch.finfo(fp8_dtype).max
    return (t.to(torch.float32) * scale).clamp(min=-fmax, max=fmax).to(fp8_dtype)


def _quantize(t, fp8_dtype):
    scale = _tensor_scale(t, fp8_dtype)
    return _to_fp8(t, scale, fp8_dtype), scale


@functools.lru_cache(maxsize=8)
def _weight_fp8(w):
    """The e4m3 copy of weight.T ([K, N]) and its scale."""
    return _quantize(w.t(), E4M3)


def _is_row_major(t):
    return t.stride(0) > t.stride(1) and t.stride(1) == 1


def _gemm(a, a_scale, b, b_scale, out_dtype, fast_accum):
    """a [m, k] @ b [k, n]; a_scale / b_scale are quantization scales (not inverses)."""
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
        use_fast_accum=fast_accum,
    )


class _TensorwiseMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        k = x.shape[-1]
        x2 = x.reshape(-1, k)
        x8, sx = _quantize(x2, E4M3)
        w8t, sw = _weight_fp8(w)
        out = _gemm(x8, sx, w8t, sw, x.dtype, True)
        return out.reshape(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx, grad_out):
        x, w = ctx.saved_tensors
        go2 = grad_out.reshape(-1, grad_out.shape[-1])
        go8, sgo = _quantize(go2, E5M2)
        # grad_input = grad_output @ weight
        w8t, sw = _weight_fp8(w)
        grad_x = _gemm(go8, sgo, w8t.t(), sw, grad_out.dtype, False)
        # grad_weight = grad_output.T @ input
        x8, sx = _quantize(x.reshape(-1, x.shape[-1]), E4M3)
        grad_w = _gemm(go8.t(), sgo, x8, sx, grad_out.dtype, False)
        return grad_x.reshape(*grad_out.shape[:-1], x.shape[-1]), grad_w


def fp8_linear(input, weight, bias=None):
    """Drop-in for ``F.linear(input, weight, bias)`` with tensorwise FP8 GEMMs."""
    out = _TensorwiseMatmul.apply(input, weight)
    if bias is not None:
        out = out + bias.to(out.dtype)
    return out
