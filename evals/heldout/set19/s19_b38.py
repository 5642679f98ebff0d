"""s19_b38: NVFP4 linear layer as a module: NVFP4Linear.from_float(linear).

Shares the Linear's parameters and accepts N-D inputs. Per-tensor fp32 decode scale
amax / (448 * 6) (the weight's amax is taken once per forward by the module), per-block e4m3
scales, E2M1 elements by rounding on the three E2M1 grids (steps 0.5, 1, 2) with torch.round
(half to even), packed two per byte, low nibble first. Block scales are swizzled with
view/permute.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
FP4_MAX = 6.0
_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _e2m1(y):
    a = y.abs()
    v = torch.where(a < 2.0, torch.round(a * 2.0) / 2.0,
                    torch.where(a < 4.0, torch.round(a), torch.round(a / 2.0) * 2.0))
    v = v.clamp(max=FP4_MAX)
    code = torch.bucketize(v, _GRID.to(v.device)).to(torch.uint8)
    return code | ((y < 0).to(torch.uint8) << 3)


def _swizzle(sbytes):
    rows, cols = sbytes.shape
    prow, pcol = -(-rows // 128) * 128, -(-cols // 4) * 4
    p = F.pad(sbytes, (0, pcol - cols, 0, prow - rows))
    t = p.view(prow // 128, 128, pcol // 4, 4).permute(0, 2, 1, 3)
    t = t.reshape(-1, 4, 32, 4).permute(0, 2, 1, 3)
    return t.contiguous().view(-1).view(E4M3)


def _quant(t, amax_t=None):
    xf = t.float().contiguous()
    if amax_t is None:
        amax_t = xf.abs().amax()
    g = torch.where(amax_t == 0, torch.ones_like(amax_t), amax_t / (E4M3_MAX * FP4_MAX)).float()
    rows, n = xf.shape
    xb = xf.view(rows, n // 16, 16)
    s = (xb.abs().amax(dim=-1) / FP4_MAX / g).clamp(max=E4M3_MAX).to(E4M3)
    dec = (s.float() * g).unsqueeze(-1)
    y = torch.where(dec == 0, torch.zeros_like(xb), xb / dec)
    codes = _e2m1(y).view(rows, n // 2, 2)
    packed = (codes[..., 0] | (codes[..., 1] << 4)).contiguous()
    return packed.view(torch.float4_e2m1fn_x2), _swizzle(s.view(torch.uint8)), g


def _gemm(a, sa, ga, b, sb, gb, out_dtype):
    recipe = [F.ScalingType.BlockWise1x16, F.ScalingType.TensorWise]
    swz = [F.SwizzleType.SWIZZLE_32_4_4, F.SwizzleType.NO_SWIZZLE]
    return torch.nn.functional.scaled_mm(
        a, b.t(), [sa, ga], recipe, [sb, gb], recipe,
        swizzle_a=swz, swizzle_b=swz, output_dtype=out_dtype)


class _Fn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, w_amax):
        ctx.save_for_backward(x, w, w_amax)
        a, sa, ga = _quant(x)
        b, sb, gb = _quant(w, w_amax)
        return _gemm(a, sa, ga, b, sb, gb, x.dtype)

    @staticmethod
    def backward(ctx, go):
        x, w, w_amax = ctx.saved_tensors
        a, sa, ga = _quant(go)
        b, sb, gb = _quant(w.t(), w_amax)
        grad_input = _gemm(a, sa, ga, b, sb, gb, x.dtype)
        a, sa, ga = _quant(go.t())
        b, sb, gb = _quant(x.t())
        grad_weight = _gemm(a, sa, ga, b, sb, gb, w.dtype)
        return grad_input, grad_weight, None


class NVFP4Linear(nn.Linear):
    @classmethod
    def from_float(cls, linear):
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight, new.bias = linear.weight, linear.bias
        new._w_amax = None
        return new

    def forward(self, x):
        if self._w_amax is None:
            self._w_amax = self.weight.detach().abs().amax().float()
        lead = x.shape[:-1]
        y = _Fn.apply(x.reshape(-1, self.in_features), self.weight, self._w_amax)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*lead, self.out_features)
