"""[correct: MXFP8 with FLOOR scales (recipe mxfp8_floor) as fp8_linear(input_2d, weight); elements are
encoded to e4m3fn bytes by a software cast (round to nearest even, saturating at 448) the way a cast
kernel would do it; separate row-wise (dim0) and column-wise (dim1) cast entry points]"""
import torch
import torch.nn.functional as F

MX_BLOCK = 32
E4M3_MAX = 448.0
E4M3_MIN_NORMAL_EXP = -6
E4M3_MANT_BITS = 3


def _two_to(e):
    e = e.to(torch.int32)
    return torch.where(e >= -126, (e + 127) << 23, torch.full_like(e, 1 << 22)).view(torch.float32)


def _floor_exp(amax):
    # amax = m * 2**ex with m in [0.5, 1): floor(log2(amax)) = ex - 1; minus 8, the top exponent of e4m3
    _, ex = torch.frexp(amax)
    e = ex - 1 - 8
    e = torch.where(amax > 0, e, torch.full_like(e, -127))
    return e.clamp(-127, 127)


def _encode_e4m3(y):
    """float32 -> float8_e4m3fn bytes, round to nearest even, saturating; NaN -> 0x7F (sign kept)."""
    neg = torch.signbit(y)
    a = y.abs()
    a = torch.clamp(a, max=E4M3_MAX)
    _, ex = torch.frexp(a)
    eb = torch.where(a < 2.0**E4M3_MIN_NORMAL_EXP, torch.full_like(ex, E4M3_MIN_NORMAL_EXP), ex - 1)
    steps = torch.round(a / _two_to(eb - E4M3_MANT_BITS))  # half to even
    code = (eb - E4M3_MIN_NORMAL_EXP) * 8 + steps.to(torch.int32)
    code = torch.where(torch.isnan(a), torch.full_like(code, 0x7F), code)
    code = code | (neg.to(torch.int32) << 7)
    return code.to(torch.uint8).view(torch.float8_e4m3fn)


def _blocks_along_last(t):
    """t [r, c]: blocks of 32 along c -> (e4m3 data [r, c], int32 exponents [r, c/32], special mask)."""
    r, c = t.shape
    blocks = t.to(torch.float32).reshape(r, c // MX_BLOCK, MX_BLOCK)
    amax = blocks.abs().amax(dim=2)
    special = ~torch.isfinite(amax)
    e = _floor_exp(torch.where(special, torch.zeros_like(amax), amax))
    y = blocks / _two_to(e)[:, :, None]
    y = torch.where(special[:, :, None], torch.full_like(y, float("nan")), y)
    return _encode_e4m3(y).reshape(r, c), e, special


def cast_rowwise(t):
    """dim0 cast: blocks of 32 consecutive elements of a row. Scales [r, c/32] as e8m0 bytes."""
    data, e, special = _blocks_along_last(t)
    scale = torch.where(special, torch.full_like(e, 0xFF), e + 127).to(torch.uint8)
    return data, scale


def cast_colwise(t):
    """dim1 cast: blocks of 32 consecutive rows of a column. Returns the transposed data [c, r]
    (row-major, blocks along its rows) and scales [c, r/32]."""
    data_t, e, special = _blocks_along_last(t.t().contiguous())
    scale = torch.where(special, torch.full_like(e, 0xFF), e + 127).to(torch.uint8)
    return data_t, scale


def _swizzled(scale):
    rows, cols = scale.shape
    R = (rows + 127) // 128 * 128
    C = (cols + 3) // 4 * 4
    full = torch.nn.functional.pad(scale, (0, C - cols, 0, R - rows))
    t = full.reshape(R // 128, 4, 32, C // 4, 4).permute(0, 3, 2, 1, 4)
    return t.contiguous().view(-1).view(torch.float8_e8m0fnu)


def _mm(a_data, a_scale, bt_data, bt_scale, out_dtype):
    return F.scaled_mm(
        a_data,
        bt_data.t(),
        _swizzled(a_scale),
        F.ScalingType.BlockWise1x32,
        _swizzled(bt_scale),
        F.ScalingType.BlockWise1x32,
        swizzle_a=F.SwizzleType.SWIZZLE_32_4_4,
        swizzle_b=F.SwizzleType.SWIZZLE_32_4_4,
        output_dtype=out_dtype,
    )


class _FloorMXLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        xq, xs = cast_rowwise(x)
        wq, ws = cast_rowwise(w)
        return _mm(xq, xs, wq, ws, x.dtype)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        g = g.contiguous()
        gq, gs = cast_rowwise(g)  # [M, N] along N
        wtq, wts = cast_colwise(w)  # weight [N, K] along N -> [K, N]
        grad_x = _mm(gq, gs, wtq, wts, x.dtype)
        gtq, gts = cast_colwise(g)  # [N, M] along M
        xtq, xts = cast_colwise(x)  # [K, M] along M
        grad_w = _mm(gtq, gts, xtq, xts, w.dtype)
        return grad_x, grad_w


def fp8_linear(input_2d, weight):
    return _FloorMXLinear.apply(input_2d, weight)
