"""Hopper's FP8 GEMMs bit for bit: what an H100 or H200 computes for one scaled GEMM call.

An FP8 `_scaled_mm` on Hopper is a tensor-core accumulation followed by an epilogue. Neither is
an fp32 or float64 dot product: the tensor cores align each block of products to its largest
exponent and truncate to about 13 fraction bits, cuBLASLt may split K over thread blocks and add
the pieces, and without fast accumulation partial sums are promoted to fp32 at intervals. A
float64 dot product rounded once matched the H200 on 0 of 64 small configurations (about half
the elements equal; the exactness probe of ../shared/DESIGN.md). This module computes the H200's bits instead:

    accumulator   mmaemu (PyPI, a pinned dependency: a model of Hopper's tensor cores after Fasi
                  et al. 2021 and Khattak & Mikaitis 2026, with cuBLASLt's split-K decisions from
                  tables its author recorded on an H100 PCIe): the fp32 [M, N] accumulator of
                  A [M, K] @ B [N, K].T before any scale
    epilogue      written here, one function per kind of call (torch.nn.functional.ScalingType):

        TensorWise  mmaemu.scaled_mm: alpha = scale_a * scale_b times the accumulator, in fp32,
                    rounded once to the out dtype
        RowWise     (accumulator * scale_b [1, N]) * scale_a [M, 1] in fp32, rounded to the out
                    dtype; one accumulator over the whole K (S = 1)
        BlockWise   one accumulator per 128-long block of K (S = 1 within a block), added to an
                    fp32 total in K order by a fused multiply-add with its scales (blockwise()
                    says how, per kind of B scales), then rounded

Measured on the H200 (torch 2.11, CUDA 13, mmaemu 0.1.0) by `fp8-parity calibrate` on 2026-12-02
(parity/calibration/nvidia-h200.csv, 728 configurations): bit for bit on 570 of 576 TensorWise (bf16, fp16
and fp32 out), 96 of 96 RowWise and 54 of 56 BlockWise configurations. All eight that differ are
256x8192x256: TensorWise with fast accumulation (72-76% of the elements equal in bf16, 23-27% in fp16,
1% in fp32: a split-K that mmaemu's H100 table puts at 2 and the H200 does otherwise) and BlockWise
(99.98%). mmaemu raises
SplitKUnknownError for shapes outside its table (K < 1024, among others): those run as one split
(S = 1), which reproduced the H200 on every such configuration; `Modelled.split_known` says which.
Where the model may be trusted on a given GPU is parity.calibration's to say, from that table.

Scales are the multipliers `_scaled_mm` takes (inverse scales): a result is acc * scale_a * scale_b.
"""

from __future__ import annotations

import enum
import importlib.util
import math
import warnings
from dataclasses import dataclass

import torch

from parity.recipes import BLOCK  # the K extent of one BlockWise scale (1x128 tiles, 128x128 blocks)



class CallKind(str, enum.Enum):
    """The kind of a scaled GEMM call, as torch.nn.functional.ScalingType names them."""

    TENSORWISE = "TensorWise"
    ROWWISE = "RowWise"
    BLOCKWISE = "BlockWise"


class HopperModelError(ValueError):
    """A call the model does not cover: what was wrong, and what would be."""


@dataclass(frozen=True)
class Modelled:
    """The model's result of one call, and how its accumulation was split."""

    value: torch.Tensor  # [M, N] of the call's out dtype
    splits: int  # how many pieces K was split into (split-K); 1 for RowWise and BlockWise
    split_known: bool  # True: mmaemu's table decided the split; False: one split assumed (S = 1)


def available() -> bool:
    """Whether mmaemu is installed (without importing it)."""
    return importlib.util.find_spec("mmaemu") is not None


def mmaemu_module():
    """mmaemu, imported on first use (it is needed only where exactness is asked for), or a clear error."""
    try:
        import mmaemu
    except ImportError as err:
        raise HopperModelError(f"the Hopper model needs mmaemu ({err}); install it with "
                               "`pip install mmaemu==0.1.0`") from None
    return mmaemu


def _check_operands(a: torch.Tensor, b_rows: torch.Tensor) -> tuple[int, int, int]:
    fp8 = (torch.float8_e4m3fn, torch.float8_e5m2)
    if a.dim() != 2 or b_rows.dim() != 2 or a.shape[1] != b_rows.shape[1]:
        raise HopperModelError(f"operands must be A [M, K] and B [N, K] (B's rows, as the weight is stored), "
                               f"got A {list(a.shape)} and B {list(b_rows.shape)}")
    if a.dtype not in fp8 or b_rows.dtype not in fp8:
        raise HopperModelError(f"operands must be float8_e4m3fn or float8_e5m2, got {a.dtype} and {b_rows.dtype}")
    return a.shape[0], a.shape[1], b_rows.shape[0]


def accumulator(a: torch.Tensor, b_rows: torch.Tensor, *, fast_accum: bool, splits: int | str = 1,
                out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The fp32 [M, N] accumulator of A [M, K] @ B [N, K].T as Hopper's tensor cores sum it, before any
    scale. `splits` 1 (one accumulator over K) or "auto" (mmaemu's split-K table, keyed by `out_dtype`)."""
    _check_operands(a, b_rows)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # mmaemu's "not validated on this GPU" warnings: calibration says where
        return mmaemu_module().accumulate(a.contiguous(), b_rows.contiguous(), use_fast_accum=fast_accum,
                                          profile="hopper", splitk=splits, out_dtype_for_split=out_dtype)


def tensorwise(a: torch.Tensor, b_rows: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor, *,
               out_dtype: torch.dtype, fast_accum: bool) -> Modelled:
    """`torch._scaled_mm(a, b_rows.t(), scale_a, scale_b, out_dtype, use_fast_accum)` as Hopper computes it:
    mmaemu's split-K decision where its table has one, else one split."""
    _check_operands(a, b_rows)
    if scale_a.numel() != 1 or scale_b.numel() != 1:
        raise HopperModelError(f"a TensorWise call has one scale per operand, got {scale_a.numel()} and "
                               f"{scale_b.numel()}: use rowwise() or blockwise()")
    mmaemu = mmaemu_module()
    args = (a.contiguous(), b_rows.contiguous().t(), scale_a.reshape(()).float(), scale_b.reshape(()).float())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            decision = mmaemu.resolve_splitk(a.shape[0], b_rows.shape[0], a.shape[1], a_dtype=a.dtype,
                                             b_dtype=b_rows.dtype, out_dtype=out_dtype, use_fast_accum=fast_accum,
                                             profile="hopper")
            splits, known = decision.S, True
        except mmaemu.SplitKUnknownError:
            splits, known = 1, False
        value = mmaemu.scaled_mm(*args, out_dtype=out_dtype, use_fast_accum=fast_accum, profile="hopper",
                                 splitk="auto" if known else 1)
    return Modelled(value, splits, known)


def rowwise(a: torch.Tensor, b_rows: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor, *,
            out_dtype: torch.dtype, fast_accum: bool) -> Modelled:
    """A RowWise call: scale_a one per row of A ([M, 1] or [M]), scale_b one per row of B ([1, N] or [N])."""
    M, _, N = _check_operands(a, b_rows)
    if scale_a.numel() != M or scale_b.numel() != N:
        raise HopperModelError(f"a RowWise call has M = {M} A scales and N = {N} B scales, got "
                               f"{scale_a.numel()} and {scale_b.numel()}")
    acc = accumulator(a, b_rows, fast_accum=fast_accum, out_dtype=out_dtype)
    # B's scale first, then A's: (acc * scale_a) * scale_b differed from the H200 in 43 of 96 calibrated
    # configurations (1 element in 10^5), acc * (scale_a * scale_b) in 45; this order in none
    value = (acc * scale_b.reshape(1, N).float().to(acc.device)) * scale_a.reshape(M, 1).float().to(acc.device)
    return Modelled(value.to(out_dtype), 1, False)


def fma32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """fp32 a * b + c rounded once, as a GPU's fused multiply-add computes it, on any device. The
    product of two fp32 numbers is exact in float64; the sum is rounded to float64 by round-to-odd
    (the nearest float64, moved to its odd neighbour when the sum was inexact), which makes the
    final rounding to fp32 the correct one (53 >= 24 + 2 bits: no double rounding)."""
    product = a.double() * b.double()
    total = product + c.double()
    error = (product - (total - (total - product))) + (c.double() - (total - product))  # TwoSum: exact
    even = (total.view(torch.int64) & 1) == 0
    toward = torch.where(error > 0, math.inf, -math.inf).to(total)
    odd = torch.where((error != 0) & even, torch.nextafter(total, toward), total)
    return odd.float()


def blockwise(a: torch.Tensor, b_rows: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor, *,
              out_dtype: torch.dtype, b_tiles: str, fast_accum: bool = False) -> Modelled:
    """A BlockWise call: scale_a [M, K/128] (1x128 tiles of A); B's scales either of 128x128 blocks
    (`b_tiles` "128x128": scale_b [N/128, K/128], a weight's) or of 1x128 tiles ("1x128": [N, K/128],
    grad_weight's second operand). Per 128-long block of K: one accumulator, added to the running fp32
    total by a fused multiply-add; how the scales enter differs by B's tiles (the H200's kernels):

        128x128   total = fma(acc, scale_a * scale_b, total)
        1x128     total = fma(acc * scale_a, scale_b, total)

    (measured on the H200, 2026-12-02: of eight orders and roundings tried on the 28 calibrated shapes of
    each, only these two matched, 27 of 28 each; the 28th, 256x8192x256, 99.98% of the elements.)"""
    M, K, N = _check_operands(a, b_rows)
    if K % BLOCK:
        raise HopperModelError(f"a BlockWise call needs K a multiple of {BLOCK}, got K = {K}")
    blocks = K // BLOCK
    if b_tiles not in ("128x128", "1x128"):
        raise HopperModelError(f"b_tiles is '128x128' or '1x128', got {b_tiles!r}")
    b_shape = (-(-N // BLOCK), blocks) if b_tiles == "128x128" else (N, blocks)
    if tuple(scale_a.shape) != (M, blocks) or tuple(scale_b.shape) != b_shape:
        raise HopperModelError(f"a BlockWise call with {b_tiles} B scales takes scale_a [M, K/128] = [{M}, {blocks}] "
                               f"and scale_b {list(b_shape)}, got {list(scale_a.shape)} and {list(scale_b.shape)}")
    scale_a = scale_a.float().to(a.device)
    scale_b = scale_b.float().to(a.device)
    if b_tiles == "128x128":  # each block's scale over its 128 rows of B
        scale_b = scale_b.repeat_interleave(BLOCK, dim=0)[:N]
    total = torch.zeros(M, N, dtype=torch.float32, device=a.device)
    for block in range(blocks):  # in K order: fp32 addition is not associative
        k = slice(block * BLOCK, (block + 1) * BLOCK)
        acc = accumulator(a[:, k], b_rows[:, k], fast_accum=fast_accum, out_dtype=out_dtype)
        row_scale, column_scale = scale_a[:, block:block + 1], scale_b[:, block][None, :]
        if b_tiles == "128x128":
            total = fma32(acc, (row_scale * column_scale).expand_as(acc), total)
        else:
            total = fma32(acc * row_scale, column_scale.expand_as(acc), total)
    return Modelled(total.to(out_dtype), 1, False)
