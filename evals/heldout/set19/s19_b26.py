"""s19_b26: NVFP4 linear layer as a function: nvfp4_linear(input, weight) (no bias).

Each GEMM re-quantizes both operands from the high-precision tensors in blocks of 16 along its
contraction dimension: a per-tensor fp32 decode scale amax / (448 * 6), per-block e4m3 scales
(round to nearest even), and E2M1 elements found by counting rounding boundaries (ties to the
even code), packed two per byte with the lower index in the low nibble. Block scales are
swizzled with explicit index arithmetic.
"""
import torch
import torch.nn.functional as F

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
FP4_MAX = 6.0
_SUPPORTED = (torch.bfloat16, torch.float16, torch.float32)


def _e2m1_codes(y):
    a = y.abs()
    code = ((a > 0.25).int() + (a >= 0.75).int() + (a > 1.25).int() + (a >= 1.75).int()
            + (a > 2.5).int() + (a >= 3.5).int() + (a > 5.0).int())
    return (code + 8 * (y < 0).int()).to(torch.uint8)


def _swizzle(sbytes):
    rows, cols = sbytes.shape
    prow, pcol = (rows + 127) // 128 * 128, (cols + 3) // 4 * 4
    r = torch.arange(rows, device=sbytes.device)[:, None]
    c = torch.arange(cols, device=sbytes.device)[None, :]
    rr, cc = r % 128, c % 4
    pos = ((r // 128) * (pcol // 4) + c // 4) * 512 + (rr % 32) * 16 + (rr // 32) * 4 + cc
    flat = torch.zeros(prow * pcol, dtype=torch.uint8, device=sbytes.device)
    flat[pos.flatten()] = sbytes.flatten()
    return flat.view(E4M3)


def _nv_cast(t):
    """Blocks of 16 along dim 1 of a 2-D tensor -> (packed fp4 [rows, n/2], swizzled e4m3 scales, fp32 global)."""
    x = t.contiguous().float()
    rows, n = x.shape
    amax_t = x.abs().amax()
    g = torch.where(amax_t == 0, torch.ones_like(amax_t), amax_t / E4M3_MAX)
    xb = x.view(rows, n // 16, 16)
    s = (xb.abs().amax(dim=-1) / FP4_MAX / g).clamp(max=E4M3_MAX).to(E4M3)
    dec = (s.float() * g).unsqueeze(-1)
    y = torch.where(dec == 0, torch.zeros_like(xb), xb / dec)
    codes = _e2m1_codes(y).view(rows, n)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed.contiguous().view(torch.float4_e2m1fn_x2), _swizzle(s.view(torch.uint8)), g


def _gemm(a, b, out_dtype):
    # a = cast of A [rows_a, K]; b = cast of B^T [cols_b, K] (handed over column-major)
    recipe = [F.ScalingType.BlockWise1x16, F.ScalingType.TensorWise]
    swz = [F.SwizzleType.SWIZZLE_32_4_4, F.SwizzleType.NO_SWIZZLE]
    return torch.nn.functional.scaled_mm(
        a[0], b[0].t(), [a[1], a[2]], recipe, [b[1], b[2]], recipe,
        swizzle_a=swz, swizzle_b=swz, output_dtype=out_dtype)


class _NVFP4Fn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        if x.dtype not in _SUPPORTED:
            raise TypeError(f"nvfp4_linear: unsupported input dtype {x.dtype}")
        ctx.save_for_backward(x, w)
        return _gemm(_nv_cast(x), _nv_cast(w), x.dtype)

    @staticmethod
    def backward(ctx, go):
        x, w = ctx.saved_tensors
        grad_input = _gemm(_nv_cast(go), _nv_cast(w.t()), x.dtype)
        grad_weight = _gemm(_nv_cast(go.t()), _nv_cast(x.t()), w.dtype)
        return grad_input, grad_weight


def nvfp4_linear(input, weight):
    return _NVFP4Fn.apply(input, weight)
