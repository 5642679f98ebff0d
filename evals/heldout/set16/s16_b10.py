"""[planted bug: NaN handling differs between the casts: the dim1 (transposing) casts map NaN to 0 while the dim0 casts give the block the NaN scale, so grad_weight stays finite where it must be NaN.]
(twin: s16_c01; recipe mxfp8)"""
import torch
import torch.nn.functional as F

_BLOCK = 32
_FP8_MAX = 448.0


def _ceil_to(n, m):
    return -(-n // m) * m


def _pow2(e):
    """Exact 2**e as float32 for an int32 tensor e in [-127, 127] (bits built by hand)."""
    e = e.to(torch.int32)
    normal = ((e + 127) << 23).view(torch.float32)
    sub = torch.full_like(e, 1 << 22).view(torch.float32)  # 2**-127, a subnormal
    return torch.where(e >= -126, normal, sub)


def _swizzle(scale_bytes):
    """[rows, cols] uint8 -> flat float8_e8m0fnu in cuBLAS's 128x4 blocked layout."""
    rows, cols = scale_bytes.shape
    rp, cp = _ceil_to(rows, 128), _ceil_to(cols, 4)
    padded = scale_bytes.new_zeros(rp, cp)
    padded[:rows, :cols] = scale_bytes
    tiles = padded.view(rp // 128, 4, 32, cp // 4, 4).permute(0, 3, 2, 1, 4)
    return tiles.reshape(-1).view(torch.float8_e8m0fnu)


def _mx_cast(t, elem_dtype=torch.float8_e4m3fn):
    """Blocks of 32 along the last dim of t [rows, cols]. Returns (fp8 [rows, cols], uint8 [rows, cols/32])."""
    rows, cols = t.shape
    blocks = t.float().reshape(rows, cols // _BLOCK, _BLOCK)
    amax = blocks.abs().amax(dim=-1)
    special = ~torch.isfinite(amax)  # a NaN or an Inf in the block
    mant, expo = torch.frexp(amax / _FP8_MAX)
    # smallest e with 2**e >= amax / 448 (RCEIL)
    e = torch.where(mant == 0.5, expo - 1, expo)
    e = torch.where(amax == 0, torch.full_like(e, -127), e).clamp(-127, 127)
    scaled = blocks * _pow2(-e).unsqueeze(-1)
    scaled = scaled.clamp(-_FP8_MAX, _FP8_MAX)
    scaled = torch.where(special.unsqueeze(-1), torch.full_like(scaled, float("nan")), scaled)
    q = scaled.to(elem_dtype).reshape(rows, cols)
    sbytes = torch.where(special, torch.full_like(e, 255), e + 127).to(torch.uint8)
    return q, sbytes


def _gemm(a_q, a_s, b_q_t, b_s, out_dtype):
    """a_q [m, k] row-major; b_q_t [n, k] row-major (so b_q_t.t() is the column-major B)."""
    return F.scaled_mm(
        a_q,
        b_q_t.t(),
        _swizzle(a_s),
        F.ScalingType.BlockWise1x32,
        _swizzle(b_s),
        F.ScalingType.BlockWise1x32,
        swizzle_a=F.SwizzleType.SWIZZLE_32_4_4,
        swizzle_b=F.SwizzleType.SWIZZLE_32_4_4,
        output_dtype=out_dtype,
    )


class _MXFP8LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        x_q, x_s = _mx_cast(x)  # input along K
        w_q, w_s = _mx_cast(w)  # weight along K
        return _gemm(x_q, x_s, w_q, w_s, x.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        x, w = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        # grad_input = grad_out [M,N] @ w [N,K]: both quantized along N
        g_q, g_s = _mx_cast(grad_out)
        wt_q, wt_s = _mx_cast(w.t().contiguous())
        grad_in = _gemm(g_q, g_s, wt_q, wt_s, x.dtype)
        # grad_weight = grad_out.T [N,M] @ x [M,K]: both quantized along M
        gt_q, gt_s = _mx_cast(torch.nan_to_num(grad_out.t(), nan=0.0).contiguous())
        xt_q, xt_s = _mx_cast(torch.nan_to_num(x.t(), nan=0.0).contiguous())
        grad_w = _gemm(gt_q, gt_s, xt_q, xt_s, w.dtype)
        return grad_in, grad_w


def fp8_linear(input_2d, weight):
    """y = input_2d @ weight.T with MXFP8 (RCEIL) GEMMs forward and backward."""
    return _MXFP8LinearFn.apply(input_2d, weight)
