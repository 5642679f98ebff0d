"""Float8 linear, recipe "rowwise_with_gw_hp".

    output      = input (rows, e4m3)       @ weight.T (columns, e4m3)
    grad_input  = grad_output (rows, e4m3) @ weight (one tensor-wide e4m3 scale)
    grad_weight = grad_output.T @ input    in the original precision

All float8 scales are rounded down to powers of two.
"""
import torch
from torch import nn

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
EPS = 1e-12


def _pow2_floor(s):
    return torch.exp2(torch.floor(torch.log2(s)))


@torch.no_grad()
def rowwise_cast(t, dim):
    amax = torch.amax(torch.abs(t), dim=dim, keepdim=True)
    s = (FP8_MAX / torch.clamp(amax.to(torch.float64), min=EPS)).to(torch.float32)
    s = _pow2_floor(s)
    return torch.clamp(t.to(torch.float32) * s, -FP8_MAX, FP8_MAX).to(FP8), s


@torch.no_grad()
def tensorwise_cast(t):
    amax = torch.max(torch.abs(t))
    s = (FP8_MAX / torch.clamp(amax.to(torch.float64), min=EPS)).to(torch.float32)
    s = _pow2_floor(s)
    return torch.clamp(t.to(torch.float32) * s, -FP8_MAX, FP8_MAX).to(FP8), s


def _prep(a, b):
    if not (a.stride(1) == 1 and a.stride(0) > a.stride(1)):
        a = a.contiguous()
    if b.stride(1) == 1 and b.stride(0) > b.stride(1):
        b = b.t().contiguous().t()
    return a, b


def _via_bf16(out_dtype):
    return torch.bfloat16 if out_dtype in (torch.float16, torch.float32) else out_dtype


class GwHpLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, stats):
        ctx.save_for_backward(x, weight)
        ctx.stats = stats
        return GwHpLinearFunction.output_gemm(x, weight)

    @staticmethod
    def output_gemm(x, weight):
        x2 = x.reshape(-1, x.shape[-1])
        xq, xs = rowwise_cast(x2, -1)
        wq, ws = rowwise_cast(weight, -1)          # [N, 1]
        a, b = _prep(xq, wq.t())
        out = torch._scaled_mm(a, b, scale_a=xs.reciprocal(), scale_b=ws.t().reciprocal(),
                               out_dtype=_via_bf16(x.dtype), use_fast_accum=True)
        out = out.to(x.dtype)
        return out.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def grad_input_gemm(go, weight, stats):
        gq, gs = rowwise_cast(go, -1)
        stats["grad_output_scale"] = gs
        wq, ws = tensorwise_cast(weight)
        a, b = _prep(gq, wq)
        a_inv = gs.reciprocal()
        b_inv = ws.reciprocal().repeat(b.shape[1]).reshape(1, -1)
        one = a_inv.new_ones(())
        out = torch._scaled_mm(a, b, scale_a=one, scale_b=one,
                               out_dtype=_via_bf16(go.dtype), use_fast_accum=False)
        out *= a_inv * b_inv
        return out.to(go.dtype)

    @staticmethod
    def grad_weight_gemm(go, x2):
        return torch.mm(x2.t(), go).view(go.shape[1], x2.shape[1])

    @staticmethod
    def backward(ctx, grad_output):
        x, weight = ctx.saved_tensors
        go = grad_output.reshape(-1, grad_output.shape[-1])
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = GwHpLinearFunction.grad_input_gemm(go, weight, ctx.stats)
            grad_x = grad_x.reshape(*grad_output.shape[:-1], x.shape[-1])
        if ctx.needs_input_grad[1]:
            x2 = x.reshape(-1, x.shape[-1])
            grad_w = GwHpLinearFunction.grad_weight_gemm(go, x2)
        return grad_x, grad_w, None


class Float8LinearGwHp(nn.Linear):
    """Keeps the latest grad_output scales in ``self.stats`` for logging."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.stats = {}

    def forward(self, x):
        y = GwHpLinearFunction.apply(x, self.weight, self.stats)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y

    @classmethod
    def from_float(cls, linear):
        with torch.device("meta"):
            m = cls(linear.in_features, linear.out_features, bias=False)
        m.weight = linear.weight
        m.bias = linear.bias
        return m
