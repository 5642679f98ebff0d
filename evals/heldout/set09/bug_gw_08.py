"""rowwise_with_gw_hp FP8 linear, converter form, N-D aware, a scaling table.

The recipe is written as data: for each GEMM, how each operand is cast
("row" = per-row pow2 e4m3 scales along the inner dim, "tensor" = one pow2
e4m3 scale, None = stays in high precision). The module saves the original
(N-D) input and the weight; the backward reshapes like torchao does.
"""
import torch
from torch import nn

E4M3 = torch.float8_e4m3fn
FMAX = torch.finfo(E4M3).max

RECIPE = {
    "output": ("row", "row"),
    "grad_input": ("row", "tensor"),
    "grad_weight": (None, None),
}


def _scale(amax):
    s = FMAX / torch.clamp(amax.to(torch.float64), min=1e-12)
    s = s.to(torch.float32)
    return torch.exp2(torch.floor(torch.log2(s)))


def _cast(t, how):
    """t [R, C] with C the inner dim. Returns (fp8, scale of shape [R, 1])."""
    if how == "row":
        s = _scale(torch.amax(torch.abs(t), dim=1, keepdim=True))
    else:
        s = _scale(torch.max(torch.abs(t))).repeat(t.shape[0]).reshape(-1, 1)
    return torch.clamp(t.to(torch.float32) * s, -FMAX, FMAX).to(E4M3), s


def _fp8_gemm(gemm, a, b_t, out_dtype, fast):
    """a [M, K] @ b_t [N, K].T with the recipe's casts for `gemm`."""
    how_a, how_b = RECIPE[gemm]
    aq, sa = _cast(a, how_a)
    bq, sb = _cast(b_t, how_b)
    mm_dtype = torch.bfloat16 if out_dtype in (torch.float16, torch.float32) else out_dtype
    a_inv, b_inv = sa.reciprocal(), sb.t()
    if fast:
        y = torch._scaled_mm(aq.contiguous(), bq.contiguous().t(), scale_a=a_inv, scale_b=b_inv,
                             out_dtype=mm_dtype, use_fast_accum=True)
    else:
        ones = a_inv.new_ones(())
        y = torch._scaled_mm(aq.contiguous(), bq.contiguous().t(), scale_a=ones, scale_b=ones,
                             out_dtype=mm_dtype, use_fast_accum=False)
        y *= a_inv * b_inv
    return y.to(out_dtype)


class _GwHpFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        x2 = x.reshape(-1, x.shape[-1])
        y = _fp8_gemm("output", x2, w, x.dtype, True)
        return y.reshape(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx, gy):
        x, w = ctx.saved_tensors
        g2 = gy.reshape(-1, gy.shape[-1])
        gx = _fp8_gemm("grad_input", g2, w.t(), gy.dtype, False).reshape(x.shape)
        x2 = x.reshape(-1, x.shape[-1])
        gw = torch.mm(g2.t(), x2)
        return gx, gw


class Float8GwHpLinear(nn.Linear):
    def forward(self, x):
        y = _GwHpFn.apply(x, self.weight)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y


def convert(module: nn.Module, **kwargs) -> nn.Module:
    def swap(lin):
        with torch.device("meta"):
            new = Float8GwHpLinear(lin.in_features, lin.out_features, bias=False)
        new.weight, new.bias = lin.weight, lin.bias
        return new

    if isinstance(module, nn.Linear):
        return swap(module)
    for name, child in module.named_children():
        if isinstance(child, nn.Linear):
            setattr(module, name, swap(child))
        else:
            convert(child)
    return module
