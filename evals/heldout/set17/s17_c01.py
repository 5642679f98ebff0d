"""[correct: NVFP4 linear (recipe nvfp4) as fp8_linear(input_2d, weight) on a torch.autograd.Function;
two-level scales (fp32 per-tensor decode scale amax/(448*6), e4m3 scale per 16 elements), E2M1
elements by arithmetic round-to-nearest-even; a row-wise cast and a column-wise cast that packs pairs
of rows directly (no high-precision transpose)]"""
import torch
import torch.nn.functional as F

BLOCK = 16
F4_MAX = 6.0
F8_MAX = 448.0


def _pow2(e):
    e = e.to(torch.int32)
    return ((e + 127) << 23).view(torch.float32)  # e stays within [-2, 2] here


def _e2m1_codes(y):
    """float32 -> E2M1 codes (uint8, one per element): sign bit 3, round to nearest even, saturating at 6."""
    a = y.abs().clamp(max=F4_MAX)
    _, ex = torch.frexp(a)
    e = (ex - 1).clamp(0, 2)  # exponent of the binade; below 1 the grid step is 0.5 like in [1, 2)
    n = torch.round(a / _pow2(e - 1)).to(torch.int32)  # half to even
    code = 2 * e + n
    code = torch.where(a < 1.0, n, code)
    return (code | (torch.signbit(y).to(torch.int32) << 3)).to(torch.uint8)


def _global_decode_scale(x):
    amax_t = x.float().abs().amax()
    return torch.where(amax_t > 0, amax_t / (F8_MAX * F4_MAX), torch.ones_like(amax_t))


def _block_quant(blocks, g):
    """blocks [..., 16] float32 -> (E2M1 codes [..., 16], e4m3 block scales [...])."""
    amax_b = blocks.abs().amax(-1)
    s = (amax_b / F4_MAX / g).clamp(max=F8_MAX).to(torch.float8_e4m3fn)
    d = (s.float() * g).unsqueeze(-1)
    y = torch.where(d > 0, blocks / torch.where(d > 0, d, torch.ones_like(d)), torch.zeros_like(blocks))
    return _e2m1_codes(y), s


def quant_rows(x):
    """Blocks of 16 along dim 1 of x [r, c]: packed [r, c/2] (element 2j in the low nibble), scales [r, c/16]."""
    r, c = x.shape
    g = _global_decode_scale(x)
    codes, s = _block_quant(x.float().reshape(r, c // BLOCK, BLOCK), g)
    codes = codes.reshape(r, c)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed.view(torch.float4_e2m1fn_x2), s, g


def quant_cols(x):
    """Blocks of 16 along dim 0 of x [r, c] (the transpose is quantized): packed [c, r/2], scales [c, r/16]."""
    r, c = x.shape
    g = _global_decode_scale(x)
    blocks = x.float().reshape(r // BLOCK, BLOCK, c).permute(2, 0, 1)  # [c, r/16, 16]
    codes, s = _block_quant(blocks, g)
    codes = codes.reshape(c, r)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed.contiguous().view(torch.float4_e2m1fn_x2), s.contiguous(), g


def _swizzle(s):
    rows, cols = s.shape
    R, C = -(-rows // 128) * 128, -(-cols // 4) * 4
    buf = torch.zeros(R, C, dtype=torch.uint8, device=s.device)
    buf[:rows, :cols] = s.view(torch.uint8)
    out = buf.view(R // 128, 4, 32, C // 4, 4).permute(0, 3, 2, 1, 4).reshape(-1)
    return out.view(torch.float8_e4m3fn)


def _nvfp4_mm(a, b_t, out_dtype):
    """a, b_t: (packed, block scales, global) with blocks along the contraction dim; b_t holds B transposed."""
    a_q, a_s, a_g = a
    b_q, b_s, b_g = b_t
    return F.scaled_mm(
        a_q,
        b_q.t(),
        [_swizzle(a_s), a_g.reshape(())],
        [F.ScalingType.BlockWise1x16, F.ScalingType.TensorWise],
        [_swizzle(b_s), b_g.reshape(())],
        [F.ScalingType.BlockWise1x16, F.ScalingType.TensorWise],
        swizzle_a=[F.SwizzleType.SWIZZLE_32_4_4, F.SwizzleType.NO_SWIZZLE],
        swizzle_b=[F.SwizzleType.SWIZZLE_32_4_4, F.SwizzleType.NO_SWIZZLE],
        output_dtype=out_dtype,
    )


class _NVFP4LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return _nvfp4_mm(quant_rows(x), quant_rows(w), x.dtype)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        g = g.contiguous()
        grad_x = _nvfp4_mm(quant_rows(g), quant_cols(w), x.dtype)  # contraction over N
        grad_w = _nvfp4_mm(quant_cols(g), quant_cols(x), w.dtype)  # contraction over M
        return grad_x, grad_w


def fp8_linear(input_2d, weight):
    """y = input_2d @ weight.T with NVFP4 GEMMs forward and backward."""
    return _NVFP4LinearFn.apply(input_2d, weight)
