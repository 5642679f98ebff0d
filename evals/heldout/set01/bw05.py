"""Float8BlockwiseLinear: DeepSeek-V3 blockwise FP8 training linear (1x128 activation /
gradient tiles, 128x128 weight blocks). The quantization kernels take 16-bit activations
(bf16 or fp16)."""
import importlib.util
import pathlib
import sys

import torch
import torch.nn as nn


def _backend():
    key = "heldout_blockwise_backend"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, str(pathlib.Path(__file__).parent / "blockwise_backend.py"))
        m = importlib.util.module_from_spec(spec)
        sys.modules[key] = m
        spec.loader.exec_module(m)
    return sys.modules[key]


BK = _backend()
SUPPORTED_ACT_DTYPES = (torch.bfloat16, torch.float16)
BLOCK = 128
Q = torch.float8_e4m3fn
QMAX = torch.finfo(Q).max


def quant_act(x):
    assert x.dtype in SUPPORTED_ACT_DTYPES, f"unsupported activation dtype {x.dtype}"
    m, k = x.shape
    v = x.float().reshape(m, k // BLOCK, BLOCK)
    s = (QMAX / v.abs().amax(2, keepdim=True).to(torch.float64).clamp(min=1e-12)).to(torch.float32)
    q = (v * s).clamp(-QMAX, QMAX).to(Q).reshape(m, k).contiguous()
    return q, s.reciprocal().reshape(m, -1).t().contiguous().t()


def quant_weight(w):
    n, k = w.shape
    v = w.float().reshape(n // BLOCK, BLOCK, k // BLOCK, BLOCK)
    s = (QMAX / v.abs().amax((1, 3), keepdim=True).to(torch.float64).clamp(min=1e-12)).to(torch.float32)
    q = (v * s).clamp(-QMAX, QMAX).to(Q).reshape(n, k).contiguous()
    return q, s.reciprocal().reshape(n // BLOCK, k // BLOCK)


def rhs_scale_layout(grid):
    kb, nb = grid.shape
    kp = (kb + 3) // 4 * 4
    buf = grid.new_ones(nb, kp).t()
    buf[:kb] = grid
    return buf


class fp8_blockwise_mm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        xq, xs = quant_act(x)
        wq, ws = quant_weight(weight)
        out = BK.scaled_mm_blockwise(xq, wq.t(), xs, BK.ST.BlockWise1x128,
                                     rhs_scale_layout(ws.t()), BK.ST.BlockWise128x128)
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx, go):
        x, weight = ctx.saved_tensors
        gq, gs = quant_act(go)
        wq, ws = quant_weight(weight)
        gx = BK.scaled_mm_blockwise(gq, wq.t().contiguous().t(), gs, BK.ST.BlockWise1x128,
                                    rhs_scale_layout(ws), BK.ST.BlockWise128x128)
        pad = -x.shape[0] % BLOCK
        go_p = torch.nn.functional.pad(go, (0, 0, 0, pad))
        x_p = torch.nn.functional.pad(x, (0, 0, 0, pad))
        gtq, gts = quant_act(go_p.t())
        xtq, xts = quant_act(x_p.t())
        gw = BK.scaled_mm_blockwise(gtq, xtq.t(), gts, BK.ST.BlockWise1x128, xts, BK.ST.BlockWise1x128)
        return gx.to(go.dtype), gw.to(go.dtype)


class Float8BlockwiseLinear(nn.Linear):
    def forward(self, x):
        out = fp8_blockwise_mm.apply(x.reshape(-1, x.shape[-1]), self.weight)
        out = out.reshape(*x.shape[:-1], out.shape[-1])
        return out if self.bias is None else out + self.bias.to(out.dtype)

    @classmethod
    def from_float(cls, mod):
        with torch.device("meta"):
            new = cls(mod.in_features, mod.out_features, bias=False)
        new.weight = mod.weight
        new.bias = mod.bias
        return new
