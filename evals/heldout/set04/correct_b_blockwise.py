"""Blockwise FP8 linear, module form (author B: quantizer classes + dataclass configs).

DeepSeek-V3 granularity: 1x128 tiles for activations and gradients (tiles run
along the GEMM's reduction dim, so grad_weight tiles both operands along M),
128x128 blocks for the weight; e4m3 everywhere; exact fp32 scales. The GEMM is
emulated on the CPU per 128-wide slice of the reduction dim (fp32 partial
products times scales, summed in fp32), result rounded to bf16 and then
converted to nn.Linear's dtype.
"""
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class TileCfg:
    rows: int
    cols: int
    fp8: torch.dtype = torch.float8_e4m3fn


@dataclass(frozen=True)
class BlockRecipe:
    block: int = 128
    result_dtype: torch.dtype = torch.bfloat16


class BlockQuantized:
    """fp8 payload plus one inverse scale per tile, expanded to the GEMM's needs."""

    def __init__(self, data, inv_scale, cfg):
        self.data = data
        self.inv_scale = inv_scale
        self.cfg = cfg


class TileQuantizer:
    EPS = 1e-12

    def __init__(self, cfg: TileCfg):
        self.cfg = cfg

    def __call__(self, t):
        r, c = self.cfg.rows, self.cfg.cols
        R, C = t.shape
        view = t.reshape(R // r, r, C // c, c)
        amax = view.abs().amax(dim=3, keepdim=True).amax(dim=1, keepdim=True)
        s = torch.finfo(self.cfg.fp8).max / torch.clamp(amax.to(torch.float64), min=self.EPS)
        s = s.to(torch.float32)
        lim = torch.finfo(self.cfg.fp8).max
        q = (view.to(torch.float32) * s).clamp(min=-lim, max=lim).to(self.cfg.fp8)
        return BlockQuantized(q.reshape(R, C), s.reshape(R // r, C // c).reciprocal(), self.cfg)


class EmulatedBlockGemm:
    """A [rows, red] with inverse scales per (row, red/128); B [red, cols] with (red/128, col)."""

    def __init__(self, recipe: BlockRecipe):
        self.recipe = recipe

    def __call__(self, a_data, a_inv, b_data, b_inv, out_dtype):
        blk = self.recipe.block
        rows, red = a_data.shape
        cols = b_data.shape[1]
        acc = torch.zeros(rows, cols, dtype=torch.float32)
        for k in range(red // blk):
            sl = slice(k * blk, (k + 1) * blk)
            part = a_data[:, sl].to(torch.float32) @ b_data[sl, :].to(torch.float32)
            acc += part * a_inv[:, k:k + 1] * b_inv[k:k + 1, :]
        return acc.to(self.recipe.result_dtype).to(out_dtype)


class BlockwiseFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, engine):
        ctx.save_for_backward(x, w)
        ctx.engine = engine
        x2 = x.reshape(-1, x.shape[-1])
        qx = engine.act(x2)
        qw = engine.weight(w)
        blk = engine.recipe.block
        w_inv = qw.inv_scale.t().repeat_interleave(blk, dim=1)         # [K/128, N]
        y = engine.gemm(qx.data, qx.inv_scale, qw.data.t(), w_inv, x.dtype)
        return y.reshape(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, gy):
        x, w = ctx.saved_tensors
        engine = ctx.engine
        blk = engine.recipe.block
        gy2 = gy.reshape(-1, gy.shape[-1])
        x2 = x.reshape(-1, x.shape[-1])
        qg = engine.act(gy2)
        qw = engine.weight(w)
        w_inv = qw.inv_scale.repeat_interleave(blk, dim=1)             # [N/128, K]
        gx = engine.gemm(qg.data, qg.inv_scale, qw.data, w_inv, gy.dtype)
        gx = gx.reshape(*gy.shape[:-1], gx.shape[-1])
        qgt = engine.act(gy2.t())                                      # [N, M], tiles along M
        qxm = engine.act_cols(x2)                                      # [M, K], 128x1 tiles
        gw = engine.gemm(qgt.data, qgt.inv_scale, qxm.data, qxm.inv_scale, gy.dtype)
        return gx, gw, None


class BlockEngine:
    def __init__(self, recipe=BlockRecipe()):
        b = recipe.block
        self.recipe = recipe
        self.act = TileQuantizer(TileCfg(1, b))
        self.act_cols = TileQuantizer(TileCfg(b, 1))
        self.weight = TileQuantizer(TileCfg(b, b))
        self.gemm = EmulatedBlockGemm(recipe)


class BlockQLinear(nn.Linear):
    @classmethod
    def from_float(cls, linear, recipe: BlockRecipe = BlockRecipe()):
        with torch.device("meta"):
            new = cls(linear.in_features, linear.out_features, bias=False)
        new.weight = linear.weight
        new.bias = linear.bias
        new.engine = BlockEngine(recipe)
        return new

    def forward(self, x):
        y = BlockwiseFn.apply(x, self.weight, self.engine)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y
