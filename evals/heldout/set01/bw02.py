"""Blockwise FP8 linear (DeepSeek-V3 recipe): act_quant / weight_quant / fp8_gemm.

cuBLASLt wants 128x128 RHS scales K-major with the K-block count padded to a multiple
of 4 (16-byte aligned columns); `_cublas_rhs_scales` builds that buffer."""
import importlib.util
import pathlib
import sys

import torch


def _backend():
    name = "heldout_blockwise_backend"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, pathlib.Path(__file__).parent / "blockwise_backend.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


bk = _backend()
block_size = 128
fp8 = torch.float8_e4m3fn
fp8_max = 448.0


def act_quant(x):
    m, k = x.shape
    g = x.float().reshape(m, k // block_size, block_size)
    amax = g.abs().amax(dim=2, keepdim=True).to(torch.float64).clamp(min=1e-12)
    scale = (fp8_max / amax).to(torch.float32)
    y = (g * scale).clamp(-fp8_max, fp8_max).to(fp8).reshape(m, k).contiguous()
    s_inv = scale.reciprocal().squeeze(-1)                 # [m, k/128]
    return y, s_inv.t().contiguous().t()


def weight_quant(w):
    n, k = w.shape
    g = w.float().reshape(n // block_size, block_size, k // block_size, block_size)
    amax = g.abs().amax(dim=(1, 3), keepdim=True).to(torch.float64).clamp(min=1e-12)
    scale = (fp8_max / amax).to(torch.float32)
    y = (g * scale).clamp(-fp8_max, fp8_max).to(fp8).reshape(n, k).contiguous()
    return y, scale.reciprocal().reshape(n // block_size, k // block_size)


def _pad_k_major(grid):
    """grid [k_blocks, n_blocks] -> [k_pad, n_blocks], K-major, padding = 1.0."""
    kb, _ = grid.shape
    k_pad = (kb + 3) // 4 * 4
    padded = torch.nn.functional.pad(grid, (0, 0, 0, k_pad - kb), value=1.0)
    return padded.t().contiguous().t()


def _cublas_rhs_scales(grid):
    """Same layout as _pad_k_major, built in one preallocated buffer (no pad + copy):
    grid [k_blocks, n_blocks] -> [k_pad, n_blocks] view, K-major (stride (1, k_pad))."""
    kb, nb = grid.shape
    k_pad = (kb + 3) // 4 * 4
    buf = torch.ones(k_pad * nb, dtype=torch.float32, device=grid.device)
    buf[: kb * nb] = grid.reshape(-1)
    return buf.view(nb, k_pad).t()


def fp8_gemm(a, a_s, b, b_s, recipe_b, out_dtype):
    out = bk.scaled_mm_blockwise(a, b, a_s, bk.ST.BlockWise1x128, b_s, recipe_b, torch.bfloat16)
    return out.to(out_dtype)


class BlockwiseLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        xq, xs = act_quant(x)
        wq, ws = weight_quant(weight)
        return fp8_gemm(xq, xs, wq.t(), _pad_k_major(ws.t()),
                        bk.ST.BlockWise128x128, x.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        gq, gs = act_quant(grad_out)
        wq, ws = weight_quant(weight)
        grad_x = fp8_gemm(gq, gs, wq.t().contiguous().t(), _cublas_rhs_scales(ws),
                          bk.ST.BlockWise128x128, grad_out.dtype)
        pad = -x.shape[0] % block_size
        g_p = torch.cat([grad_out, grad_out.new_zeros(pad, grad_out.shape[1])]) if pad else grad_out
        x_p = torch.cat([x, x.new_zeros(pad, x.shape[1])]) if pad else x
        gtq, gts = act_quant(g_p.t())
        xtq, xts = act_quant(x_p.t())
        grad_w = fp8_gemm(gtq, gts, xtq.t(), xts, bk.ST.BlockWise1x128, grad_out.dtype)
        return grad_x, grad_w


def blockwise_linear(x, weight):
    return BlockwiseLinear.apply(x, weight)
