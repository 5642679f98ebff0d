"""Reference FP8 linear, rowwise (axiswise) dynamic scaling (held-out set, correct).

Recipe (matches torchao 0.18 Float8LinearConfig.from_recipe_name("rowwise")):
  every operand e4m3 (grad_output too); each GEMM re-quantizes its two operands from the
  high-precision tensors, one scale per row of A / per column of B taken along that GEMM's
  inner dimension; scales are rounded down to a power of two.
    output      = input[M,K] (amax over K)        @ weight.T[K,N] (amax over K)   fast accum
    grad_input  = grad_output[M,N] (amax over N)  @ weight[N,K] (amax over N)
    grad_weight = grad_output.T[N,M] (amax over M) @ input[M,K] (amax over M)
  The output GEMM hands the scales to the rowwise kernel. The two backward GEMMs (no fast
  accumulation) run the kernel with unit scales and multiply the outer product of the inverse
  scales into the result afterwards. A GEMM whose result dtype is fp16 or fp32 produces bf16
  and casts.
"""
import torch
from torch import nn

F8 = torch.float8_e4m3fn
F8_MAX = torch.finfo(F8).max


def _axis_scale(t: torch.Tensor, dim: int) -> torch.Tensor:
    amax = torch.amax(t.abs(), dim=dim, keepdim=True).double()
    s = (F8_MAX / amax.clamp(min=1e-12)).float()
    return torch.exp2(torch.floor(torch.log2(s)))


def _cast(t: torch.Tensor, dim: int):
    s = _axis_scale(t, dim)
    q = (t.float() * s).clamp(min=-F8_MAX, max=F8_MAX).to(F8)
    return q, s.reciprocal()


def _as_a(t):
    return t if (t.stride(1) == 1 and t.stride(0) >= t.size(1)) else t.contiguous()


def _as_b(t):
    return t if (t.stride(0) == 1 and t.stride(1) >= t.size(0)) else t.t().contiguous().t()


def _rowwise_gemm(a, a_inv, b, b_inv, out_dtype, fast_accum):
    """a_inv: [M,1], b_inv: [1,N] inverse scales (fp32)."""
    kernel_dtype = torch.bfloat16 if out_dtype in (torch.float16, torch.float32) else out_dtype
    a, b = _as_a(a), _as_b(b)
    if fast_accum:
        y = torch._scaled_mm(a, b, scale_a=a_inv, scale_b=b_inv, out_dtype=kernel_dtype,
                             use_fast_accum=True)
    else:
        post = a_inv * b_inv
        one = a_inv.new_ones(())
        y = torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=kernel_dtype,
                             use_fast_accum=False)
        y *= post
    return y.to(out_dtype) if kernel_dtype != out_dtype else y


class _RowwiseMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        xq, x_inv = _cast(x, -1)             # [M,1]
        wq, w_inv = _cast(w, -1)             # [N,1]
        return _rowwise_gemm(xq, x_inv, wq.t(), w_inv.t(), x.dtype, True)

    @staticmethod
    def backward(ctx, go):
        x, w = ctx.saved_tensors
        gq, g_inv = _cast(go, -1)            # along N: [M,1]
        wq, w_inv = _cast(w, 0)              # along N: [1,K]
        dx = _rowwise_gemm(gq, g_inv, wq, w_inv, go.dtype, False)
        gq2, g_inv2 = _cast(go, 0)           # along M: [1,N]
        xq2, x_inv2 = _cast(x, 0)            # along M: [1,K]
        dw = _rowwise_gemm(gq2.t(), g_inv2.t(), xq2, x_inv2, go.dtype, False)
        return dx, dw


def fp8_linear(x2d: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return _RowwiseMM.apply(x2d, weight)


class RowwiseFp8Linear(nn.Linear):
    def forward(self, x):
        y = _RowwiseMM.apply(x.reshape(-1, self.in_features), self.weight)
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    @classmethod
    def from_float(cls, lin: nn.Linear):
        with torch.device("meta"):
            m = cls(lin.in_features, lin.out_features, bias=False)
        m.weight, m.bias = lin.weight, lin.bias
        return m


def convert(module: nn.Module, **kwargs) -> nn.Module:
    if type(module) is nn.Linear:
        return RowwiseFp8Linear.from_float(module)
    for name, child in list(module.named_children()):
        setattr(module, name, convert(child, **kwargs))
    return module
