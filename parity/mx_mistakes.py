"""The mistakes bisect tries on a microscaled operand (MXFP8's 1x32 casts, NVFP4's 1x16), as data.

The same records as parity.mistakes' (a Hypothesis: description, bug class, the stage of
oracles.CastStages it changes and the transform of that stage), for the ways a block-scaled cast goes
wrong, each with its `detail` (vocabulary.Detail) inside its bug class:

    scale rounding   the E8M0 scale by another rule (FLOOR where RCEIL belongs, CEIL), one binade off,
                     a scale of 2^-127 applied as 2^-126 or as 1 (float32's smallest normal, TE's
                     'byte 0 means no scaling'); NVFP4's per-tensor scale left out or aimed at 448 or 6
    block axis       blocks across the inner dim (the other axis's cast: dim0 where dim1 belongs), or
                     blocks of another length
    nan handling     an amax that skips NaN (the block keeps a finite scale)
    swizzle          the scales written row-major where the call declares cuBLAS's swizzled layout
                     (layout: the right scales at the wrong places), or the grid viewed in the other
                     axis's shape (transpose: reinterpreted with view)
    scale padding    the scale grid written at the unpadded grid's row stride inside the padded one
    element rounding elements that come back zero (a rounding path that returns zeros) or rounded toward
                     zero (scale: the encoding of a block); saturation at +-448 skipped, at
                     e4m3fnuz's 240, or on the raw values; NVFP4's block scales saturated at 240
                     (saturation)

plus those of parity.mistakes that mean the same for any cast (the operand's values moved or stale,
rounded first, amax without abs, scales not inverted, the grid transposed, the bytes rearranged).
"""

from __future__ import annotations

import math
from functools import partial

import torch

from parity import mistakes, mx, oracles
from parity.mistakes import Hypothesis, NotApplicable, OperandStage, Quantized
from parity.recipes import FP8_FORMATS, Cast, Recipe, Scaling
from parity.vocabulary import BugClass, Detail

_BIGGEST = 2.0 ** 127  # the multiplier 2^-e of the smallest E8M0 scale, 2^-127


# ---- MXFP8: the E8M0 scale ---------------------------------------------------------------------------

def _ceil_scale(amax: torch.Tensor, fp8_max: float, **rounding) -> torch.Tensor:
    """CEIL (torchao's ScaleCalculationMode.CEIL): e = ceil(log2 amax) - 8."""
    amax32 = amax.to(torch.float32).to(torch.float64)
    mantissa, exponent = torch.frexp(amax32)
    e = torch.where(mantissa == 0.5, exponent - 1, exponent).to(torch.float64) - mx.E4M3_EMAX
    e = torch.where(amax32 > 0, e, torch.full_like(e, -127.0)).clamp(-127, 127)
    return torch.where(amax32.isfinite(), torch.exp2(-e), torch.full_like(e, math.nan)).to(torch.float32)


def _binade_off(step: int, rule: str, amax: torch.Tensor, fp8_max: float, **rounding) -> torch.Tensor:
    """The recipe's scale one binade off: 2^-(e + step)."""
    return (mx.mxfp8_scale(amax, rule=rule) * 2.0 ** -step).to(torch.float32)


def _nan_skipped(groups: torch.Tensor) -> torch.Tensor:
    """amax over the block's numbers only: a NaN does not reach the scale (a max that ignores NaN)."""
    if not bool(groups.isnan().any()):
        raise NotApplicable
    return torch.nan_to_num(groups.abs(), nan=0.0).amax(dim=(1, 3)).to(torch.float64)


def _smallest_scale_as(multiplier: float, groups: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The elements of blocks whose scale is 2^-127 multiplied by `multiplier` instead of 2^127."""
    if not bool((scale == _BIGGEST).any()):
        raise NotApplicable
    return oracles.scaled_values(groups, torch.where(scale == _BIGGEST, torch.full_like(scale, multiplier), scale))


# ---- the grid of scales as the GEMM reads it ---------------------------------------------------------

def _padding_value(q: Quantized) -> float:
    """What a scale byte of 0 (the contract's padding) decodes to: 2^-127 in E8M0, 0 in E4M3 (NVFP4's scales)."""
    return mx.PADDING_DECODED.get(q.fp8_dtype, mx.PADDING_DECODED[torch.float8_e4m3fn])


def _grid(q: Quantized) -> tuple[torch.Tensor, int, int]:
    rows, blocks = q.inv_scale.shape
    if q.tile[0] != 1 or rows < 2:
        raise NotApplicable
    return q.inv_scale, rows, blocks


def _read_swizzled(q: Quantized) -> Quantized:
    """The grid [rows, blocks] written row-major (padded with zero bytes) and read as swizzled."""
    grid, rows, blocks = _grid(q)
    padded_rows, padded_blocks = mx.padded_scale_shape(rows, blocks)
    flat = torch.full((padded_rows, padded_blocks), _padding_value(q), dtype=grid.dtype)
    flat[:rows, :blocks] = grid.cpu()
    misread = mx.unswizzled(flat.reshape(-1), rows, blocks)
    if torch.equal(misread, grid.cpu()):
        raise NotApplicable
    return Quantized(q.values, misread.to(grid.device), q.tile, q.fp8_dtype)


def _unpadded_stride(q: Quantized) -> Quantized:
    """The grid written at its own row stride (blocks) into the grid padded to 4 columns, read at the padded one."""
    grid, rows, blocks = _grid(q)
    padded = -(-blocks // 4) * 4
    if padded == blocks:
        raise NotApplicable
    flat = torch.full((rows * padded,), _padding_value(q), dtype=grid.dtype, device=grid.device)
    flat[: rows * blocks] = grid.reshape(-1)
    return Quantized(q.values, flat.reshape(rows, padded)[:, :blocks].contiguous(), q.tile, q.fp8_dtype)


def _grid_viewed_as_the_others(q: Quantized) -> Quantized:
    """The grid [rows, blocks] of a dim1 cast reinterpreted with view as [inner, rows / block] (the shape of the
    other axis's grid, as if its rows were the weight's) before it is swizzled, and read swizzled as [rows, blocks]."""
    grid, rows, blocks = _grid(q)
    block = q.values.shape[1] // blocks
    inner = blocks * block
    if rows % block or inner == rows:
        raise NotApplicable
    if math.prod(mx.padded_scale_shape(inner, rows // block)) != math.prod(mx.padded_scale_shape(rows, blocks)):
        raise NotApplicable  # another number of scales: the kernel refuses the call (a crash, not this)
    flat = mx.swizzled(grid.cpu().reshape(inner, rows // block), _padding_value(q))
    return Quantized(q.values, mx.unswizzled(flat, rows, blocks).to(grid.device), q.tile, q.fp8_dtype)


def _subtiles_transposed(q: Quantized) -> Quantized:
    """The elements of every 32x32 sub-tile transposed (a transposed store that swaps its row and column
    index), the scales where they belong."""
    rows, inner = q.values.shape
    if rows % 32 or inner % 32:
        raise NotApplicable
    tiles = q.values.reshape(rows // 32, 32, inner // 32, 32).transpose(1, 3)
    return Quantized(tiles.reshape(rows, inner).contiguous(), q.inv_scale, q.tile, q.fp8_dtype)


def _nibbles_swapped(q: Quantized) -> Quantized:
    """Packed e2m1 pairs with element 2j in the high nibble: each pair of elements swapped."""
    rows, inner = q.values.shape
    return Quantized(q.values.reshape(rows, inner // 2, 2).flip(-1).reshape(rows, inner), q.inv_scale, q.tile,
                     q.fp8_dtype)


def _zero_elements(q: Quantized) -> Quantized:
    if not bool(q.values.any()):
        raise NotApplicable
    return Quantized(torch.zeros_like(q.values), q.inv_scale, q.tile, q.fp8_dtype)


def _truncated(scaled: torch.Tensor, fmt) -> torch.Tensor:
    """The scaled values rounded toward zero onto the element grid (a floor of the magnitude where the contract
    rounds to nearest even), saturating at the format's max."""
    magnitude = scaled.to(torch.float64).abs().clamp(max=fmt.max)
    step = mx.grid_quantum(magnitude, fmt.mantissa_bits, fmt.min_exponent)
    truncated = torch.copysign(torch.floor(magnitude / step) * step, scaled.to(torch.float64))
    if torch.equal(truncated, oracles.saturated(scaled, fmt)):
        raise NotApplicable
    return torch.where(scaled.isnan(), scaled.to(torch.float64), truncated)


# ---- NVFP4: the two-level scale ----------------------------------------------------------------------

def _nvfp4_scale_with(divisor: float | None, amax: torch.Tensor, fp8_max: float, **rounding) -> torch.Tensor:
    """The decode scales with the per-tensor scale amax / divisor (None: no per-tensor scale, 1.0)."""
    global_ = (torch.ones((), dtype=torch.float32) if divisor is None else
               mx.nvfp4_global_scale(amax.max(), divisor=divisor))
    return mx.nvfp4_block_scales(amax, global_) * global_.to(torch.float64)


def _nvfp4_divided_by_unrounded(groups: torch.Tensor, decode: torch.Tensor) -> torch.Tensor:
    """The elements divided by the block's decode scale before its e4m3 rounding (amax / 6, in float32), while
    the GEMM is handed the rounded one."""
    global_ = mx.nvfp4_global_scale(groups.abs().amax())
    amax_block = groups.to(torch.float32).abs().amax(dim=(1, 3))
    unrounded = mx.nvfp4_block_quotient(amax_block, global_).clamp(max=mx.E4M3_MAX) * global_
    if torch.equal(unrounded.to(torch.float64), decode.to(torch.float64)):
        raise NotApplicable
    return mx.divided_by_decode_scale(groups, unrounded)


def _nvfp4_scale_bound(bound: float, amax: torch.Tensor, fp8_max: float, **rounding) -> torch.Tensor:
    """Block scales saturated at `bound` (e4m3fnuz's 240, say) where the contract saturates them at 448."""
    global_ = mx.nvfp4_global_scale(amax.max())
    per_block = mx.nvfp4_block_quotient(amax, global_)
    if not bool((per_block > bound).any()):
        raise NotApplicable
    return mx.round_e4m3(per_block.clamp(max=bound).to(torch.float64)) * global_.to(torch.float64)


def _nvfp4_scale_clamped(amax: torch.Tensor, fp8_max: float, **rounding) -> torch.Tensor:
    """Block scales clamped at e4m3's smallest normal 2^-6 (torchao 0.18's nvfp4_quantize)."""
    global_ = mx.nvfp4_global_scale(amax.max())
    blocks = mx.nvfp4_block_scales(amax, global_)
    if not bool((blocks < 2.0 ** -6).any()):
        raise NotApplicable
    return blocks.clamp(min=2.0 ** -6) * global_.to(torch.float64)


# ---- the families ----------------------------------------------------------------------------------

def _mx(description: str, bug_class: BugClass, detail: Detail, stage: OperandStage, transform) -> Hypothesis:
    return Hypothesis(description, bug_class, stage, transform, detail=detail)


def _mxfp8_scales(recipe: Recipe) -> list[Hypothesis]:
    rule = recipe.mx_rule or mx.ScaleRule.RCEIL.value
    others = [r for r in (mx.ScaleRule.RCEIL.value, mx.ScaleRule.FLOOR.value) if r != rule]
    return [
        *(_mx(f"its E8M0 scales by {other.upper()} where the recipe rounds by {rule.upper()}", BugClass.SCALE,
              Detail.SCALE_ROUNDING, OperandStage.SCALE, partial(mx.mxfp8_scale, rule=other)) for other in others),
        _mx("its E8M0 scales by CEIL (ceil(log2 amax) - 8)", BugClass.SCALE, Detail.SCALE_ROUNDING,
            OperandStage.SCALE, _ceil_scale),
        *(_mx(f"its E8M0 scales one binade {'too large' if step > 0 else 'too small'} (2^(e{step:+d}))",
              BugClass.SCALE, Detail.SCALE_ROUNDING, OperandStage.SCALE, partial(_binade_off, step, rule))
          for step in (1, -1)),
        _mx("a scale of 2^-127 applied as 2^-126 (clamped to float32's smallest normal) when its elements are cast",
            BugClass.SCALE, Detail.SCALE_ROUNDING, OperandStage.SCALED, partial(_smallest_scale_as, 2.0 ** 126)),
        _mx("a scale of 2^-127 (byte 0) read as 'no scaling' when its elements are cast: multiplied by 1",
            BugClass.SCALE, Detail.SCALE_ROUNDING, OperandStage.SCALED, partial(_smallest_scale_as, 1.0)),
        *_mx_saturation(),
    ]


def _mx_saturation() -> list[Hypothesis]:
    """The e4m3 elements' saturation at +-448 done wrong: not at all, at e4m3fnuz's 240, or on the raw values."""
    e4m3, fnuz = FP8_FORMATS["e4m3"].max, FP8_FORMATS["e4m3fnuz"].max
    return [
        _mx(f"cast without saturating: elements beyond {e4m3:g} become NaN", BugClass.SATURATION,
            Detail.ELEMENT_ROUNDING, OperandStage.SATURATION, mistakes._not_saturating),
        _mx(f"its elements clamped at {fnuz:g} (e4m3fnuz's max) instead of {e4m3:g}", BugClass.SATURATION,
            Detail.ELEMENT_ROUNDING, OperandStage.SATURATION, partial(mistakes._clamped_at, fnuz)),
        _mx(f"its raw values clamped to +-{e4m3:g} before the cast (the block scales from the clamped values)",
            BugClass.SATURATION, Detail.ELEMENT_ROUNDING, OperandStage.SOURCE, partial(mistakes._clipped, e4m3)),
        _mx(f"its raw values clamped to +-{e4m3:g} before they are scaled, the block scales from the unclamped amax",
            BugClass.SATURATION, Detail.ELEMENT_ROUNDING, OperandStage.SCALED, partial(mistakes._raw_clamped, e4m3)),
    ]


def _nvfp4_scales() -> list[Hypothesis]:
    return [
        _mx("no per-tensor scale (global 1.0): the block scales alone", BugClass.SCALE, Detail.SCALE_ROUNDING,
            OperandStage.SCALE, partial(_nvfp4_scale_with, None)),
        *(_mx(f"its per-tensor scale amax / {divisor:g} instead of amax / (448 * 6)", BugClass.SCALE,
              Detail.SCALE_ROUNDING, OperandStage.SCALE, partial(_nvfp4_scale_with, divisor))
          for divisor in (mx.E4M3_MAX, mx.E2M1_MAX)),
        _mx("its block scales clamped at e4m3's smallest normal 2^-6", BugClass.SCALE, Detail.SCALE_ROUNDING,
            OperandStage.SCALE, _nvfp4_scale_clamped),
        _mx("its elements divided by the block scale before its e4m3 rounding (the GEMM handed the rounded one)",
            BugClass.SCALE, Detail.SCALE_ROUNDING, OperandStage.SCALED, _nvfp4_divided_by_unrounded),
        _mx(f"its e4m3 block scales saturated at {FP8_FORMATS['e4m3fnuz'].max:g} (e4m3fnuz's max) instead of "
            f"{mx.E4M3_MAX:g}", BugClass.SATURATION, Detail.SCALE_ROUNDING, OperandStage.SCALE,
            partial(_nvfp4_scale_bound, FP8_FORMATS["e4m3fnuz"].max)),
    ]


def _blocks(cast: Cast, rows: int, inner: int) -> list[Hypothesis]:
    block = cast.scaling.tile(rows, inner)[1]
    tiles = [((block, 1), f"its blocks run across the inner dim ({block} rows of a column: the other axis's cast)",
              Detail.BLOCK_AXIS)]
    tiles += [((1, other), f"blocks of {other} elements instead of {block}", Detail.BLOCK_AXIS)
              for other in (16, 32, 64, 128) if other != block and inner % other == 0]
    return [_mx(description, BugClass.SCALE, detail, OperandStage.TILES, partial(mistakes._fixed_tile, tile))
            for tile, description, detail in tiles if rows % tile[0] == 0]


def _layouts() -> list[Hypothesis]:
    return [
        _mx("its scales written row-major where the call declares cuBLAS's swizzled layout (SWIZZLE_32_4_4)",
            BugClass.LAYOUT, Detail.SWIZZLE, OperandStage.GRID, _read_swizzled),
        _mx("its scale grid written at the unpadded row stride (K / block) inside the grid padded to 4 columns",
            BugClass.LAYOUT, Detail.SCALE_PADDING, OperandStage.GRID, _unpadded_stride),
        _mx("its grid of scales reinterpreted with view as the other axis's grid shape ([inner, rows / block]) "
            "before it is swizzled", BugClass.TRANSPOSE, Detail.SWIZZLE, OperandStage.GRID,
            _grid_viewed_as_the_others),
    ]


# parity.mistakes' families whose hypotheses mean the same for a microscaled operand, in their order there
_GENERIC = (("rounded first", mistakes._precision), ("without abs", mistakes._amax),
            ("not inverted", mistakes._scale), ("first group", mistakes._amax), ("values moved", mistakes._sources),
            ("delayed scaling", mistakes._sources), ("grids", mistakes._grids), ("memory misread", mistakes._sources),
            ("bytes", mistakes._bytes))
# the grid mistakes of DeepSeek-V3's 128x128 scale tensor (padding to 4 K-blocks): _layouts has MX's own
_NOT_MX = (mistakes._grid_padding_first, mistakes._grid_padded_row_major)


def _generic(cast: Cast, recipe: Recipe, rows: int, inner: int) -> list[Hypothesis]:
    """parity.mistakes' hypotheses that mean the same for a microscaled operand."""
    families = mistakes.hypothesis_families(cast, recipe, rows, inner)
    return [h for part, family in _GENERIC for h in families[(family, part)] if h.transform not in _NOT_MX]


def mx_hypotheses(cast: Cast, recipe: Recipe, rows: int, inner: int) -> list[Hypothesis]:
    """Every mistake tried on a microscaled operand [rows, inner], in the order that decides ties."""
    scales = _mxfp8_scales(recipe) if cast.scaling is Scaling.MX_1X32 else _nvfp4_scales()
    nan = [_mx("its amax skips NaN: a block holding a NaN keeps a finite scale", BugClass.SCALE, Detail.NAN_HANDLING,
               OperandStage.AMAX, _nan_skipped)]
    stores = [Hypothesis("its fp8 elements transposed within each 32x32 sub-tile (a transposed store that swaps "
                         "its row and column index; the scales where they belong)", BugClass.TRANSPOSE,
                         OperandStage.BYTES, _subtiles_transposed)]
    if cast.scaling is Scaling.NV_1X16:
        # the right values at the wrong places of the byte: a layout mistake, as misplaced scales are
        stores.append(Hypothesis("its e2m1 pairs packed with element 2j in the high nibble (each pair swapped)",
                                 BugClass.LAYOUT, OperandStage.BYTES, _nibbles_swapped))
    # the elements' encoding gone wrong, their scales right: a scale mistake by the MX sets' convention (the rule,
    # the encoding, the block: how a block's values become bytes)
    name = FP8_FORMATS[cast.fp8].name
    zeros = [_mx(f"its {name} elements all zero (a rounding path that returns zeros)",
                 BugClass.SCALE, Detail.ELEMENT_ROUNDING, OperandStage.BYTES, _zero_elements),
             _mx(f"its {name} elements rounded toward zero (truncated) instead of to nearest even",
                 BugClass.SCALE, Detail.ELEMENT_ROUNDING, OperandStage.SATURATION, _truncated)]
    return [*scales, *nan, *_blocks(cast, rows, inner), *_layouts(), *_generic(cast, recipe, rows, inner),
            *stores, *zeros]
