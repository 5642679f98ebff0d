"""[planted bug: high-precision weight gradient computed as input.T @ grad_output and reshaped]

Held-out set 15, twin h15_c05.py; labels in manifest.json.
"""
import torch
from torch import nn

E4M3 = torch.float8_e4m3fn
FMAX = torch.finfo(E4M3).max
EPS = 1e-12


def _pow2(amax):
    s = (FMAX / amax.to(torch.float64).clamp(min=EPS)).to(torch.float32)
    return torch.exp2(torch.floor(torch.log2(s)))


def _to_e4m3(t, scale):
    return (t.to(torch.float32) * scale).clamp(-FMAX, FMAX).to(E4M3)


def _mm_dtype(dtype):
    return torch.bfloat16 if dtype in (torch.float16, torch.float32) else dtype


def _is_row_major(t):
    return t.stride(1) == 1 and t.stride(0) > 1


class _GwHpMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        x2 = x.reshape(-1, x.shape[-1])
        x_s = _pow2(x2.abs().amax(dim=-1, keepdim=True))             # [M, 1]
        x8 = _to_e4m3(x2, x_s)
        w_s = _pow2(w.abs().amax(dim=-1, keepdim=True))              # [N, 1]
        w8 = _to_e4m3(w, w_s)
        a = x8 if _is_row_major(x8) else x8.contiguous()
        b = w8.t() if _is_row_major(w8) else w8.contiguous().t()
        out = torch._scaled_mm(a, b, scale_a=x_s.reciprocal(), scale_b=w_s.reciprocal().view(1, -1),
                               out_dtype=_mm_dtype(x.dtype), use_fast_accum=True)
        return out.to(x.dtype).reshape(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx, grad_out):
        x, w = ctx.saved_tensors
        g2 = grad_out.reshape(-1, grad_out.shape[-1])
        x2 = x.reshape(-1, x.shape[-1])

        # grad_input: grad_output rowwise (e4m3) x weight tensorwise (e4m3)
        g_s = _pow2(g2.abs().amax(dim=-1, keepdim=True))             # [M, 1]
        g8 = _to_e4m3(g2, g_s)
        w_s = _pow2(w.abs().max())                                   # one scale
        w8 = _to_e4m3(w, w_s)                                        # [N, K]
        a = g8 if _is_row_major(g8) else g8.contiguous()
        b = w8.t().contiguous().t() if _is_row_major(w8) else w8
        one = g_s.new_ones(())
        grad_x = torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=_mm_dtype(grad_out.dtype),
                                  use_fast_accum=False)
        grad_x *= g_s.reciprocal() * w_s.reciprocal()
        grad_x = grad_x.to(grad_out.dtype).reshape(*grad_out.shape[:-1], x.shape[-1])

        # grad_weight: high precision
        grad_w = torch.mm(x2.t(), g2).reshape(w.shape)
        return grad_x, grad_w


class _GwHpFloat8Linear(nn.Linear):
    def forward(self, x):
        y = _GwHpMM.apply(x, self.weight)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    @classmethod
    def from_float(cls, mod):
        with torch.device("meta"):
            new = cls(mod.in_features, mod.out_features, bias=False)
        new.weight, new.bias = mod.weight, mod.bias
        return new


def _swap(parent: nn.Module, filter_fn, prefix=""):
    for name, child in parent.named_children():
        fqn = f"{prefix}.{name}" if prefix else name
        if type(child) is nn.Linear and (filter_fn is None or filter_fn(child, fqn)):
            setattr(parent, name, _GwHpFloat8Linear.from_float(child))
        else:
            _swap(child, filter_fn, fqn)


def convert_to_float8_training(module: nn.Module, *, module_filter_fn=None, **kwargs) -> nn.Module:
    """Return `module` with its nn.Linear layers running rowwise_with_gw_hp FP8."""
    if type(module) is nn.Linear:
        return _GwHpFloat8Linear.from_float(module) if module_filter_fn is None or module_filter_fn(module, "") else module
    _swap(module, module_filter_fn)
    return module
