"""s18_c03: MXFP8 linear, RCEIL scales, converter form (swaps every nn.Linear of a model).

One quantizer for all six casts (blocks along the last dim, transposed views for the dim1 casts),
exponent from frexp of amax / 448, powers of two from a table.
"""
import torch
from torch import nn

_POW2 = torch.tensor([2.0 ** k for k in range(-127, 128)], dtype=torch.float32)


def _to_blocked(s):
    rows, cols = s.shape
    pr, pc = -(-rows // 128) * 128, -(-cols // 4) * 4
    s = nn.functional.pad(s, (0, pc - cols, 0, pr - rows))
    t = s.reshape(pr // 128, 128, pc // 4, 4).permute(0, 2, 1, 3)  # [tile row, tile col, 128, 4]
    t = t.reshape(-1, 4, 32, 4).transpose(1, 2)                     # row r = 32*a + b -> (b, a, c)
    return t.contiguous().flatten().view(torch.float8_e8m0fnu)


def _quant_mx(t):
    """(e4m3 data [R, C], swizzled e8m0 scales) for blocks of 32 along the last dim of t."""
    x = t.contiguous().float()
    R, C = x.shape
    x = x.reshape(R, C // 32, 32)
    amax = x.abs().amax(dim=2)
    nan_blk = amax.isnan() | amax.isinf()
    ratio = torch.where(nan_blk, 0.0, amax) / 448.0
    mant, ex = torch.frexp(ratio)
    e = torch.where(mant == 0.5, ex - 1, ex)
    e = torch.where(ratio == 0, -127, e).clamp(-127, 127)
    pow2 = _POW2.to(t.device)[(e + 127).long()]
    q = (x / pow2.unsqueeze(2)).clamp(-448.0, 448.0)
    q = q.masked_fill(nan_blk.unsqueeze(2), float("nan")).reshape(R, C).to(torch.float8_e4m3fn)
    scale_bytes = (e + 127).to(torch.uint8).masked_fill(nan_blk, 255)
    return q, _to_blocked(scale_bytes)


def _mm(a_hp, bt_hp, out_dtype):
    """high-precision A [m, k] times B = bt_hp.T [k, n], both cast along k."""
    F = torch.nn.functional
    a, sa = _quant_mx(a_hp)
    bt, sb = _quant_mx(bt_hp)
    return torch.nn.functional.scaled_mm(
        a, bt.t(), sa, F.ScalingType.BlockWise1x32, sb, F.ScalingType.BlockWise1x32,
        swizzle_a=F.SwizzleType.SWIZZLE_32_4_4, swizzle_b=F.SwizzleType.SWIZZLE_32_4_4,
        output_dtype=out_dtype)


class _MXMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2, w):
        ctx.save_for_backward(x2, w)
        return _mm(x2, w, x2.dtype)

    @staticmethod
    def backward(ctx, g2):
        x2, w = ctx.saved_tensors
        grad_in = _mm(g2, w.t(), x2.dtype)
        grad_w = _mm(g2.t(), x2.t(), w.dtype)
        return grad_in, grad_w


class _MXLinear(nn.Linear):
    def forward(self, x):
        y = _MXMatmul.apply(x.reshape(-1, x.shape[-1]), self.weight)
        y = y.view(*x.shape[:-1], y.shape[-1])
        return y if self.bias is None else y + self.bias.to(y.dtype)


def _swap(lin):
    m = _MXLinear.__new__(_MXLinear)
    nn.Module.__init__(m)
    m.in_features, m.out_features = lin.in_features, lin.out_features
    m.weight, m.bias = lin.weight, lin.bias
    return m


def convert_to_mxfp8(model):
    if isinstance(model, nn.Linear):
        return model if isinstance(model, _MXLinear) else _swap(model)
    for name, child in list(model.named_children()):
        if isinstance(child, nn.Linear) and not isinstance(child, _MXLinear):
            setattr(model, name, _swap(child))
        else:
            convert_to_mxfp8(child)
    return model
