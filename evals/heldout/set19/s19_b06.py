"""s19_b06: MXFP8 (RCEIL) linear layer as a function: mxfp8_linear(input, weight, bias=None).

Every GEMM re-quantizes both of its operands from the high-precision tensors, in blocks of 32
along that GEMM's contraction dimension, with one shared cast helper. Block exponents come from
torch.frexp (RCEIL: smallest e with 2^e >= amax / 448). The quantized A operand is row-major and
the B operand column-major; scales go to torch.nn.functional.scaled_mm in the SWIZZLE_32_4_4
layout. The bias is added here, after the output GEMM, in the output dtype.
"""
import torch
import torch.nn.functional as F

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
BLOCK = 32


def _exp_rceil(amax):
    # smallest integer e with 2^e >= amax / 448 (the quotient rounded in fp32)
    mant, ex = torch.frexp(amax / E4M3_MAX)
    return torch.where(mant == 0.5, ex - 1, ex)


def _exp_floor(amax):
    # OCP MX v1.0: floor(log2(amax)) - 8
    _, ex = torch.frexp(amax)
    return ex - 1 - 8


def _swizzle_32_4_4(sbytes):
    rows, cols = sbytes.shape
    prow, pcol = -(-rows // 128) * 128, -(-cols // 4) * 4
    padded = torch.zeros(prow, pcol, dtype=torch.uint8, device=sbytes.device)
    padded[:rows, :cols] = sbytes
    tiles = padded.view(prow // 128, 128, pcol // 4, 4).permute(0, 2, 1, 3)
    tiles = tiles.reshape(-1, 4, 32, 4).transpose(1, 2)
    return tiles.reshape(-1).view(torch.float8_e8m0fnu)


def _mx_cast(t, rule=_exp_rceil, fp8=E4M3):
    """Quantize a 2-D tensor in blocks of 32 along its last dim: (fp8 [rows, n] row-major, swizzled e8m0)."""
    xf = t.contiguous().float()
    rows, n = xf.shape
    xb = xf.view(rows, n // BLOCK, BLOCK)
    amax = xb.abs().amax(dim=-1)
    bad = ~torch.isfinite(amax)
    e = rule(amax)
    e = torch.where(amax == 0, torch.full_like(e, -127), e).clamp(-127, 127)
    e = torch.where(bad, torch.zeros_like(e), e)
    scaled = xb * torch.exp2(-e.to(torch.float32)).unsqueeze(-1)
    q = scaled.clamp(-E4M3_MAX, E4M3_MAX).to(fp8).view(rows, n)
    sbytes = torch.where(bad, torch.full_like(e, 255), e + 127).to(torch.uint8)
    return q, _swizzle_32_4_4(sbytes)


def _mm(a_q, a_s, b_q, b_s, out_dtype):
    # a_q [rows_a, K] row-major; b_q [cols_b, K] row-major, handed over as its column-major .t()
    return torch.nn.functional.scaled_mm(
        a_q, b_q.t(),
        a_s, F.ScalingType.BlockWise1x32,
        b_s, F.ScalingType.BlockWise1x32,
        swizzle_a=F.SwizzleType.SWIZZLE_32_4_4,
        swizzle_b=F.SwizzleType.SWIZZLE_32_4_4,
        output_dtype=out_dtype,
    )


class _MXFP8LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, b):
        ctx.save_for_backward(x, w)
        ctx.bias_dtype = None if b is None else b.dtype
        xq, xs = _mx_cast(x)                     # input along K
        wq, ws = _mx_cast(w)                     # weight along K
        out = _mm(xq, xs, wq, ws, torch.bfloat16).to(x.dtype)
        if b is not None:
            out = out + b.to(out.dtype)
        return out

    @staticmethod
    def backward(ctx, go):
        x, w = ctx.saved_tensors
        gq, gs = _mx_cast(go)                    # grad_output along N
        wtq, wts = _mx_cast(w.t())               # weight along N
        grad_input = _mm(gq, gs, wtq, wts, x.dtype)
        gtq, gts = _mx_cast(go.t())              # grad_output along M
        xtq, xts = _mx_cast(x.t())               # input along M
        grad_weight = _mm(gtq, gts, xtq, xts, w.dtype)
        grad_bias = None
        if ctx.bias_dtype is not None:
            grad_bias = go.sum(0).to(ctx.bias_dtype)
        return grad_input, grad_weight, grad_bias


def mxfp8_linear(input, weight, bias=None):
    return _MXFP8LinearFn.apply(input, weight, bias)
