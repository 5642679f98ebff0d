"""Correct FP8 linear, "blockwise" recipe (DeepSeek-V3 style; held-out reference).

Quantization (same numerics as torchao 0.18 prototype.blockwise_fp8_training kernels):
  activations and gradients: 1 x 128 tiles along the GEMM's inner dim; weights: 128 x 128
  blocks; e4m3 everywhere; per tile scale = 448 / clamp(amax in float64, 1e-12) as float32
  (no power-of-2 rounding); q = clamp(x.float() * scale, +-448).to(e4m3); the GEMM gets
  the inverse scales.
GEMMs (blockwise_backend.scaled_mm_blockwise: F.scaled_mm on CUDA, emulation on CPU):
  output      = x [M,K] (1x128 along K)           @ W.T [K,N] (128x128)      bf16 out
  grad_input  = go [M,N] (1x128 along N)          @ W [N,K] (128x128)        bf16 out
  grad_weight = go.T [N,M] (1x128 along M)        @ x [M,K] (128x1 along M)  bf16 out
For grad_weight the token dim M is zero-padded to a multiple of 128 (zeros do not change
any tile's amax). Results are cast to the dtype of the GEMM's A high-precision tensor;
autograd casts grad_weight to the weight's dtype. K and N must be multiples of 128.
"""
import importlib.util
import pathlib
import sys

import torch
import torch.nn as nn


def _sibling(name):
    key = "heldout_" + name
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, pathlib.Path(__file__).with_name(name + ".py"))
        mod = importlib.util.module_from_spec(spec)
        sys.modules[key] = mod
        spec.loader.exec_module(mod)
    return sys.modules[key]


_be = _sibling("blockwise_backend")
ST = _be.ST
E4M3 = torch.float8_e4m3fn
FMAX = torch.finfo(E4M3).max
EPS = 1e-12
B = 128


def tile_quant(x):
    """1x128 tiles along the last dim. x [R, C] -> fp8 [R, C] row-major, inv scale [R, C/128] (strides (1, R))."""
    R, C = x.shape
    t = x.float().reshape(R, C // B, B)
    amax = t.abs().amax(dim=-1, keepdim=True).to(torch.float64).clamp(min=EPS)
    scale = (FMAX / amax).to(torch.float32)
    q = (t * scale).clamp(-FMAX, FMAX).to(E4M3).reshape(R, C).contiguous()
    inv = scale.reciprocal().reshape(R, C // B)
    return q, inv.t().contiguous().t()


def block_quant(w):
    """128x128 blocks. w [R, C] -> fp8 [R, C] row-major, inv scale grid [R/128, C/128]."""
    R, C = w.shape
    t = w.float().reshape(R // B, B, C // B, B)
    amax = t.abs().amax(dim=(1, 3), keepdim=True).to(torch.float64).clamp(min=EPS)
    scale = (FMAX / amax).to(torch.float32)
    q = (t * scale).clamp(-FMAX, FMAX).to(E4M3).reshape(R, C).contiguous()
    return q, scale.reciprocal().reshape(R // B, C // B)


def k_major_padded(grid):
    """grid [K/128, N/128] -> [L4, N/128] with strides (1, L4); padding rows hold 1.0."""
    kb, nb = grid.shape
    l4 = (kb + 3) // 4 * 4
    out = grid.new_ones(nb, l4).t()
    out[:kb] = grid
    return out


def _pad_rows(t, mult=B):
    pad = (-t.shape[0]) % mult
    return torch.nn.functional.pad(t, (0, 0, 0, pad)) if pad else t


def _gemm(a, sa, b, sb, recipe_b, out_dtype):
    out = _be.scaled_mm_blockwise(a, b, sa, ST.BlockWise1x128, sb, recipe_b, torch.bfloat16)
    return out.to(out_dtype)


def output_gemm(x, w):
    x8, sx = tile_quant(x)
    w8, sw = block_quant(w)                       # [N, K], grid [N/128, K/128]
    return _gemm(x8, sx, w8.t(), k_major_padded(sw.t()), ST.BlockWise128x128, x.dtype)


def grad_input_gemm(go, w):
    g8, sg = tile_quant(go)
    w8, sw = block_quant(w)                       # B = W [N, K], inner dim N
    return _gemm(g8, sg, w8.t().contiguous().t(), k_major_padded(sw), ST.BlockWise128x128, go.dtype)


def grad_weight_gemm(go, x):
    go_p, x_p = _pad_rows(go), _pad_rows(x)
    gt8, sgt = tile_quant(go_p.t())               # A = go.T [N, Mp], tiles along M
    xt8, sxt = tile_quant(x_p.t())                # x.T [K, Mp], tiles along M
    return _gemm(gt8, sgt, xt8.t(), sxt, ST.BlockWise1x128, go.dtype)


class _BlockwiseLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        if x.shape[-1] % B or w.shape[0] % B:
            raise ValueError("blockwise fp8 linear needs in_features and out_features divisible by 128")
        ctx.save_for_backward(x, w)
        return output_gemm(x, w)

    @staticmethod
    def backward(ctx, go):
        x, w = ctx.saved_tensors
        return grad_input_gemm(go, w), grad_weight_gemm(go, x)


def fp8_linear(input_2d, weight):
    """function form"""
    return _BlockwiseLinearFn.apply(input_2d, weight)


class Float8BlockwiseLinear(nn.Linear):
    """module form"""

    def forward(self, x):
        out = fp8_linear(x.reshape(-1, x.shape[-1]), self.weight)
        out = out.reshape(*x.shape[:-1], out.shape[-1])
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out

    @classmethod
    def from_float(cls, lin):
        with torch.device("meta"):
            new = cls(lin.in_features, lin.out_features, bias=False)
        new.weight, new.bias = lin.weight, lin.bias
        return new
