"""Blockwise FP8 Linear (DeepSeek-V3 recipe) for transformer blocks: tokens are flattened
to [tokens, features] for the FP8 GEMMs."""
import importlib.util
import pathlib
import sys

import torch
import torch.nn as nn

_p = pathlib.Path(__file__).with_name("blockwise_backend.py")
_k = "heldout_blockwise_backend"
if _k not in sys.modules:
    _s = importlib.util.spec_from_file_location(_k, _p)
    sys.modules[_k] = importlib.util.module_from_spec(_s)
    _s.loader.exec_module(sys.modules[_k])
_bw = sys.modules[_k]

G = 128
E4M3 = torch.float8_e4m3fn
E4M3_MAX = torch.finfo(E4M3).max


def _q_1x128(x):
    m, k = x.shape
    xg = x.float().reshape(m, k // G, G)
    s = (E4M3_MAX / xg.abs().amax(-1, keepdim=True).to(torch.float64).clamp(min=1e-12)).to(torch.float32)
    return ((xg * s).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3).reshape(m, k).contiguous(),
            s.reciprocal().reshape(m, k // G).t().contiguous().t())


def _q_128x128(w):
    n, k = w.shape
    wg = w.float().reshape(n // G, G, k // G, G)
    s = (E4M3_MAX / wg.abs().amax((1, 3), keepdim=True).to(torch.float64).clamp(min=1e-12)).to(torch.float32)
    return ((wg * s).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3).reshape(n, k).contiguous(),
            s.reciprocal().reshape(n // G, k // G))


def _rhs(grid):
    kb, nb = grid.shape
    kp = (kb + 3) // 4 * 4
    o = grid.new_ones(nb, kp).t()
    o[:kb] = grid
    return o


def _mm(a, sa, b, sb, rb, dt):
    return _bw.scaled_mm_blockwise(a, b, sa, _bw.ST.BlockWise1x128, sb, rb, torch.bfloat16).to(dt)


class _BlockwiseFP8(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2d, w):
        ctx.save_for_backward(x2d, w)
        xq, xs = _q_1x128(x2d)
        wq, ws = _q_128x128(w)
        return _mm(xq, xs, wq.t(), _rhs(ws.t()), _bw.ST.BlockWise128x128, x2d.dtype)

    @staticmethod
    def backward(ctx, g):
        x2d, w = ctx.saved_tensors
        gq, gs = _q_1x128(g)
        wq, ws = _q_128x128(w)
        gx = _mm(gq, gs, wq.t().contiguous().t(), _rhs(ws), _bw.ST.BlockWise128x128, g.dtype)
        pad = (-x2d.shape[0]) % G
        gp = torch.nn.functional.pad(g, (0, 0, 0, pad))
        xp = torch.nn.functional.pad(x2d, (0, 0, 0, pad))
        gtq, gts = _q_1x128(gp.t())
        xtq, xts = _q_1x128(xp.t())
        gw = _mm(gtq, gts, xtq.t(), xts, _bw.ST.BlockWise1x128, g.dtype)
        return gx, gw


class TokenFlatFP8Linear(nn.Linear):
    def forward(self, x):
        tokens = x.reshape(-1, self.in_features)
        y = _BlockwiseFP8.apply(tokens, self.weight)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y

    @classmethod
    def from_float(cls, lin):
        with torch.device("meta"):
            new = cls(lin.in_features, lin.out_features, bias=False)
        new.weight, new.bias = lin.weight, lin.bias
        return new
