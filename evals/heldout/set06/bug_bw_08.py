"""blockwise_linear(input, weight, bias=None): 1x128 / 128x128 FP8 (DeepSeek-V3 recipe).

Generic tiling: a tensor [R, C] is cut into (tr, tc) tiles with one fp32
scale each (amax / 448, exact). GEMMs are emulated slice by slice along the
reduction dimension (128 wide) in fp32, then rounded to bf16 like the
hardware kernel's output, then to the caller's dtype.
"""
import torch

T = 128
E4M3 = torch.float8_e4m3fn
QMAX = torch.finfo(E4M3).max


def quantize_tiles(t, tile):
    """Return (fp8 [R, C], inverse scales [R/tr, C/tc])."""
    tr, tc = tile
    R, C = t.shape
    with torch.no_grad():
        v = t.reshape(R // tr, tr, C // tc, tc)
        amax = v.abs().amax(dim=(1, 3), keepdim=True).double().clamp(min=1e-12)
        s = (QMAX / amax).float()
        q = (v.float() * s).clamp(-QMAX, QMAX).to(E4M3).reshape(R, C)
        return q, s.reciprocal().reshape(R // tr, C // tc)


def _expand(inv, rows, cols):
    return inv.repeat_interleave(rows // inv.shape[0], 0).repeat_interleave(cols // inv.shape[1], 1)


def mm_blocked(a, a_inv, b, b_inv):
    """a [M, R] x b [R, N]; a_inv constant over 128-wide slices of R per row, b_inv per column."""
    M, R = a.shape
    N = b.shape[1]
    ai = _expand(a_inv, M, R // T)          # [M, R/128]
    bi = _expand(b_inv, R // T, N)          # [R/128, N]
    out = a.new_zeros((M, N), dtype=torch.float32)
    for j in range(R // T):
        lo, hi = j * T, (j + 1) * T
        out += (a[:, lo:hi].float() @ b[lo:hi, :].float()) * ai[:, j:j + 1] * bi[j:j + 1, :]
    return out


def _weight_t_for_backward(w):
    """K-major fp8 copy of the weight for the grad_input GEMM, cached on the tensor."""
    cache = getattr(w, "_fp8_blk_t", None)
    if cache is None or cache[0] != w._version:
        q, inv = quantize_tiles(w.detach(), (T, T))
        cache = (w._version, q.t().contiguous(), inv.t().contiguous())
        w._fp8_blk_t = cache
    return cache[1], cache[2]


class _Blockwise(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        xq, x_inv = quantize_tiles(x, (1, T))
        wq, w_inv = quantize_tiles(w, (T, T))
        y = mm_blocked(xq, x_inv, wq.t(), w_inv.t())
        return y.to(torch.bfloat16).to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        dx = dw = None
        if ctx.needs_input_grad[0]:
            gq, g_inv = quantize_tiles(dy, (1, T))
            wq_t, w_inv_t = _weight_t_for_backward(w)
            dx = mm_blocked(gq, g_inv, wq_t.t(), w_inv_t.t())
            dx = dx.to(torch.bfloat16).to(dy.dtype)
        if ctx.needs_input_grad[1]:
            gq, g_inv = quantize_tiles(dy, (T, 1))      # [M/128, N]
            xq, x_inv = quantize_tiles(x, (T, 1))       # [M/128, K]
            x_inv = x_inv.t().contiguous().view(x_inv.shape)  # column-major scales for the kernel
            dw = mm_blocked(gq.t(), g_inv.t(), xq, x_inv)
            dw = dw.to(torch.bfloat16)
        return dx, dw


def blockwise_linear(input, weight, bias=None):
    x2 = input.reshape(-1, input.shape[-1])
    y = _Blockwise.apply(x2, weight)
    y = y.reshape(*input.shape[:-1], weight.shape[0])
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y
