"""rowwise_with_gw_hp FP8 linear, function form.

output      = input (e4m3, per-row pow2 scales) @ weight.T (e4m3, per-output-row pow2 scales), fast accum
grad_input  = grad_output (e4m3, per-row pow2 scales) @ weight (e4m3, ONE pow2 tensorwise scale)
grad_weight = grad_output.T @ input in high precision (no fp8 at all)
"""
import torch

F8 = torch.float8_e4m3fn
F8MAX = 448.0


def pow2_scale(amax):
    s = (F8MAX / amax.to(torch.float64).clamp(min=1e-12)).to(torch.float32)
    return torch.exp2(torch.floor(torch.log2(s)))


def cast(t, s):
    return (t.to(torch.float32) * s).clamp(-F8MAX, F8MAX).to(F8)


def rowwise_cast(t):
    s = pow2_scale(t.abs().amax(dim=-1, keepdim=True))
    return cast(t, s), s


def tensorwise_cast(t):
    s = pow2_scale(t.abs().max())
    return cast(t, s), s


def bf16_or(dtype):
    return torch.bfloat16 if dtype in (torch.float16, torch.float32) else dtype


class GwHpLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        xq, xs = rowwise_cast(x)                     # [M, K], [M, 1]
        wq, ws = rowwise_cast(w)                     # [N, K], [N, 1]
        y = torch._scaled_mm(xq, wq.contiguous().t(),
                             scale_a=xs.reciprocal(), scale_b=ws.reciprocal().t(),
                             out_dtype=bf16_or(x.dtype), use_fast_accum=True)
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, gy):
        x, w = ctx.saved_tensors
        gq, gs = rowwise_cast(gy)                    # [M, N], [M, 1]
        wq, ws = tensorwise_cast(w)                  # [N, K], scalar
        unit = torch.ones((), dtype=torch.float32, device=gy.device)
        gx = torch._scaled_mm(gq.contiguous(), wq.t().contiguous().t(), scale_a=unit, scale_b=unit,
                              out_dtype=bf16_or(gy.dtype), use_fast_accum=False)
        gx *= gs.reciprocal() * ws.reciprocal().expand(1, w.shape[1])
        gx = gx.to(gy.dtype)
        gw = torch.mm(gy.t(), x)                     # high precision
        return gx, gw


def linear_gw_hp(input, weight, bias=None):
    y = GwHpLinear.apply(input.reshape(-1, input.shape[-1]), weight)
    y = y.reshape(*input.shape[:-1], y.shape[-1])
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y
