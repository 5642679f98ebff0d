"""[planted bug: The grad_weight GEMM is given grad_output's global scale for the input operand, which was quantized with its own.]
(twin: s17_c02; recipe nvfp4)"""
import torch
import torch.nn as nn
import torch.nn.functional as F

NV_BLOCK = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0
# midpoints between neighbouring E2M1 magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6; a tie goes to the even code
_TIE_DOWN = (0.25, 1.25, 2.5, 5.0)  # ties resolve to the lower (even) code
_TIE_UP = (0.75, 1.75, 3.5)  # ties resolve to the upper (even) code
GRAD_ROUNDING = "rn"  # the nvfp4 recipe here: round to nearest even for gradients too


def e2m1_encode(v):
    mag = v.abs()
    code = torch.zeros_like(mag, dtype=torch.int32)
    for t in _TIE_DOWN:
        code += (mag > t).to(torch.int32)
    for t in _TIE_UP:
        code += (mag >= t).to(torch.int32)
    return (code + torch.signbit(v).to(torch.int32) * 8).to(torch.uint8)


def per_tensor_scale(x):
    """Decode scale amax / (448 * 6) in float32; 1.0 for an all-zero tensor."""
    amax = x.detach().abs().max().float()
    if amax.item() == 0:
        return torch.ones((), dtype=torch.float32, device=x.device)
    return amax / (E4M3_MAX * E2M1_MAX)


def nvfp4_quantize(x, rounding="rn"):
    """x [rows, k] -> (float4_e2m1fn_x2 [rows, k/2], e4m3 block scales [rows, k/16], fp32 global).
    Blocks of 16 consecutive elements along k; element 2j in the low nibble of byte j."""
    rows, k = x.shape
    g = per_tensor_scale(x)
    xb = x.float().view(rows, k // NV_BLOCK, NV_BLOCK) if x.is_contiguous() else x.float().reshape(rows, -1, NV_BLOCK)
    amax_b = xb.abs().amax(dim=-1)
    scale = torch.clamp(amax_b / E2M1_MAX / g, max=E4M3_MAX).to(torch.float8_e4m3fn)
    dec = scale.to(torch.float32) * g
    safe = torch.where(dec == 0, torch.ones_like(dec), dec)
    vals = xb / safe[..., None]
    vals = vals.masked_fill((dec == 0)[..., None], 0.0)
    if rounding == "rn":
        codes = e2m1_encode(vals).reshape(rows, k)
    else:
        raise NotImplementedError("stochastic rounding needs cvt.rs; not available here")
    lo, hi = codes[:, ::2], codes[:, 1::2]
    data = (lo | (hi << 4)).view(torch.float4_e2m1fn_x2)
    return data, scale, g


def to_blocked(block_scales):
    """[rows, cols] e4m3 -> flat e4m3 in the 128x4-tile layout (inside a tile: (r%32)*16 + (r//32)*4 + c)."""
    rows, cols = block_scales.shape
    rr, cc = (rows + 127) // 128 * 128, (cols + 3) // 4 * 4
    raw = F.pad(block_scales.view(torch.uint8), (0, cc - cols, 0, rr - rows))
    raw = raw.reshape(rr // 128, 4, 32, cc // 4, 4).transpose(1, 3)
    return raw.contiguous().flatten().view(torch.float8_e4m3fn)


def nvfp4_gemm(a, b_nk, out_dtype):
    """a = quantized A [m, k]; b_nk = quantized B^T [n, k]; B goes in as the column-major view."""
    qa, sa, ga = a
    qb, sb, gb = b_nk
    return F.scaled_mm(
        qa,
        qb.t(),
        [to_blocked(sa), ga],
        [F.ScalingType.BlockWise1x16, F.ScalingType.TensorWise],
        [to_blocked(sb), gb],
        [F.ScalingType.BlockWise1x16, F.ScalingType.TensorWise],
        swizzle_a=[F.SwizzleType.SWIZZLE_32_4_4, F.SwizzleType.NO_SWIZZLE],
        swizzle_b=[F.SwizzleType.SWIZZLE_32_4_4, F.SwizzleType.NO_SWIZZLE],
        output_dtype=out_dtype,
    )


class NVFP4MatMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2d, w):
        ctx.save_for_backward(x2d, w)
        return nvfp4_gemm(nvfp4_quantize(x2d), nvfp4_quantize(w), x2d.dtype)

    @staticmethod
    def backward(ctx, dy):
        x2d, w = ctx.saved_tensors
        dy = dy.contiguous()
        dx = nvfp4_gemm(nvfp4_quantize(dy, GRAD_ROUNDING), nvfp4_quantize(w.t().contiguous()), x2d.dtype)
        dy_t = nvfp4_quantize(dy.t().contiguous(), GRAD_ROUNDING)
        xq, xs, _ = nvfp4_quantize(x2d.t().contiguous())
        dw = nvfp4_gemm(dy_t, (xq, xs, dy_t[2]), w.dtype)  # one global for the wgrad GEMM
        return dx, dw


class NVFP4Linear(nn.Module):
    def __init__(self, linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias

    def forward(self, x):
        y = NVFP4MatMul.apply(x.reshape(-1, self.in_features), self.weight)
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


def convert_to_nvfp4_training(model):
    """Swap every nn.Linear in model (or model itself) for an NVFP4Linear sharing its parameters."""
    if isinstance(model, nn.Linear):
        return NVFP4Linear(model)
    for name, child in list(model.named_children()):
        if isinstance(child, nn.Linear):
            setattr(model, name, NVFP4Linear(child))
        else:
            convert_to_nvfp4_training(child)
    return model
