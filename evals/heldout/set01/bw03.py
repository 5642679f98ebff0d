"""Blockwise FP8 linear (1x128 / 128x128, DeepSeek-V3).

output and grad_input use the block-scaled GEMM. The weight-gradient GEMM (1x128 x 1x128
scales, contraction over tokens) is not available on every cuBLAS build, so it is
decomposed over the 128-token blocks: inside one block both operands have a single scale
per row/column, i.e. a plain rowwise-scaled _scaled_mm, and the per-block products are
summed."""
import importlib.util
import pathlib
import sys

import torch


def _import_backend():
    name = "heldout_blockwise_backend"
    if name not in sys.modules:
        path = pathlib.Path(__file__).resolve().parent / "blockwise_backend.py"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


_backend = _import_backend()
_ST = _backend.ST
_TILE = 128
_E4M3 = torch.float8_e4m3fn
_LIM = torch.finfo(_E4M3).max


def quant_1x128(t):
    rows, cols = t.shape
    v = t.float().reshape(rows, cols // _TILE, _TILE)
    amax = v.abs().amax(-1, keepdim=True).double().clamp(min=1e-12)
    sc = (_LIM / amax).float()
    q = (v * sc).clamp(-_LIM, _LIM).to(_E4M3).reshape(rows, cols).contiguous()
    return q, sc.reciprocal().reshape(rows, cols // _TILE).t().contiguous().t()


def quant_128x128(t):
    rows, cols = t.shape
    v = t.float().reshape(rows // _TILE, _TILE, cols // _TILE, _TILE)
    amax = v.abs().amax((1, 3), keepdim=True).double().clamp(min=1e-12)
    sc = (_LIM / amax).float()
    q = (v * sc).clamp(-_LIM, _LIM).to(_E4M3).reshape(rows, cols).contiguous()
    return q, sc.reciprocal().reshape(rows // _TILE, cols // _TILE)


def _kmajor(grid):
    kb, nb = grid.shape
    kp = (kb + 3) // 4 * 4
    out = grid.new_ones(nb, kp).t()
    out[:kb] = grid
    return out


def _block_gemm(a, sa, b, sb, recipe_b, out_dtype):
    y = _backend.scaled_mm_blockwise(a, b, sa, _ST.BlockWise1x128, sb, recipe_b, torch.bfloat16)
    return y.to(out_dtype)


def _wgrad_by_token_blocks(gt_q, gt_s, xt_q, xt_s):
    """gt_q [N, Mp] with scales [N, Mp/128]; xt_q [K, Mp] with scales [K, Mp/128]."""
    acc = None
    for j in range(gt_q.shape[1] // _TILE):
        sl = slice(j * _TILE, (j + 1) * _TILE)
        part = torch._scaled_mm(gt_q[:, sl].contiguous(), xt_q[:, sl].t(),
                                scale_a=gt_s[:, j].reshape(-1, 1).contiguous(),
                                scale_b=xt_s[:, j].reshape(1, -1).contiguous(),
                                out_dtype=torch.bfloat16)
        acc = part if acc is None else acc + part
    return acc


class _Fn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        xq, xs = quant_1x128(x)
        wq, ws = quant_128x128(w)
        return _block_gemm(xq, xs, wq.t(), _kmajor(ws.t()), _ST.BlockWise128x128, x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        gq, gs = quant_1x128(dy)
        wq, ws = quant_128x128(w)
        dx = _block_gemm(gq, gs, wq.t().contiguous().t(), _kmajor(ws), _ST.BlockWise128x128, dy.dtype)
        pad = (-x.shape[0]) % _TILE
        dyp = torch.nn.functional.pad(dy, (0, 0, 0, pad))
        xp = torch.nn.functional.pad(x, (0, 0, 0, pad))
        gtq, gts = quant_1x128(dyp.t())
        xtq, xts = quant_1x128(xp.t())
        dw = _wgrad_by_token_blocks(gtq, gts, xtq, xts)
        return dx, dw.to(dy.dtype)


def blockwise_fp8_linear(x, w):
    return _Fn.apply(x, w)
