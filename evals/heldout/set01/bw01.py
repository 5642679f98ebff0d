"""DeepSeek-V3 style blockwise FP8 Linear (1x128 activation tiles, 128x128 weight blocks).

GEMMs go through blockwise_backend.scaled_mm_blockwise (F.scaled_mm on SM90, an emulation
on CPU)."""
import importlib.util
import pathlib
import sys

import torch
import torch.nn as nn


def _load_backend():
    key = "heldout_blockwise_backend"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, pathlib.Path(__file__).with_name("blockwise_backend.py"))
        sys.modules[key] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[key])
    return sys.modules[key]


_bk = _load_backend()
BW1x128, BW128x128 = _bk.ST.BlockWise1x128, _bk.ST.BlockWise128x128
FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
BS = 128


def act_quant(x):
    """[R, C] -> fp8 [R, C], inverse scales [R, C/BS] stored column-major."""
    r, c = x.shape
    tiles = x.float().view(r, c // BS, BS) if x.is_contiguous() else x.float().reshape(r, c // BS, BS)
    amax = tiles.abs().amax(-1, keepdim=True).double().clamp(min=1e-12)
    s = (FP8_MAX / amax).float()
    y = (tiles * s).clamp(-FP8_MAX, FP8_MAX).to(FP8).reshape(r, c).contiguous()
    inv = (1.0 / s).view(r, c // BS)
    return y, inv.t().contiguous().t()


def weight_quant(w):
    """[N, K] -> fp8 [N, K], inverse scales [N/BS, K/BS]."""
    n, k = w.shape
    blocks = w.float().reshape(n // BS, BS, k // BS, BS)
    amax = blocks.abs().amax(dim=(1, 3), keepdim=True).double().clamp(min=1e-12)
    s = (FP8_MAX / amax).float()
    y = (blocks * s).clamp(-FP8_MAX, FP8_MAX).to(FP8).reshape(n, k).contiguous()
    return y, (1.0 / s).reshape(n // BS, k // BS)


def k_major_pad4(s):
    """[kb, nb] scale grid -> [round_up(kb, 4), nb], strides (1, round_up(kb, 4))."""
    kb, nb = s.shape
    kp = -(-kb // 4) * 4
    out = torch.ones(nb, kp, dtype=s.dtype, device=s.device).t()
    out[:kb] = s
    return out


def _mm(a, sa, b, sb, rb, out_dtype):
    return _bk.scaled_mm_blockwise(a, b, sa, BW1x128, sb, rb, torch.bfloat16).to(out_dtype)


class _BlockwiseMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        xq, xs = act_quant(x)
        wq, ws = weight_quant(w)
        nb, kb = ws.shape
        return _mm(xq, xs, wq.t(), k_major_pad4(ws.reshape(kb, nb)), BW128x128, x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        dyq, dys = act_quant(dy)
        wq, ws = weight_quant(w)
        dx = _mm(dyq, dys, wq.t().contiguous().t(), k_major_pad4(ws), BW128x128, dy.dtype)
        pad = (-x.shape[0]) % BS
        dy_p = torch.nn.functional.pad(dy, (0, 0, 0, pad))
        x_p = torch.nn.functional.pad(x, (0, 0, 0, pad))
        dytq, dyts = act_quant(dy_p.t())
        xtq, xts = act_quant(x_p.t())
        dw = _mm(dytq, dyts, xtq.t(), xts, BW1x128, dy.dtype)
        return dx, dw


class BlockwiseFp8Linear(nn.Linear):
    def forward(self, x):
        y = _BlockwiseMM.apply(x.reshape(-1, self.in_features), self.weight)
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    @classmethod
    def from_float(cls, lin):
        assert lin.in_features % BS == 0 and lin.out_features % BS == 0
        with torch.device("meta"):
            m = cls(lin.in_features, lin.out_features, bias=False)
        m.weight, m.bias = lin.weight, lin.bias
        return m
