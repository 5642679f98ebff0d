"""Blockwise FP8 linear (1x128 / 128x128) with activation-spike protection.

Before quantizing, activations are clipped to +-8 x RMS so that a single spike cannot
flatten the scale of its whole 1x128 tile (8 sigma is far outside any normal activation
distribution, so the clip is a no-op in regular training)."""
import importlib.util
import pathlib
import sys

import torch


def _load(stem):
    key = "heldout_" + stem
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, pathlib.Path(__file__).with_name(stem + ".py"))
        sys.modules[key] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[key])
    return sys.modules[key]


mm_backend = _load("blockwise_backend")
BLK = 128
F8 = torch.float8_e4m3fn
F8_MAX = torch.finfo(F8).max
SPIKE_CLIP_RMS = 8.0


def clip_spikes(x):
    rms = x.float().pow(2).mean().sqrt()
    lim = SPIKE_CLIP_RMS * rms
    return torch.maximum(torch.minimum(x, lim.to(x.dtype)), (-lim).to(x.dtype))


def q_tiles(x):
    r, c = x.shape
    v = x.float().reshape(r, c // BLK, BLK)
    s = (F8_MAX / v.abs().amax(-1, keepdim=True).double().clamp(min=1e-12)).float()
    q = (v * s).clamp(-F8_MAX, F8_MAX).to(F8).reshape(r, c).contiguous()
    return q, s.reciprocal().reshape(r, c // BLK).t().contiguous().t()


def q_blocks(w):
    r, c = w.shape
    v = w.float().reshape(r // BLK, BLK, c // BLK, BLK)
    s = (F8_MAX / v.abs().amax((1, 3), keepdim=True).double().clamp(min=1e-12)).float()
    q = (v * s).clamp(-F8_MAX, F8_MAX).to(F8).reshape(r, c).contiguous()
    return q, s.reciprocal().reshape(r // BLK, c // BLK)


def rhs_blocks_layout(grid):
    kb, nb = grid.shape
    kp = (kb + 3) // 4 * 4
    out = grid.new_ones(nb, kp).t()
    out[:kb] = grid
    return out


def gemm(a, sa, b, sb, rb, dt):
    return mm_backend.scaled_mm_blockwise(a, b, sa, mm_backend.ST.BlockWise1x128, sb, rb).to(dt)


class SpikeSafeBlockwiseLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        xq, xs = q_tiles(clip_spikes(x))
        wq, ws = q_blocks(w)
        return gemm(xq, xs, wq.t(), rhs_blocks_layout(ws.t()), mm_backend.ST.BlockWise128x128, x.dtype)

    @staticmethod
    def backward(ctx, gy):
        x, w = ctx.saved_tensors
        gq, gs = q_tiles(gy)
        wq, ws = q_blocks(w)
        gx = gemm(gq, gs, wq.t().contiguous().t(), rhs_blocks_layout(ws), mm_backend.ST.BlockWise128x128,
                  gy.dtype)
        pad = (-x.shape[0]) % BLK
        gyp = torch.nn.functional.pad(gy, (0, 0, 0, pad))
        xp = torch.nn.functional.pad(clip_spikes(x), (0, 0, 0, pad))
        gtq, gts = q_tiles(gyp.t())
        xtq, xts = q_tiles(xp.t())
        gw = gemm(gtq, gts, xtq.t(), xts, mm_backend.ST.BlockWise1x128, gy.dtype)
        return gx, gw


def spike_safe_blockwise_linear(x, w):
    return SpikeSafeBlockwiseLinear.apply(x, w)
