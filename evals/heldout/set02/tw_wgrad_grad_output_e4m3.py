"""FP8 (per-tensor current scaling) Linear with a module-swap converter.

    model = swap_linear_with_fp8(model)          # every nn.Linear child becomes Fp8Linear

Quantizer objects own the format of each GEMM operand: e4m3 for activations and weights,
e5m2 for gradients (the "hybrid" format). GEMMs run on torch._scaled_mm.
"""
from typing import Callable, Optional

import torch
from torch import nn


class Float8Data:
    def __init__(self, data, scale_inv):
        self.data = data
        self.scale_inv = scale_inv


class Float8Quantizer:
    def __init__(self, fp8_dtype: torch.dtype, amax_epsilon: float = 1e-12):
        self.dtype = fp8_dtype
        self.max = torch.finfo(fp8_dtype).max
        self.eps = amax_epsilon

    @torch.no_grad()
    def __call__(self, t: torch.Tensor) -> Float8Data:
        amax = t.abs().amax().to(torch.float64)
        scale = (self.max / amax.clamp_min(self.eps)).to(torch.float32)
        data = (t.to(torch.float32) * scale).clamp(-self.max, self.max).to(self.dtype)
        return Float8Data(data, scale.reciprocal())


QUANTIZERS = {
    "input": Float8Quantizer(torch.float8_e4m3fn),
    "weight": Float8Quantizer(torch.float8_e4m3fn),
    "grad_output": Float8Quantizer(torch.float8_e5m2),
    "grad_output_t": Float8Quantizer(torch.float8_e4m3fn),
}
GEMM_FAST_ACCUM = {"fprop": True, "dgrad": False, "wgrad": False}


def _row_major(t):
    return t if t.stride(1) == 1 and t.stride(0) >= t.size(1) else t.contiguous()


def _col_major(t):
    return t if t.stride(0) == 1 and t.stride(1) >= t.size(0) else t.t().contiguous().t()


def fp8_gemm(a: Float8Data, a_t: bool, b: Float8Data, b_t: bool, out_dtype, gemm: str):
    """out = op(a) @ op(b), op = transpose when the flag is set."""
    a_data = a.data.t() if a_t else a.data
    b_data = b.data.t() if b_t else b.data
    return torch._scaled_mm(_row_major(a_data), _col_major(b_data), scale_a=a.scale_inv,
                            scale_b=b.scale_inv, out_dtype=out_dtype,
                            use_fast_accum=GEMM_FAST_ACCUM[gemm])


class _LinearFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, inp, weight):
        ctx.save_for_backward(inp, weight)
        inp_fp8 = QUANTIZERS["input"](inp)
        w_fp8 = QUANTIZERS["weight"](weight)
        return fp8_gemm(inp_fp8, False, w_fp8, True, inp.dtype, "fprop")

    @staticmethod
    def backward(ctx, grad_output):
        inp, weight = ctx.saved_tensors
        go_fp8 = QUANTIZERS["grad_output"](grad_output)
        w_fp8 = QUANTIZERS["weight"](weight)
        dgrad = fp8_gemm(go_fp8, False, w_fp8, False, grad_output.dtype, "dgrad")
        go_t_fp8 = QUANTIZERS["grad_output_t"](grad_output)
        inp_fp8 = QUANTIZERS["input"](inp)
        wgrad = fp8_gemm(go_t_fp8, True, inp_fp8, False, grad_output.dtype, "wgrad")
        return dgrad, wgrad


class Fp8Linear(nn.Linear):
    def forward(self, inp):
        inp2d = inp.reshape(-1, inp.shape[-1])
        out = _LinearFunc.apply(inp2d, self.weight)
        out = out.view(*inp.shape[:-1], self.out_features)
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out

    @classmethod
    def from_float(cls, linear: nn.Linear) -> "Fp8Linear":
        with torch.device("meta"):
            m = cls(linear.in_features, linear.out_features, bias=False)
        m.weight = linear.weight
        m.bias = linear.bias
        return m


def swap_linear_with_fp8(module: nn.Module, *,
                         module_filter_fn: Optional[Callable[[nn.Module, str], bool]] = None,
                         **kwargs) -> nn.Module:
    def visit(mod, fqn):
        if type(mod) is nn.Linear:
            if module_filter_fn is None or module_filter_fn(mod, fqn):
                return Fp8Linear.from_float(mod)
            return mod
        for name, child in list(mod.named_children()):
            setattr(mod, name, visit(child, f"{fqn}.{name}" if fqn else name))
        return mod

    return visit(module, "")
