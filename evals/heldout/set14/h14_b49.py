"""[planted bug: The high-precision grad_weight GEMM is run in bf16, losing precision for fp32 (and fp16) activations.]

rowwise_with_gw_hp FP8 training, converter form: ``convert_rowwise_gw_hp(module)``.

torchao 0.18's ``rowwise_with_gw_hp`` recipe:

    output      = x8 (e4m3, scale per row along K) @ w8t (e4m3, scale per column along K)
                  -> rowwise _scaled_mm, fast accumulation
    grad_input  = g8 (e4m3, scale per row along N) @ w8 (e4m3, ONE tensorwise scale)
                  -> tensorwise kernel with unit scales, slow accumulation, then the result is
                     multiplied by (1/scale_g)[M,1] * (1/scale_w) broadcast to [1,K]
    grad_weight = grad_output.T @ input in high precision (torch.mm, no fp8)

All scales are ``fp8_max / max(amax, 1e-12)`` (float64 -> float32) rounded down to a power
of two, the weight's tensorwise scale included.  Rowwise ``_scaled_mm`` writes bf16, so for
fp16/fp32 activations the GEMM output is bf16 and cast back.

This converter swaps nn.Linear modules for ``_GwHpLinear``, whose autograd function also
takes the bias: it is added after the GEMM in the output dtype and its gradient is the
grad_output summed to the bias shape, exactly what autograd would do for ``out + bias``.
Operands are laid out at the call sites: ``_lhs`` row-major, ``_rhs`` column-major.
"""
import torch
from torch import nn

E4M3 = torch.float8_e4m3fn
FMAX = torch.finfo(E4M3).max
EPS = 1e-12


def _pow2_scale(amax):
    s = (FMAX / torch.clamp(amax.to(torch.float64), min=EPS)).to(torch.float32)
    return torch.exp2(torch.floor(torch.log2(s)))


@torch.no_grad()
def _q(t, scale):
    return (t.to(torch.float32) * scale).clamp(min=-FMAX, max=FMAX).to(E4M3)


@torch.no_grad()
def _q_axis(t, dim):
    s = _pow2_scale(torch.amax(torch.abs(t), dim=dim, keepdim=True))
    return _q(t, s), s


@torch.no_grad()
def _q_tensor(t):
    s = _pow2_scale(torch.max(torch.abs(t)))
    return _q(t, s), s


def _lhs(t):
    return t if (t.stride(0) > t.stride(1) and t.stride(1) == 1) else t.contiguous()


def _rhs(t):
    return t.t().contiguous().t()


def _gemm_dtype(dtype):
    return torch.bfloat16 if dtype in (torch.float16, torch.float32) else dtype


class _GwHpFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.bias_dtype = None if bias is None else bias.dtype
        x2 = x.reshape(-1, x.shape[-1])
        x8, sx = _q_axis(x2, -1)                  # [M,K], [M,1]
        w8t, sw = _q_axis(weight.t(), 0)          # [K,N], [1,N]
        out = torch._scaled_mm(_lhs(x8), _rhs(w8t), scale_a=sx.reciprocal(), scale_b=sw.reciprocal(),
                               out_dtype=_gemm_dtype(x.dtype), use_fast_accum=True)
        out = out.to(x.dtype).reshape(*x.shape[:-1], out.shape[-1])
        if bias is not None:
            out = out + bias.to(out.dtype)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        k, n = x.shape[-1], grad_out.shape[-1]
        g2 = grad_out.reshape(-1, n)
        # grad_input: rowwise grad_output x tensorwise weight, slow accumulation
        g8, sg = _q_axis(g2, -1)                  # [M,N], [M,1]
        w8t, sw = _q_tensor(weight.t())           # [K,N], scalar
        sw_cols = sw.repeat(k).reshape(1, -1)     # [1,K]
        inv_g = sg.reciprocal()
        post = inv_g * sw_cols.reciprocal()
        one = inv_g.new_ones(())
        gx = torch._scaled_mm(_lhs(g8), _rhs(w8t.t()), scale_a=one, scale_b=one,
                              out_dtype=_gemm_dtype(grad_out.dtype), use_fast_accum=False)
        gx *= post
        gx = gx.to(grad_out.dtype).reshape(*grad_out.shape[:-1], k)
        # grad_weight: high precision
        gw = torch.mm(g2.t().bfloat16(), x.reshape(-1, k).bfloat16())
        gb = None
        if ctx.bias_dtype is not None:
            gb = grad_out.sum_to_size(n).to(ctx.bias_dtype)
        return gx, gw, gb


class _GwHpLinear(nn.Linear):
    def forward(self, x):
        return _GwHpFn.apply(x, self.weight, self.bias)


def convert_rowwise_gw_hp(module: nn.Module, **kwargs) -> nn.Module:
    """Swap nn.Linear modules (or ``module`` itself) for rowwise_with_gw_hp FP8 linears."""
    if type(module) is nn.Linear:
        with torch.device("meta"):
            new = _GwHpLinear(module.in_features, module.out_features, bias=False)
        new.weight = module.weight
        new.bias = module.bias
        return new
    for name, child in list(module.named_children()):
        setattr(module, name, convert_rowwise_gw_hp(child, **kwargs))
    return module
