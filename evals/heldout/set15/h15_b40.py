"""[planted bug: fp8 weight cached on the parameter]

Held-out set 15, twin h15_c02.py; labels in manifest.json.
"""
import torch
from torch import nn

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
EPS = 1e-12


def _quantize(t, fp8_dtype):
    """t (already float32) -> (fp8 tensor, inverse scale)."""
    fmax = torch.finfo(fp8_dtype).max
    amax = t.abs().max().to(torch.float64).clamp(min=EPS)
    scale = (fmax / amax).to(torch.float32)
    t8 = (t * scale).clamp(-fmax, fmax).to(fp8_dtype)
    return t8, scale.reciprocal()


def _rowmajor(t):
    return t if (t.stride(-1) == 1 and t.stride(0) > 1) else t.contiguous()


def _colmajor(t):
    return t if (t.stride(0) == 1 and t.stride(-1) > 1) else t.t().contiguous().t()


class _TensorwiseMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        x2 = x.reshape(-1, x.shape[-1])
        x8, x_inv = _quantize(x2.float(), E4M3)
        w8, w_inv = w.__dict__.setdefault("_fp8_cache", _quantize(w.float(), E4M3))
        out = torch._scaled_mm(_rowmajor(x8), _colmajor(w8.t()), scale_a=x_inv, scale_b=w_inv,
                               out_dtype=x.dtype, use_fast_accum=True)
        return out.reshape(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx, grad_out):
        x, w = ctx.saved_tensors
        g2 = grad_out.reshape(-1, grad_out.shape[-1])
        g8, g_inv = _quantize(g2.float(), E5M2)
        w8, w_inv = _quantize(w.float(), E4M3)
        grad_x = torch._scaled_mm(_rowmajor(g8), _colmajor(w8), scale_a=g_inv, scale_b=w_inv,
                                  out_dtype=grad_out.dtype, use_fast_accum=False)
        x2 = x.reshape(-1, x.shape[-1])
        x8, x_inv = _quantize(x2.float(), E4M3)
        grad_w = torch._scaled_mm(_rowmajor(g8.t()), _colmajor(x8), scale_a=g_inv, scale_b=x_inv,
                                  out_dtype=grad_out.dtype, use_fast_accum=False)
        return grad_x.reshape(*grad_out.shape[:-1], x.shape[-1]), grad_w


class _TensorwiseFloat8Linear(nn.Linear):
    def forward(self, x):
        out = _TensorwiseMM.apply(x, self.weight)
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out

    @classmethod
    def from_float(cls, mod):
        new = cls(mod.in_features, mod.out_features, bias=False, device="meta")
        new.weight = mod.weight
        new.bias = mod.bias
        return new


def convert_to_float8_training(module: nn.Module, *, module_filter_fn=None, **kwargs) -> nn.Module:
    """Swap nn.Linear modules for tensorwise FP8 ones (in place for children)."""
    if type(module) is nn.Linear:
        if module_filter_fn is None or module_filter_fn(module, ""):
            return _TensorwiseFloat8Linear.from_float(module)
        return module
    for name, child in list(module.named_modules()):
        for cname, sub in list(child.named_children()):
            if type(sub) is nn.Linear:
                fqn = f"{name}.{cname}" if name else cname
                if module_filter_fn is None or module_filter_fn(sub, fqn):
                    setattr(child, cname, _TensorwiseFloat8Linear.from_float(sub))
    return module
