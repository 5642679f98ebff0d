"""DeepSeek-V3 style blockwise FP8 linear (nn.Linear drop-in).

Activations and gradients: 1x128 tiles along the GEMM's reduction dimension.
Weights: 128x128 blocks. e4m3 everywhere, exact (not power-of-two) fp32 scales.

There is no block-scaled _scaled_mm on the CPU, so `block_scaled_mm` emulates
the kernel: one fp32 partial product per 128-wide slice of the reduction
dimension, scaled by that slice's scales and accumulated in fp32; the result
is rounded to bf16 (what the GPU kernel writes) and then to the caller's dtype.
in_features, out_features and the token count must be multiples of 128.
"""
import torch
import torch.nn as nn

BLOCK = 128
ACT_DTYPE = torch.float8_e4m3fn
WEIGHT_DTYPE = torch.float8_e4m3fn
EPS = 1e-12


@torch.no_grad()
def act_quant(x):
    """1x128 tiles along the last dim of a contiguous [R, C] tensor -> (fp8, inv [R, C/128])."""
    fmax = torch.finfo(ACT_DTYPE).max
    rows, cols = x.shape
    tiles = x.view(-1, BLOCK)
    amax = tiles.abs().amax(dim=1, keepdim=True).to(torch.float64)
    scale = (fmax / amax.clamp(min=EPS)).to(torch.float32)
    q = (tiles.to(torch.float32) * scale).clamp(-fmax, fmax).to(ACT_DTYPE)
    return q.view(rows, cols), scale.reciprocal().view(rows, cols // BLOCK)


@torch.no_grad()
def colwise_quant(x):
    """128x1 tiles (along dim 0) of [R, C] -> (fp8 [R, C], inv [R/128, C])."""
    fmax = torch.finfo(ACT_DTYPE).max
    rows, cols = x.shape
    tiles = x.reshape(rows // BLOCK, BLOCK, cols)
    amax = tiles.abs().amax(dim=1, keepdim=True).to(torch.float64)
    scale = (fmax / amax.clamp(min=EPS)).to(torch.float32)
    q = (tiles.to(torch.float32) * scale).clamp(-fmax, fmax).to(ACT_DTYPE)
    return q.reshape(rows, cols), scale.reciprocal().reshape(rows // BLOCK, cols)


@torch.no_grad()
def weight_quant(w):
    """128x128 blocks of [R, C] -> (fp8 [R, C], inv [R/128, C/128])."""
    fmax = torch.finfo(WEIGHT_DTYPE).max
    rows, cols = w.shape
    blocks = w.reshape(rows // BLOCK, BLOCK, cols // BLOCK, BLOCK)
    amax = blocks.abs().amax(dim=(1, 3), keepdim=True).to(torch.float64)
    scale = (fmax / amax.clamp(min=EPS)).to(torch.float32)
    q = (blocks.to(torch.float32) * scale).clamp(-fmax, fmax).to(WEIGHT_DTYPE)
    return q.reshape(rows, cols), scale.reciprocal().reshape(rows // BLOCK, cols // BLOCK)


def block_scaled_mm(a, a_inv, b, b_inv):
    """a [M, R] fp8 with a_inv [M, R/128]; b [R, N] fp8 with b_inv [R/128, N]. fp32 result."""
    m, r = a.shape
    n = b.shape[1]
    acc = torch.zeros(m, n, dtype=torch.float32)
    for kb in range(r // BLOCK):
        sl = slice(kb * BLOCK, (kb + 1) * BLOCK)
        part = a[:, sl].to(torch.float32) @ b[sl, :].to(torch.float32)
        acc += part * a_inv[:, kb:kb + 1] * b_inv[kb:kb + 1, :]
    return acc


class BlockwiseFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight):
        k = x.shape[-1]
        x2 = x.reshape(-1, k).contiguous()
        xq, x_inv = act_quant(x2)
        wq, w_inv = weight_quant(weight)
        w_inv_cols = w_inv.t().repeat_interleave(BLOCK, dim=1)       # [K/128, N]
        out = block_scaled_mm(xq, x_inv, wq.t(), w_inv_cols)
        out = out.to(torch.bfloat16).to(x.dtype)
        ctx.save_for_backward(x, weight)
        return out.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        n, k = weight.shape
        go = grad_out.reshape(-1, n)
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            gq, g_inv = act_quant(go)                                    # tiles along N
            wq, w_inv = weight_quant(weight)
            w_inv_cols = w_inv.repeat_interleave(BLOCK, dim=1)           # [N/128, K]
            grad_x = block_scaled_mm(gq, g_inv, wq, w_inv_cols)
            grad_x = grad_x.to(torch.bfloat16).to(grad_out.dtype).reshape(*x.shape)
        if ctx.needs_input_grad[1]:
            x2 = x.reshape(-1, k)
            gtq, gt_inv = act_quant(go.t().contiguous())                 # tiles along M
            xq, x_inv = colwise_quant(x2)                                # tiles along M
            grad_w = block_scaled_mm(gtq, gt_inv, xq, x_inv).to(torch.bfloat16)
        return grad_x, grad_w


class BlockwiseFP8Linear(nn.Linear):
    def forward(self, x):
        y = BlockwiseFn.apply(x, self.weight)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y

    @classmethod
    def from_float(cls, mod: nn.Linear):
        assert mod.in_features % BLOCK == 0 and mod.out_features % BLOCK == 0
        with torch.device("meta"):
            new = cls(mod.in_features, mod.out_features, bias=False)
        new.weight = mod.weight
        new.bias = mod.bias
        return new
