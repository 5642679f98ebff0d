"""[planted bug: grad_output cast to e4m3 in the tensorwise recipe]

Held-out set 15, twin h15_c01.py; labels in manifest.json.
"""
import torch

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
EPS = 1e-12


def _scale(amax, fp8_dtype):
    amax = torch.clamp(amax.to(torch.float64), min=EPS)
    return (torch.finfo(fp8_dtype).max / amax).to(torch.float32)


def _cast(x, scale, fp8_dtype):
    fmax = torch.finfo(fp8_dtype).max
    return torch.clamp(x.to(torch.float32) * scale, -fmax, fmax).to(fp8_dtype)


def _row_major(t):
    return t if (t.stride(1) == 1 and t.stride(0) > t.stride(1)) else t.contiguous()


def _col_major(t):
    return t if (t.stride(0) == 1 and t.stride(1) > t.stride(0)) else t.t().contiguous().t()


class _Fp8TensorwiseMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w_t):
        ctx.save_for_backward(x, w_t)
        x2 = x.reshape(-1, x.shape[-1])
        xs = _scale(x2.abs().max(), E4M3)
        ws = _scale(w_t.abs().max(), E4M3)
        x8 = _cast(x2, xs, E4M3)
        w8 = _cast(w_t, ws, E4M3)
        out = torch._scaled_mm(
            _row_major(x8), _col_major(w8),
            scale_a=xs.reciprocal(), scale_b=ws.reciprocal(),
            out_dtype=x.dtype, use_fast_accum=True,
        )
        return out.reshape(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, go):
        x, w_t = ctx.saved_tensors
        g_dtype = E4M3  # same format as the forward operands
        go2 = go.reshape(-1, go.shape[-1])
        gs = _scale(go2.abs().max(), g_dtype)
        g8 = _cast(go2, gs, g_dtype)

        # grad_input = grad_output @ weight
        ws = _scale(w_t.abs().max(), E4M3)
        w8 = _cast(w_t, ws, E4M3)
        gi = torch._scaled_mm(
            _row_major(g8), _col_major(w8.t()),
            scale_a=gs.reciprocal(), scale_b=ws.reciprocal(),
            out_dtype=go.dtype, use_fast_accum=False,
        )

        # grad_weight = grad_output.T @ input
        x2 = x.reshape(-1, x.shape[-1])
        xs = _scale(x2.abs().max(), E4M3)
        x8 = _cast(x2, xs, E4M3)
        gw = torch._scaled_mm(
            _row_major(g8.t()), _col_major(x8),
            scale_a=gs.reciprocal(), scale_b=xs.reciprocal(),
            out_dtype=go.dtype, use_fast_accum=False,
        )
        return gi.reshape(*go.shape[:-1], gi.shape[-1]), gw.t()


def fp8_linear(input, weight, bias=None):
    """F.linear(input, weight, bias) with the three GEMMs in FP8 (tensorwise)."""
    out = _Fp8TensorwiseMM.apply(input, weight.t())
    if bias is not None:
        out = out + bias.to(out.dtype)
    return out
