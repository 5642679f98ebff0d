"""Blockwise FP8 linear (DeepSeek-V3 style), function form: ``block_fp8_linear(input, weight, bias=None)``.

Follows torchao 0.18 prototype.blockwise_fp8_training (fp8_blockwise_mm), block 128:
  output      = x  [M,K] 1x128 tiles along K   @ W.T [K,N] 128x128 blocks
  grad_input  = g  [M,N] 1x128 tiles along N   @ W   [N,K] 128x128 blocks
  grad_weight = g.T[N,M] 1x128 tiles along M   @ x   [M,K] 128x1 tiles along M
Every group: amax = max|v| clamped at 1e-12, scale = fp32(448 / amax) computed in
float64 (NOT rounded to a power of two), q = e4m3(clamp(v_fp32 * scale, +-448)), and
the GEMM gets 1/scale (fp32).  The GEMMs write the input's dtype (bf16 in torchao).
On CUDA the GEMMs go through torch.nn.functional.scaled_mm with BlockWise1x128 /
BlockWise128x128 recipes and torchao's scale layouts (1x128 scales column-major,
128x128 scales K-major padded to a multiple of 4 K-blocks).  Elsewhere the same
block GEMM is emulated: per 128-wide K block, an fp32 product of the fp8 values,
times both block scales, accumulated in fp32.
"""
import torch
import torch.nn.functional as F

E4M3 = torch.float8_e4m3fn
B = 128
EPS = 1e-12
_ST = getattr(F, "ScalingType", getattr(torch._C, "_ScalingType", None))


def _use_cublas(t):
    return t.is_cuda


def _quant_groups(v, rows, cols):
    """Quantise a 2-D tensor in (rows x cols) groups; returns fp8 and the [R, C] grid of 1/scale."""
    m, n = v.shape
    g = v.to(torch.float32).reshape(m // rows, rows, n // cols, cols)
    amax = g.abs().amax(dim=(1, 3), keepdim=True).to(torch.float64)
    scale = (448.0 / torch.clamp(amax, min=EPS)).to(torch.float32)
    q = torch.clamp(g * scale, min=-448.0, max=448.0).to(E4M3).reshape(m, n)
    return q, (1.0 / scale).reshape(m // rows, n // cols)


def _col_major_scale(s):
    return s.t().contiguous().t()


def _pad_k_major(s):
    # [Kb, Nb] 128x128 scale grid -> stride (1, L4) with L4 = Kb rounded up to 4
    kb, nb = s.shape
    l4 = (kb + 3) // 4 * 4
    out = s.new_ones((nb, l4)).t()
    out[:kb] = s
    return out


def _block_mm(a, sa, b, sb, b_is_128x128, out_dtype):
    """a [m,k] fp8 with sa [m, k/128]; b [k,n] fp8 with sb [k/128, n/128] (128x128)
    or [k/128, n] (1x128 along k)."""
    if _use_cublas(a):
        if b_is_128x128:
            sb_arg, rb = _pad_k_major(sb), _ST.BlockWise128x128
        else:
            sb_arg, rb = sb.t(), _ST.BlockWise1x128
        return F.scaled_mm(a.contiguous(), b.t().contiguous().t(), _col_major_scale(sa),
                           _ST.BlockWise1x128, sb_arg, rb, output_dtype=out_dtype)
    m, k = a.shape
    n = b.shape[1]
    sbn = sb.repeat_interleave(B, dim=1) if b_is_128x128 else sb
    acc = torch.zeros(m, n, dtype=torch.float32, device=a.device)
    for kb in range(k // B):
        part = a[:, kb * B:(kb + 1) * B].to(torch.float32) @ b[kb * B:(kb + 1) * B].to(torch.float32)
        acc += part * sa[:, kb:kb + 1] * sbn[kb:kb + 1, :]
    return acc.to(out_dtype)


class _BlockwiseMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        x2 = x.reshape(-1, x.shape[-1]).contiguous()
        ctx.save_for_backward(x2, w)
        xq, xs = _quant_groups(x2, 1, B)                 # xs [M, K/128]
        wq, ws = _quant_groups(w.contiguous(), B, B)     # ws [N/128, K/128]
        y = _block_mm(xq, xs, wq.t(), ws.t(), True, x.dtype)
        return y.reshape(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, gy):
        x2, w = ctx.saved_tensors
        g2 = gy.reshape(-1, gy.shape[-1]).contiguous()
        gq, gs = _quant_groups(g2, 1, B)                 # gs [M, N/128]
        wq, ws = _quant_groups(w.contiguous(), B, B)     # ws [N/128, K/128]
        gx = _block_mm(gq, gs, wq, ws, True, g2.dtype)
        gtq, gts = _quant_groups(g2.t().contiguous(), 1, B)   # g.T [N,M], gts [N, M/128]
        xq, xs = _quant_groups(x2, B, 1)                 # xs [M/128, K]
        gw = _block_mm(gtq, gts, xq, xs, False, g2.dtype)
        return gx.reshape(*gy.shape[:-1], gx.shape[-1]), gw


def block_fp8_linear(input, weight, bias=None):
    out = _BlockwiseMM.apply(input, weight)
    if bias is not None:
        out = out + bias.to(out.dtype)
    return out
