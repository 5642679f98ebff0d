"""rowwise_with_gw_hp FP8 linear, module form: GwHpLinear.from_float(linear).

Written after torchao 0.18's matmul_with_hp_or_float8_args for the
"rowwise_with_gw_hp" recipe (bitwise equal on CPU): the autograd function receives
weight.t(); output GEMM rowwise e4m3 x e4m3 (power-of-2 scales along K, fast
accumulation); grad_input = grad_output (rowwise e4m3 along N) @ weight (one
tensorwise power-of-2 e4m3 scale, repeated into a [1, K] row); grad_weight is a plain
high-precision mm of the saved tensors.
"""
import torch
from torch import nn

F8 = torch.float8_e4m3fn
F8_MAX = torch.finfo(torch.float8_e4m3fn).max
EPS = 1e-12


def _scale_from_amax(amax):
    s = F8_MAX / torch.clamp(amax.to(torch.float64), min=EPS)
    s = s.to(torch.float32)
    return torch.exp2(torch.floor(torch.log2(s)))


def _quant(hp, axis=None):
    """axis=None: one scale for the tensor; else one scale per slice reduced over axis."""
    if axis is None:
        amax = torch.max(torch.abs(hp))
    else:
        amax = torch.amax(torch.abs(hp), dim=axis, keepdim=True)
    scale = _scale_from_amax(amax)
    data = torch.clamp(hp.to(torch.float32) * scale, min=-F8_MAX, max=F8_MAX).to(F8)
    return data, scale


def _scaled_mm(a, a_scale, b, b_scale, out_dtype, fast_accum):
    if not (a.stride(1) == 1 and a.stride(0) > a.stride(1)):
        a = a.contiguous()
    if b.stride(1) == 1 and b.stride(0) > b.stride(1):
        b = b.t().contiguous().t()
    if a_scale.dim() == 2 and b_scale.dim() < 2:
        b_scale = b_scale.repeat(b.shape[1]).reshape(1, -1)
    a_inv = a_scale.reciprocal()
    b_inv = b_scale.reciprocal()
    post = None
    if not fast_accum:
        post = a_inv * b_inv
        a_inv = a_inv.new_ones(())
        b_inv = a_inv.new_ones(())
    mm_dtype = out_dtype
    if out_dtype in (torch.float16, torch.float32):
        mm_dtype = torch.bfloat16
    res = torch._scaled_mm(a, b, scale_a=a_inv, scale_b=b_inv, out_dtype=mm_dtype,
                           use_fast_accum=fast_accum)
    if post is not None:
        res *= post
    if mm_dtype != out_dtype:
        res = res.to(out_dtype)
    return res


class _Matmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_hp, weight_hp_t):
        ctx.save_for_backward(input_hp, weight_hp_t)
        shape = input_hp.shape
        inp = input_hp.reshape(-1, shape[-1])
        inp_fp8, inp_scale = _quant(inp, axis=-1)
        w_fp8_t, w_scale = _quant(weight_hp_t, axis=0)
        res = _scaled_mm(inp_fp8, inp_scale, w_fp8_t, w_scale, input_hp.dtype, True)
        return res.reshape(*shape[:-1], res.shape[-1])

    @staticmethod
    def backward(ctx, grad_output):
        input_hp, weight_hp_t = ctx.saved_tensors
        go_shape = grad_output.shape
        go = grad_output.reshape(-1, go_shape[-1])
        go_fp8, go_scale = _quant(go, axis=-1)
        w_fp8_t, w_scale = _quant(weight_hp_t)
        grad_input = _scaled_mm(go_fp8, go_scale, w_fp8_t.t(), w_scale, go.dtype, False)
        grad_input = grad_input.reshape(*go_shape[:-1], grad_input.shape[-1])
        inp = input_hp.reshape(-1, input_hp.shape[-1])
        grad_weight = torch.mm(go.t(), inp)
        return grad_input, grad_weight.t()


class GwHpLinear(nn.Linear):
    def forward(self, input):
        output = _Matmul.apply(input, self.weight.t())
        if self.bias is not None:
            output = output + self.bias.to(output.dtype)
        return output

    @classmethod
    def from_float(cls, mod):
        with torch.device("meta"):
            new_mod = cls(mod.in_features, mod.out_features, bias=False)
        new_mod.weight = mod.weight
        new_mod.bias = mod.bias
        return new_mod
