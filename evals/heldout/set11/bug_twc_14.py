"""[planted bug: grad_weight is computed as input.T @ grad_output and reshaped, not transposed, to the weight's shape.] Tensorwise FP8 training, converter form: to_fp8_training(module) swaps nn.Linear children."""
import torch
import torch.nn as nn

FWD_DTYPE = torch.float8_e4m3fn
BWD_DTYPE = torch.float8_e5m2


class Fp8Tensor:
    """fp8 payload plus its (multiplicative) scale."""

    def __init__(self, hp, dtype):
        amax = torch.max(torch.abs(hp)).double()
        fmax = torch.finfo(dtype).max
        self.scale = (fmax / amax.clamp(min=1e-12)).float()
        self.data = torch.clamp(hp.float() * self.scale, min=-fmax, max=fmax).to(dtype)

    def t(self):
        out = Fp8Tensor.__new__(Fp8Tensor)
        out.data, out.scale = self.data.t(), self.scale
        return out


def fp8_mm(a, b, out_dtype, use_fast_accum):
    ad, bd = a.data, b.data
    if not (ad.stride(1) == 1 and ad.stride(0) > 1):
        ad = ad.contiguous()
    if bd.stride(1) == 1 and bd.stride(0) > 1:
        bd = bd.t().contiguous().t()
    return torch._scaled_mm(ad, bd, scale_a=a.scale.reciprocal(), scale_b=b.scale.reciprocal(),
                            out_dtype=out_dtype, use_fast_accum=use_fast_accum)


class _Fp8Matmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        xf = Fp8Tensor(x.reshape(-1, x.shape[-1]), FWD_DTYPE)
        wf = Fp8Tensor(w, FWD_DTYPE)
        y = fp8_mm(xf, wf.t(), x.dtype, True)
        return y.unflatten(0, x.shape[:-1])

    @staticmethod
    def backward(ctx, gy):
        x, w = ctx.saved_tensors
        g2 = gy.reshape(-1, gy.shape[-1])
        gf = Fp8Tensor(g2, BWD_DTYPE)
        wf = Fp8Tensor(w, FWD_DTYPE)
        gx = fp8_mm(gf, wf, gy.dtype, False).unflatten(0, gy.shape[:-1])
        xf = Fp8Tensor(x.reshape(-1, x.shape[-1]), FWD_DTYPE)
        gw = fp8_mm(xf.t(), gf, gy.dtype, False).reshape(w.shape)
        return gx, gw


class Fp8TrainingLinear(nn.Linear):
    def forward(self, x):
        y = _Fp8Matmul.apply(x, self.weight)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y


def _convert_one(lin):
    lin.__class__ = Fp8TrainingLinear
    return lin


def to_fp8_training(module: nn.Module, **kwargs) -> nn.Module:
    if isinstance(module, nn.Linear):
        return _convert_one(module)
    for name, child in module.named_children():
        if isinstance(child, nn.Linear):
            setattr(module, name, _convert_one(child))
        else:
            to_fp8_training(child, **kwargs)
    return module
