"""Blockwise FP8 linear (1x128 / 128x128 scales) as a function, emulated by dequantize + matmul."""
import torch

BLOCK = 128
E4M3 = torch.float8_e4m3fn
EPS = 1e-12


def _scale(amax, fmax):
    return (fmax / torch.clamp(amax.to(torch.float64), min=EPS)).to(torch.float32)


def quant_1x128(t, fp8_dtype=E4M3):
    """t [r, c] -> (fp8 [r, c], scales [r, c // 128]); one scale per 1x128 tile along c."""
    fmax = torch.finfo(fp8_dtype).max
    r, c = t.shape
    tiles = t.reshape(r, c // BLOCK, BLOCK)
    scale = _scale(torch.amax(torch.abs(tiles), dim=-1, keepdim=True), fmax)
    q = (tiles.to(torch.float32) * scale).clamp(min=-fmax, max=fmax).to(fp8_dtype)
    return q.reshape(r, c), scale.squeeze(-1)


def dequant_1x128(q, scale):
    r, c = q.shape
    tiles = q.to(torch.float32).reshape(r, c // BLOCK, BLOCK)
    return (tiles * scale.reciprocal().unsqueeze(-1)).reshape(r, c)


def quant_128x128(t, fp8_dtype=E4M3):
    """t [r, c] -> (fp8 [r, c], scales [r // 128, c // 128])."""
    fmax = torch.finfo(fp8_dtype).max
    r, c = t.shape
    blocks = t.reshape(r // BLOCK, BLOCK, c // BLOCK, BLOCK)
    scale = _scale(torch.amax(torch.abs(blocks), dim=(1, 3), keepdim=True), fmax)
    q = (blocks.to(torch.float32) * scale).clamp(min=-fmax, max=fmax).to(fp8_dtype)
    return q.reshape(r, c), scale.reshape(r // BLOCK, c // BLOCK)


def dequant_128x128(q, scale):
    r, c = q.shape
    blocks = q.to(torch.float32).reshape(r // BLOCK, BLOCK, c // BLOCK, BLOCK)
    inv = scale.reciprocal().reshape(r // BLOCK, 1, c // BLOCK, 1)
    return (blocks * inv).reshape(r, c)


class _BlockwiseLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        x2 = x.reshape(-1, x.shape[-1])
        x_dq = dequant_1x128(*quant_1x128(x2, torch.float8_e4m3fnuz))
        w_dq = dequant_128x128(*quant_128x128(w))
        ctx.save_for_backward(x2, w)
        ctx.x_shape = x.shape
        out = torch.mm(x_dq, w_dq.t()).to(x.dtype)
        return out.reshape(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx, grad_output):
        x2, w = ctx.saved_tensors
        go2 = grad_output.reshape(-1, grad_output.shape[-1])
        g_dq = dequant_1x128(*quant_1x128(go2))
        w_dq = dequant_128x128(*quant_128x128(w))
        grad_input = torch.mm(g_dq, w_dq).to(grad_output.dtype).reshape(ctx.x_shape)

        gt_dq = dequant_1x128(*quant_1x128(go2.t().contiguous()))
        xt_dq = dequant_1x128(*quant_1x128(x2.t().contiguous()))
        grad_weight = torch.mm(xt_dq, gt_dq.t()).t().to(grad_output.dtype)
        return grad_input, grad_weight


def fp8_blockwise_linear(input, weight, bias=None):
    out = _BlockwiseLinear.apply(input, weight)
    if bias is not None:
        out = out + bias.to(out.dtype)
    return out
