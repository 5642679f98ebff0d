"""[planted bug: The forward block GEMM always writes bf16 (torchao prototype's out_dtype) and upcasts, rounding an fp32 model's output to bf16.]

Copy of bw_fn.py with one small change. Original docstring:

Blockwise FP8 linear, function form: blockwise_linear(input, weight, bias=None).

DeepSeek-V3 / torchao 0.18 prototype.blockwise_fp8_training recipe: activations and
gradients in 1x128 tiles, weights in 128x128 blocks, e4m3, exact (not power-of-2)
scales: amax per group (clamped at 1e-12 in float64), scale = float32(448 / amax),
quantize clamp(x.float() * scale, +-448) -> e4m3, GEMMs take 1 / scale.
grad_weight = grad_output.T @ input with 1x128 groups along M (tokens) for both.
CUDA: torch.nn.functional.scaled_mm with BlockWise1x128 / BlockWise128x128 scales in
cuBLASLt's layouts; other devices: the block GEMM emulated exactly in float64.
"""
import torch
import torch.nn.functional as F

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
EPS = 1e-12
B = 128


def _scales(amax):
    amax = torch.clamp(amax.to(torch.float64), min=EPS)
    return (FP8_MAX / amax).to(torch.float32)


def act_quant(x):
    """1 x 128 groups along the last dim; returns (q row-major, inv scales [R, C/B] column-major)."""
    assert x.is_contiguous()
    R, C = x.shape
    g = x.view(R, C // B, B)
    s = _scales(g.abs().amax(dim=2, keepdim=True))
    q = (g.to(torch.float32) * s).clamp(-FP8_MAX, FP8_MAX).to(FP8).view(R, C)
    inv = 1.0 / s.view(R, C // B)
    return q, inv.t().contiguous().t()


def weight_quant(w):
    """128 x 128 blocks; returns (q row-major, inv scales [R/B, C/B])."""
    assert w.is_contiguous()
    R, C = w.shape
    g = w.view(R // B, B, C // B, B).permute(0, 2, 1, 3)
    s = _scales(g.abs().amax(dim=(2, 3), keepdim=True))
    q = (g.to(torch.float32) * s).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    q = q.permute(0, 2, 1, 3).reshape(R, C)
    inv = 1.0 / s.view(R // B, C // B)
    return q, inv


def _kmajor_padded(inv_nk):
    nb, kb = inv_nk.shape
    kpad = -(-kb // 4) * 4
    s = torch.ones(nb, kpad, dtype=torch.float32, device=inv_nk.device)
    s[:, :kb] = inv_nk
    return s.t()


def _mm(a, sa, b, sb, rhs_blocks, out_dtype):
    """a [M,K] e4m3 row-major, sa [M, K/B]; b [K,N] e4m3 column-major,
    sb [round4(K/B), N/B] (rhs_blocks) or [N, K/B] (1x128)."""
    if a.device.type == "cuda":
        st = getattr(F, "ScalingType", None) or torch._C._ScalingType
        return F.scaled_mm(
            a, b,
            scale_a=sa, scale_recipe_a=st.BlockWise1x128,
            scale_b=sb, scale_recipe_b=st.BlockWise128x128 if rhs_blocks else st.BlockWise1x128,
            output_dtype=out_dtype,
        )
    M, K = a.shape
    N = b.shape[1]
    kb = K // B
    a_deq = (a.double().view(M, kb, B) * sa.double().unsqueeze(-1)).view(M, K)
    if rhs_blocks:
        sbk = sb[:kb].double().repeat_interleave(B, dim=0).repeat_interleave(B, dim=1)
    else:
        sbk = sb.double().t().repeat_interleave(B, dim=0)
    b_deq = b.double() * sbk
    return torch.mm(a_deq, b_deq).to(out_dtype)


class BlockwiseMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        hp = torch.bfloat16
        xq, xs = act_quant(x.reshape(-1, x.shape[-1]).contiguous())
        wq, ws = weight_quant(w.contiguous())
        y = _mm(xq, xs, wq.t(), _kmajor_padded(ws), True, hp)
        return y.to(x.dtype).reshape(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        N, K = w.shape
        dy2 = dy.reshape(-1, N).contiguous()
        x2 = x.reshape(-1, K).contiguous()
        hp = dy.dtype if dy.dtype in (torch.bfloat16, torch.float32) else torch.bfloat16
        dyq, dys = act_quant(dy2)
        wtq, wts = weight_quant(w.t().contiguous())
        dx = _mm(dyq, dys, wtq.t(), _kmajor_padded(wts), True, hp)
        dytq, dyts = act_quant(dy2.t().contiguous())
        xtq, xts = act_quant(x2.t().contiguous())
        dw = _mm(dytq, dyts, xtq.t(), xts, False, hp)
        return dx.to(dy.dtype).reshape(*dy.shape[:-1], K), dw.to(dy.dtype)


def blockwise_linear(input, weight, bias=None):
    y = BlockwiseMatmul.apply(input, weight)
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y
