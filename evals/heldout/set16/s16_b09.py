"""[planted bug: The scale 2**-127 (e = -127, what amax == 0 gives) is built as 0.0, so an all-zero block is divided by a zero scale and becomes NaN.]
(twin: s16_c02; recipe mxfp8)"""
import torch
import torch.nn as nn
import torch.nn.functional as F

BLOCK_SIZE = 32
E4M3_MAX = 448.0
SCALE_NAN = 0xFF
RECIPE = "rceil"  # the mxfp8 recipe: RCEIL scales for every cast


def round_up(n, multiple):
    return (n + multiple - 1) // multiple * multiple


def exp2_exact(e):
    """2**e (float32) for integer e in [-127, 127], built from the bit pattern."""
    e = e.to(torch.int32)
    bits = torch.where(e >= -126, (e + 127) << 23, torch.zeros_like(e))  # 2**-127 flushed to zero
    return bits.view(torch.float32)


def rceil_exponent(amax):
    """Smallest integer e with 2**e >= amax / 448 (the division in float32), clamped to [-127, 127]."""
    ratio = (amax / E4M3_MAX).contiguous()
    bits = ratio.view(torch.int32)
    biased = (bits >> 23) & 0xFF
    frac = bits & 0x7FFFFF
    e_normal = biased - 127 + (frac != 0).to(torch.int32)
    # subnormal ratio: 2**-126 covers it when ratio > 2**-127, else 2**-127
    e_sub = torch.where(frac > (1 << 22), torch.full_like(biased, -126), torch.full_like(biased, -127))
    e = torch.where(biased == 0, e_sub, e_normal)
    return e.clamp(-127, 127)


def floor_exponent(amax):
    """OCP MX v1.0: floor(log2(amax)) - 8, clamped to [-127, 127] (zero or subnormal amax -> -127)."""
    biased = (amax.contiguous().view(torch.int32) >> 23) & 0xFF
    e = torch.where(biased == 0, torch.full_like(biased, -127), biased - 127 - 8)
    return e.clamp(-127, 127)


def to_mx_rows(x2d, scaling_mode="floor"):
    """Quantize [rows, k] with blocks of 32 consecutive elements of a row (dim0 cast).
    Returns data (float8_e4m3fn [rows, k]) and scales (uint8 biased exponents [rows, k // 32])."""
    rows, k = x2d.shape
    xb = x2d.to(torch.float32).reshape(rows, k // BLOCK_SIZE, BLOCK_SIZE)
    amax = torch.amax(torch.abs(xb), dim=2)
    is_special = torch.isnan(amax) | torch.isinf(amax)
    e = rceil_exponent(amax) if scaling_mode == "rceil" else floor_exponent(amax)
    data = xb / exp2_exact(e)[:, :, None]
    data = torch.clamp(data, min=-E4M3_MAX, max=E4M3_MAX)
    data = data.masked_fill(is_special[:, :, None], float("nan"))
    data = data.to(torch.float8_e4m3fn).reshape(rows, k)
    scales = (e + 127).masked_fill(is_special, SCALE_NAN).to(torch.uint8)
    return data, scales


def to_mx_dim1(x2d, scaling_mode="floor"):
    """dim1 cast: blocks of 32 consecutive rows of a column. Returns the transposed data
    [cols, rows] (row-major) and its scales [cols, rows // 32]."""
    return to_mx_rows(x2d.t().contiguous(), scaling_mode=scaling_mode)


def blocked_scales(scales):
    """S [rows, cols] -> cuBLAS 1-D block scaling factor layout (128x4 tiles, 32x16 inside)."""
    rows, cols = scales.shape
    R, C = round_up(rows, 128), round_up(cols, 4)
    buf = torch.zeros((R, C), dtype=torch.uint8, device=scales.device)
    buf[:rows, :cols] = scales
    out = buf.reshape(R // 128, 4, 32, C // 4, 4).transpose(1, 3).contiguous()  # (i, j, r%32, r//32, c)
    return out.flatten().view(torch.float8_e8m0fnu)


def mx_mm(a_data, sa, bt_data, sb, out_dtype):
    """A [m, k] row-major; B given as bt [n, k] row-major, handed over as the column-major view bt.t();
    sa and sb are already in the blocked layout."""
    return F.scaled_mm(
        a_data,
        bt_data.t(),
        sa,
        F.ScalingType.BlockWise1x32,
        sb,
        F.ScalingType.BlockWise1x32,
        swizzle_a=F.SwizzleType.SWIZZLE_32_4_4,
        swizzle_b=F.SwizzleType.SWIZZLE_32_4_4,
        output_dtype=out_dtype,
    )


class MXMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight):
        ctx.x_shape = x.shape
        x2d = x.reshape(-1, x.shape[-1])
        ctx.save_for_backward(x2d)
        xa, xs = to_mx_rows(x2d, RECIPE)
        wb, ws = to_mx_rows(weight, RECIPE)
        # dim1 cast of the weight for dgrad, taken now from the high-precision weight
        ctx.w_dim1 = to_mx_dim1(weight, RECIPE)
        ctx.w_dtype = weight.dtype
        y = mx_mm(xa, blocked_scales(xs), wb, blocked_scales(ws), x.dtype)
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_y):
        (x2d,) = ctx.saved_tensors
        g2d = grad_y.reshape(-1, grad_y.shape[-1]).contiguous()
        # dgrad: g [M, N] x weight [N, K], contraction over N
        ga, gs = to_mx_rows(g2d, RECIPE)
        wtb, wts = ctx.w_dim1
        grad_x = mx_mm(ga, blocked_scales(gs), wtb, blocked_scales(wts), x2d.dtype)
        # wgrad: g.T [N, M] x x [M, K], contraction over M
        gta, gts = to_mx_dim1(g2d, RECIPE)
        xtb, xts = to_mx_dim1(x2d, RECIPE)
        grad_w = mx_mm(gta, blocked_scales(gts), xtb, blocked_scales(xts), ctx.w_dtype)
        return grad_x.reshape(ctx.x_shape), grad_w


class MXLinear(nn.Module):
    def __init__(self, weight, bias=None):
        super().__init__()
        self.in_features = weight.shape[1]
        self.out_features = weight.shape[0]
        self.weight = weight
        self.bias = bias

    @classmethod
    def from_linear(cls, linear):
        return cls(linear.weight, linear.bias)

    def forward(self, x):
        y = MXMatmul.apply(x, self.weight)
        if self.bias is not None:
            y = y + self.bias
        return y


def convert_to_mx_training(model):
    """Swap every nn.Linear inside model (or model itself) for an MXLinear sharing its parameters."""
    if isinstance(model, nn.Linear):
        return MXLinear.from_linear(model)
    for name, child in list(model.named_children()):
        if isinstance(child, nn.Linear):
            setattr(model, name, MXLinear.from_linear(child))
        else:
            convert_to_mx_training(child)
    return model
