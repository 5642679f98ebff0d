"""[planted bug: weight column scales not inverted before post-scaling grad_input]

Held-out set 15, twin h15_c04.py; labels in manifest.json.
"""
import torch

E4M3 = torch.float8_e4m3fn
GRAD_DTYPE = torch.float8_e4m3fn  # rowwise keeps gradients in e4m3 as well
EPS = 1e-12


def _quant(t, dim, fp8_dtype=E4M3):
    """Quantize t along `dim` (amax over that dim); returns (fp8, power-of-two scale)."""
    fmax = torch.finfo(fp8_dtype).max
    amax = t.abs().amax(dim=dim, keepdim=True).to(torch.float64)
    scale = (fmax / torch.clamp(amax, min=EPS)).to(torch.float32)
    scale = torch.exp2(torch.floor(torch.log2(scale)))
    q = torch.clamp(t.to(torch.float32) * scale, -fmax, fmax).to(fp8_dtype)
    return q, scale


def _hp_dtype(dtype):
    # torch._scaled_mm with rowwise scales is used with a bf16 result (as torchao does)
    return torch.bfloat16 if dtype in (torch.float16, torch.float32) else dtype


class _RowwiseLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        x2 = x.reshape(-1, x.shape[-1])
        x8, x_scale = _quant(x2, -1)                       # [M, K], [M, 1]
        w8, w_scale = _quant(weight, -1)                   # [N, K], [N, 1]
        a = x8 if x8.is_contiguous() else x8.contiguous()
        b = w8.t() if w8.is_contiguous() else w8.contiguous().t()
        out = torch._scaled_mm(a, b, scale_a=x_scale.reciprocal(), scale_b=w_scale.reciprocal().reshape(1, -1),
                               out_dtype=_hp_dtype(x.dtype), use_fast_accum=True)
        return out.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_output):
        x, weight = ctx.saved_tensors
        out_dtype = grad_output.dtype
        g2 = grad_output.reshape(-1, grad_output.shape[-1])
        x2 = x.reshape(-1, x.shape[-1])

        # grad_input: grad_output rows x weight columns, both along N
        g8, g_scale = _quant(g2, -1, GRAD_DTYPE)            # [M, N], [M, 1]
        wc8, wc_scale = _quant(weight, 0)                   # [N, K], [1, K]
        g_inv = g_scale.reciprocal()
        wc_inv = wc_scale
        one = g_inv.new_ones(())
        a = g8 if g8.is_contiguous() else g8.contiguous()
        b = wc8.t().contiguous().t()
        grad_x = torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=_hp_dtype(out_dtype), use_fast_accum=False)
        grad_x *= g_inv * wc_inv
        grad_x = grad_x.to(out_dtype).reshape(*grad_output.shape[:-1], x.shape[-1])

        # grad_weight: grad_output columns x input columns, both along M
        gc8, gc_scale = _quant(g2, 0, GRAD_DTYPE)           # [M, N], [1, N]
        xc8, xc_scale = _quant(x2, 0)                       # [M, K], [1, K]
        gc_inv = gc_scale.reciprocal().reshape(-1, 1)      # [N, 1]
        xc_inv = xc_scale.reciprocal()
        a = gc8.t().contiguous()
        b = xc8.t().contiguous().t()
        grad_w = torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=_hp_dtype(out_dtype), use_fast_accum=False)
        grad_w *= gc_inv * xc_inv
        return grad_x, grad_w.to(out_dtype)


def fp8_rowwise_linear(input, weight, bias=None):
    """F.linear(input, weight, bias) with FP8 rowwise GEMMs forward and backward."""
    out = _RowwiseLinearFn.apply(input, weight)
    if bias is not None:
        out = out + bias.to(out.dtype)
    return out
