"""s18_b08: MXFP8 linear, RCEIL scales, function form with an optional bias.

Separate casts for the two block axes (dim0: along the last dim; dim1: along dim 0), RCEIL exponent
taken from the fp32 bit pattern of amax / 448.
"""
import torch

_E4M3 = torch.float8_e4m3fn
_MAX = 448.0


def _swizzle(s):
    """uint8 scale matrix [rows, cols] -> flat SWIZZLE_32_4_4 bytes as e8m0."""
    rows, cols = s.shape
    rp, cp = -(-rows // 128) * 128, -(-cols // 4) * 4
    p = torch.zeros(rp, cp, dtype=torch.uint8, device=s.device)
    p[:rows, :cols] = s
    t = p.view(rp // 128, 4, 32, cp // 4, 4).permute(0, 3, 2, 1, 4)
    return t.contiguous().view(-1).view(torch.float8_e8m0fnu)


def _rceil_exp(amax):
    """smallest e with 2**e >= amax / 448 (quotient in fp32), clamped to [-127, 127]."""
    r = amax / _MAX
    bits = r.view(torch.int32)
    field = (bits >> 23) & 0xFF
    e = field - 127 + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    sub = torch.where(r > 2.0 ** -127, -126, -127).to(torch.int32)
    e = torch.where(field == 0, sub, e)
    return e.clamp(-127, 127)


def _cast_dim0(t):
    """blocks of 32 along the last dim of t [R, C] -> (e4m3 [R, C], swizzled scales of [R, C/32])."""
    R, C = t.shape
    b = t.float().reshape(R, C // 32, 32)
    amax = b.abs().amax(dim=-1)
    bad = ~torch.isfinite(amax)
    e = _rceil_exp(torch.where(bad, torch.zeros_like(amax), amax))
    q = b * torch.exp2(-e.float()).unsqueeze(-1)
    q = q.clamp(-_MAX, _MAX)
    q = torch.where(bad.unsqueeze(-1), torch.full_like(q, float("nan")), q)
    byte = torch.where(bad, 255, e + 127).to(torch.uint8)
    return q.reshape(R, C).to(_E4M3), _swizzle(byte)


def _cast_dim1(t):
    """blocks of 32 along dim 0 of t [R, C] -> (e4m3 of t.T [C, R] row-major, scales of [C, R/32])."""
    R, C = t.shape
    b = t.float().nan_to_num(nan=0.0).reshape(R // 32, 32, C)
    amax = b.abs().amax(dim=1)
    bad = ~torch.isfinite(amax)
    e = _rceil_exp(torch.where(bad, torch.zeros_like(amax), amax))
    q = b * torch.exp2(-e.float()).unsqueeze(1)
    q = q.clamp(-_MAX, _MAX)
    q = torch.where(bad.unsqueeze(1), torch.full_like(q, float("nan")), q)
    byte = torch.where(bad, 255, e + 127).to(torch.uint8)
    return q.reshape(R, C).t().contiguous().to(_E4M3), _swizzle(byte.t().contiguous())


def _gemm(a, sa, bt, sb, dtype):
    """a [m, k] row-major; bt [n, k] row-major, handed over as the column-major B = bt.T."""
    F = torch.nn.functional
    return torch.nn.functional.scaled_mm(
        a, bt.t(), sa, F.ScalingType.BlockWise1x32, sb, F.ScalingType.BlockWise1x32,
        swizzle_a=F.SwizzleType.SWIZZLE_32_4_4, swizzle_b=F.SwizzleType.SWIZZLE_32_4_4,
        output_dtype=dtype)


class _MXLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, bias):
        ctx.save_for_backward(x, w)
        ctx.bias_dtype = None if bias is None else bias.dtype
        xq, xs = _cast_dim0(x)
        wq, ws = _cast_dim0(w)
        out = _gemm(xq, xs, wq, ws, x.dtype)
        if bias is not None:
            out = out + bias.to(out.dtype)
        return out

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        gq, gs = _cast_dim0(g)
        wq, ws = _cast_dim1(w)
        grad_x = _gemm(gq, gs, wq, ws, x.dtype)
        gtq, gts = _cast_dim1(g)
        xtq, xts = _cast_dim1(x)
        grad_w = _gemm(gtq, gts, xtq, xts, w.dtype)
        grad_b = None if ctx.bias_dtype is None else g.sum(0).to(ctx.bias_dtype)
        return grad_x, grad_w, grad_b


def mx_linear(input, weight, bias=None):
    return _MXLinearFn.apply(input, weight, bias)
