"""The space of mistakes bisect tries, as data: every way one operand's cast can go wrong, and where its
values come from (read from the data by parity.operand_sources; the result's mistakes are
parity.result_mistakes').

parity.diagnose compares what a GEMM was handed (a recorded call) or what it computed (its result)
with what each hypothesis here says the GEMM would get: one mistake in the cast of one operand
(another fp8 format; amax without abs, over another region or without its floor; a scale rounded,
not inverted, not rounded to a power of two or aimed at another max; a clamp at another bound), or
the operand's values taken from elsewhere (transposed, reshaped, read with the wrong strides, the
previous call's). The recipe's correct quantization is parity.oracles' (CastStages); a hypothesis is
a record, the way OpInfo makes an op one record: its description (the words a diagnosis prints), its
bug class, the stage it changes and the transform of that stage (a function with the stage's own
signature, or None where only the operand's source changes). The space is composed from one
generator per family, in ORDER: the order decides ties between hypotheses that give the same operand.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import partial
from typing import Callable

import torch

from parity import oracles
from parity.oracles import Quantized
from parity.recipes import BLOCK, FP8_FORMATS, Cast, Fp8Format, Recipe
from parity.vocabulary import BugClass, Detail, Word


class OperandStage(Word):
    """What a mistake changes: the operand's values before the cast, a stage of the cast
    (oracles.CastStages: the value is its field), or what the GEMM is handed after it."""

    SOURCE = "source"  # the operand's values (rounded or clipped first; or, by Hypothesis.source, moved)
    FP8_FORMAT = "fp8_format"  # the format rounded onto (None: kept in high precision)
    TILES = "tiles"  # the elements sharing one scale
    AMAX = "amax"  # the amax of each group
    SCALE = "scale"  # the scale from the amax
    SCALED = "scaled"  # the values times their scale, before the fp8 rounding
    SATURATION = "saturation"  # the saturating round onto the fp8 grid
    INVERSE = "inverse"  # the scales handed to the GEMM (their inverse)
    BYTES = "bytes"  # the fp8 values handed to the GEMM (rearranged, converted)
    GRID = "grid"  # the grid of inverse scales as the GEMM reads it


CAST_STAGES = (OperandStage.FP8_FORMAT, OperandStage.TILES, OperandStage.AMAX, OperandStage.SCALE,
               OperandStage.SCALED, OperandStage.SATURATION,
               OperandStage.INVERSE)
AFTER_THE_CAST = (OperandStage.BYTES, OperandStage.GRID)


class Source(Word):
    """Where an operand's values (or its amax) come from (OperandSources.view)."""

    SAME = "same"
    TRANSPOSED = "transposed"
    RESHAPED = "reshaped"
    RESHAPED_FROM_TRANSPOSE = "reshaped_from_transpose"
    PREVIOUS = "previous"
    STRIDES_IGNORED = "strides_ignored"
    LEADING_SWAPPED = "leading_swapped"


class NotApplicable(Exception):
    """Raised by a transform where its mistake cannot apply to this operand, or changes nothing on it."""


@dataclass(frozen=True)
class Hypothesis:
    """One mistake in casting one operand: what it is called, its bug class, the stage it changes and
    the transform of that stage (None: the stage is the recipe's, only the source of its input moves)."""

    description: str
    bug_class: BugClass
    stage: OperandStage
    transform: Callable | None = None  # with the stage's signature (oracles.CastStages; SOURCE: x -> x;
    # BYTES and GRID: Quantized -> Quantized); raises NotApplicable where the mistake cannot apply
    source: Source = Source.SAME  # where the operand's values come from
    amax_source: Source = Source.SAME  # where its amax comes from: its values', or the previous call's
    also: tuple[tuple[OperandStage, Callable], ...] = ()  # further stages the same mistake changes
    detail: Detail | None = None  # inside its bug class, what of a microscaled cast it is (parity.mx_mistakes)

    @property
    def category(self) -> BugClass:
        return self.bug_class

    @property
    def changes(self) -> dict[OperandStage, Callable]:
        """Every stage this mistake changes, with its transform."""
        return {**({} if self.transform is None else {self.stage: self.transform}), **dict(self.also)}

    @property
    def keeps_high_precision(self) -> bool:
        """The operand is not cast to fp8 at all (a recorded call shows that by its dtype)."""
        return self.changes.get(OperandStage.FP8_FORMAT) is kept_in_high_precision


def quantize_mistaken(source: torch.Tensor, cast: Cast, recipe: Recipe,
                      hypothesis: Hypothesis | None = None) -> Quantized | None:
    """`source` cast with `cast` under `recipe`, with the mistake `hypothesis` (None: the recipe's own
    cast), or None where the mistake cannot apply or changes nothing on this operand (nothing clipped,
    already in that precision, a tile that does not divide it)."""
    changes = {} if hypothesis is None else hypothesis.changes
    stages = replace(oracles.recipe_stages(recipe),
                     **{stage.value: transform for stage, transform in changes.items() if stage in CAST_STAGES})
    try:
        if OperandStage.SOURCE in changes:
            source = changes[OperandStage.SOURCE](source)
        try:
            q = stages.cast(source, cast)
        except RuntimeError:  # a tile that does not divide this operand
            return None
        for stage in AFTER_THE_CAST:
            if stage in changes:
                q = changes[stage](q)
        return q
    except NotApplicable:
        return None


# ---- the transforms: each one stage done wrong, with the stage's signature ----------------------------

def kept_in_high_precision(cast: Cast) -> None:
    return None


def _in_format(name: str, cast: Cast) -> Fp8Format | None:
    return None if cast.fp8 is None else FP8_FORMATS[name]


def _fixed_tile(tile: tuple[int, int], cast: Cast, rows: int, inner: int) -> tuple[int, int]:
    return tile


def _rounded_first(dtype: torch.dtype, x: torch.Tensor) -> torch.Tensor:
    rounded = x.to(dtype).to(x.dtype)
    if torch.equal(rounded, x):
        raise NotApplicable  # already in that precision: the same as the correct cast
    return rounded


def _clipped(bound: float, x: torch.Tensor) -> torch.Tensor:
    if not bound or float(x.abs().max()) <= bound:
        raise NotApplicable  # nothing clipped: the same as the correct cast
    return x.clamp(-bound, bound)


def _clipped_at_rms(k: float, x: torch.Tensor) -> torch.Tensor:
    return _clipped(k * float(x.double().pow(2).mean().sqrt()), x)


def _signed_amax(groups: torch.Tensor) -> torch.Tensor:
    return groups.amax(dim=(1, 3)).to(torch.float64)


def _amax_of_rounded_copy(dtype: torch.dtype, groups: torch.Tensor) -> torch.Tensor:
    return oracles.group_amax(groups.to(dtype))


def _first_group_amax(groups: torch.Tensor) -> torch.Tensor:
    amax = oracles.group_amax(groups)
    return amax[:1, :1].expand_as(amax)


def _amax_from(other: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """The amax of another tensor of the operand's shape (delayed scaling: the previous call's)."""
    return oracles.group_amax(other.reshape(groups.shape))


def with_amax_of(hypothesis: Hypothesis, other: torch.Tensor) -> Hypothesis:
    """`hypothesis` (delayed scaling) with its amax taken from `other`, a tensor of the operand's shape."""
    return replace(hypothesis, transform=partial(_amax_from, other))


def _scale_in_bf16(amax: torch.Tensor, fp8_max: float, **rounding) -> torch.Tensor:
    return oracles.amax_to_scale(amax, fp8_max, **rounding).to(torch.bfloat16).to(torch.float32)


def _reciprocal_flipped(amax: torch.Tensor, fp8_max: float, *, pow2: bool, via_reciprocal: bool) -> torch.Tensor:
    return oracles.amax_to_scale(amax, fp8_max, pow2=pow2, via_reciprocal=not via_reciprocal)


def _pow2_flipped(amax: torch.Tensor, fp8_max: float, *, pow2: bool, via_reciprocal: bool) -> torch.Tensor:
    return oracles.amax_to_scale(amax, fp8_max, pow2=not pow2, via_reciprocal=via_reciprocal)


def _aimed_at(target: float, amax: torch.Tensor, fp8_max: float, **rounding) -> torch.Tensor:
    return oracles.amax_to_scale(amax, target, **rounding)


def _product_in(dtype: torch.dtype, groups: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (groups.to(torch.float64) * scale.to(torch.float64)[:, None, :, None]).to(dtype)


def _product_on_gpu(dtype: torch.dtype, groups: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The scale converted to the values' dtype first (a 0-dim device tensor), then the product in it."""
    return _product_in(dtype, groups, scale.to(dtype))


def _values_rounded(dtype: torch.dtype, groups: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return oracles.scaled_values(groups.to(dtype), scale)


def _raw_clamped(bound: float, groups: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    if float(groups.abs().max()) <= bound:
        raise NotApplicable  # nothing clamped: the same as the correct cast
    return oracles.scaled_values(groups.to(torch.float64).clamp(-bound, bound), scale)


def _clamped_at(bound: float, scaled: torch.Tensor, fmt: Fp8Format) -> torch.Tensor:
    bound = min(fmt.max, bound)
    return oracles.round_to_fp8_grid(scaled.to(torch.float64).clamp(-bound, bound), fmt.dtype)


def _not_saturating(scaled: torch.Tensor, fmt: Fp8Format) -> torch.Tensor:
    """No clamp: whatever rounds past the max is NaN (e4m3fn has no infinity)."""
    rounded = oracles.round_to_fp8_grid(scaled.to(torch.float64), fmt.dtype)
    return torch.where(rounded.abs() > fmt.max, torch.full_like(rounded, math.nan), rounded)


def _not_inverted(scale: torch.Tensor) -> torch.Tensor:
    return scale


def _converted_to(name: str, q: Quantized) -> Quantized:
    """The fp8 values rounded again onto another format, saturating there (the scale still the cast's)."""
    other = FP8_FORMATS[name]
    return Quantized(oracles.round_to_fp8_grid(q.values.clamp(-other.max, other.max), other.dtype), q.inv_scale,
                     q.tile, other.dtype)


def _with_values(q: Quantized, values: torch.Tensor) -> Quantized:
    return Quantized(values.contiguous(), q.inv_scale, q.tile, q.fp8_dtype)


def _bytes_transposed(q: Quantized) -> Quantized:
    return _with_values(q, q.values.t())


def _bytes_from_transposed_copy(q: Quantized) -> Quantized:
    """A transposed copy [inner, rows] read as if it were [rows, inner]."""
    return _with_values(q, q.values.t().contiguous().reshape(q.values.shape))


def _bytes_reshaped(q: Quantized) -> Quantized:
    """The values reshaped into [inner, rows] and transposed back."""
    rows, inner = q.values.shape
    return _with_values(q, q.values.reshape(inner, rows).t())


def _grid_of(q: Quantized) -> torch.Tensor:
    """The grid of inverse scales [rows / r, inner / i]; a single scale cannot be misread."""
    if q.inv_scale.numel() == 1:
        raise NotApplicable
    return q.inv_scale


def _with_grid(q: Quantized, grid: torch.Tensor) -> Quantized:
    return Quantized(q.values, grid.contiguous(), q.tile, q.fp8_dtype)


def _grid_transposed(q: Quantized) -> Quantized:
    g = _grid_of(q)
    if g.shape[0] != g.shape[1]:
        raise NotApplicable
    return _with_grid(q, g.t())


def _grid_reshaped(q: Quantized) -> Quantized:
    """The grid in its transposed (GEMM) layout, reshaped instead of transposed back."""
    g = _grid_of(q)
    rows, cols = g.shape
    if rows == cols:
        raise NotApplicable
    return _with_grid(q, g.reshape(cols, rows).t())


def _grid_transposed_reshaped(q: Quantized) -> Quantized:
    """The grid transposed, then reshaped to its own shape (a .t().reshape(shape) where nothing belongs)."""
    g = _grid_of(q)
    rows, cols = g.shape
    if rows == cols or 1 in (rows, cols):
        raise NotApplicable
    return _with_grid(q, g.t().reshape(rows, cols))


def _grid_first(q: Quantized) -> Quantized:
    g = _grid_of(q)
    return _with_grid(q, g[:1, :1].expand(*g.shape))


def _grid_padding_first(q: Quantized) -> Quantized:
    """The inner-dim blocks padded to a multiple of 4 with ones in front."""
    g = _grid_of(q)
    rows, cols = g.shape
    pad = -cols % 4
    if not pad:
        raise NotApplicable
    return _with_grid(q, torch.cat([g.new_ones(rows, pad), g], dim=1)[:, :cols])


def _grid_padded_row_major(q: Quantized) -> Quantized:
    """[inner blocks padded to 4, rows] written row-major, read inner-major."""
    g = _grid_of(q)
    rows, cols = g.shape
    padded = -(-cols // 4) * 4
    if padded == cols:
        raise NotApplicable
    flat = torch.ones(padded * rows, dtype=g.dtype, device=g.device)
    flat[: rows * cols] = g.t().reshape(-1)  # the [cols, rows] grid, row by row
    return _with_grid(q, flat.reshape(rows, padded)[:, :cols])  # read as [padded, rows] stored inner-major


# ---- the hypotheses, family by family ---------------------------------------------------------------

NARROWER = (("bfloat16", torch.bfloat16), ("float16", torch.float16))

# Where an operand's values come from, whatever its cast: the same mistakes for fp8 and high-precision operands
MOVED = {source: Hypothesis(description, category, OperandStage.SOURCE, source=source) for source, category,
         description in (
    (Source.TRANSPOSED, BugClass.TRANSPOSE, "the operand transposed (read the other way round)"),
    (Source.RESHAPED, BugClass.TRANSPOSE, "the operand reinterpreted with reshape instead of a transpose"),
    (Source.RESHAPED_FROM_TRANSPOSE, BugClass.TRANSPOSE,
     "the operand made from its transpose with reshape instead of .t()"),
    (Source.PREVIOUS, BugClass.STALE_STATE, "the operand of the previous call (a stale cache)"),
    (Source.STRIDES_IGNORED, BugClass.LAYOUT, "the operand read as if contiguous from non-contiguous memory"),
    (Source.LEADING_SWAPPED, BugClass.TRANSPOSE, "its tokens flattened from the leading dims in the wrong order "
                                                 "(dims swapped before the reshape)"))}
DELAYED_SCALING = Hypothesis("its scale from the previous call's amax, applied to this call's values (delayed "
                             "scaling: a scale computed in one call and kept for the next)", BugClass.STALE_STATE,
                             OperandStage.AMAX, amax_source=Source.PREVIOUS)

# A rounding of the scale rather than a structural mistake: one ulp off torchao's scale in some groups.
# parity.bisect, finding it, diagnoses again under a recipe that rounds its scales this way
# (Recipe.reciprocal_scales), so that a mistake beside it is named too. RECIPROCAL_SCALES_HYPOTHESIS is
# the record (compare with `is`); RECIPROCAL_SCALES its description.
RECIPROCAL_SCALES = ("its scale computed as fp8_max * (1 / amax) in float32 (a Python number divided by a float32 "
                     "tensor: two roundings, one ulp off the exact scale in about a quarter of the groups; compute "
                     "it in float64 and round once, as torchao does)")
EXACT_SCALES = "its scale the exact quotient fp8_max / amax rounded once, where its other scales take two roundings"
RECIPROCAL_SCALES_HYPOTHESIS = Hypothesis(RECIPROCAL_SCALES, BugClass.SCALE, OperandStage.SCALE, _reciprocal_flipped)
EXACT_SCALES_HYPOTHESIS = Hypothesis(EXACT_SCALES, BugClass.SCALE, OperandStage.SCALE, _reciprocal_flipped)


def rounded_before_cast(dtype: torch.dtype, description: str | None = None) -> Hypothesis:
    """The operand rounded to `dtype` before its cast (not applicable where it already is in it)."""
    return Hypothesis(description or f"the operand rounded to {dtype} before its cast", BugClass.PRECISION,
                      OperandStage.SOURCE, partial(_rounded_first, dtype))


def scaled_over(tile: tuple[int, int], description: str | None = None) -> Hypothesis:
    """The cast with one scale per `tile` (r, i) instead of its own."""
    return Hypothesis(description or f"scales over {tile[0]}x{tile[1]} tiles", BugClass.SCALE, OperandStage.TILES,
                      partial(_fixed_tile, tile))


def high_precision_hypotheses() -> list[Hypothesis]:
    """Every mistake tried on an operand a GEMM takes in high precision (no fp8 cast)."""
    return [*(rounded_before_cast(dtype, f"the operand rounded to {name} before the GEMM") for name, dtype in NARROWER),
            *MOVED.values()]


@dataclass(frozen=True)
class _Operand:
    """What the hypotheses of one operand are made from: its cast, its recipe, its shape [rows, inner]."""

    cast: Cast
    recipe: Recipe
    rows: int
    inner: int

    @property
    def fp8(self) -> str:
        return self.cast.fp8

    @property
    def other(self) -> str:
        return "e5m2" if self.cast.fp8 == "e4m3" else "e4m3"

    @property
    def own_tile(self) -> tuple[int, int]:
        return self.cast.scaling.tile(self.rows, self.inner)


def _formats(op: _Operand) -> dict[str, list[Hypothesis]]:
    fp8, other = op.fp8, op.other
    return {
        "another format": [Hypothesis(f"cast to {other} instead of {fp8}", BugClass.FP8_DTYPE, OperandStage.FP8_FORMAT,
                                      partial(_in_format, other))],
        "high precision": [Hypothesis(f"the operand used in high precision where the recipe casts it to {fp8}",
                                      BugClass.PRECISION, OperandStage.FP8_FORMAT, kept_in_high_precision)],
        "converted": [Hypothesis(f"its {fp8} values converted to {other} (the scale still {fp8}'s)",
                                 BugClass.FP8_DTYPE, OperandStage.BYTES, partial(_converted_to, other))],
        "ROCm": [Hypothesis(f"cast to {name} (ROCm's format, max {FP8_FORMATS[name].max:g}) instead of {fp8}",
                            BugClass.FP8_DTYPE, OperandStage.FP8_FORMAT, partial(_in_format, name))
                 for name in ("e4m3fnuz", "e5m2fnuz")],
    }


def _precision(op: _Operand) -> dict[str, list[Hypothesis]]:
    fp8 = op.fp8
    return {
        "rounded first": [rounded_before_cast(dtype, f"the operand rounded to {name} before its cast")
                          for name, dtype in NARROWER],
        "product": [Hypothesis(f"the operand multiplied by its scale in {name} (a {name} tensor times a 0-dim "
                               f"float32 scale stays {name}): rounded twice, to {name} and then to {fp8}",
                               BugClass.PRECISION, OperandStage.SCALED, partial(_product_in, dtype))
                    for name, dtype in NARROWER],
        "values": [Hypothesis(f"the operand rounded to {name} after its amax and before its scaling (the scale "
                              f"from the unrounded values)", BugClass.PRECISION, OperandStage.SCALED,
                              partial(_values_rounded, dtype)) for name, dtype in NARROWER],
        "product on the GPU": [Hypothesis(f"the operand multiplied by its scale in {name} on the GPU (the 0-dim "
                                          f"scale converted to {name} first, then the product): rounded twice, to "
                                          f"{name} and then to {fp8}", BugClass.PRECISION, OperandStage.SCALED,
                                          partial(_product_on_gpu, dtype)) for name, dtype in NARROWER],
    }


def _amax(op: _Operand) -> dict[str, list[Hypothesis]]:
    whole = op.own_tile == (op.rows, op.inner)  # one group: its first group is every group
    return {
        "without abs": [Hypothesis("amax = max(x) instead of max(|x|)", BugClass.SCALE, OperandStage.AMAX,
                                   _signed_amax)],
        "rounded copy": [Hypothesis(f"its amax taken from a copy rounded to {name}", BugClass.SCALE, OperandStage.AMAX,
                                    partial(_amax_of_rounded_copy, dtype)) for name, dtype in NARROWER],
        "first group": [] if whole else [
            Hypothesis("every group scaled by the first group's amax (a scale indexed [0] and broadcast)",
                       BugClass.SCALE, OperandStage.AMAX, _first_group_amax)],
    }


def _scale(op: _Operand) -> dict[str, list[Hypothesis]]:
    recipe = op.recipe
    return {
        "bf16": [Hypothesis("its scale rounded to bfloat16", BugClass.SCALE, OperandStage.SCALE, _scale_in_bf16)],
        "reciprocal": [EXACT_SCALES_HYPOTHESIS if recipe.reciprocal_scales else RECIPROCAL_SCALES_HYPOTHESIS],
        "not inverted": [Hypothesis("the GEMM handed its scale instead of the inverse", BugClass.SCALE,
                                    OperandStage.INVERSE,
                                    _not_inverted)],
        "pow2": [Hypothesis("scales not rounded down to a power of two" if recipe.pow2_scales else
                            "scales rounded down to a power of two", BugClass.SCALE, OperandStage.SCALE,
        _pow2_flipped)],
        "no floor": [Hypothesis("no floor under amax: an all-zero group gets an infinite scale", BugClass.SCALE,
                                OperandStage.SCALE, partial(oracles.amax_to_scale, eps=0.0))],
        "floors": [Hypothesis(f"a floor of {eps:g} under amax instead of {oracles.EPS:g}", BugClass.SCALE,
                              OperandStage.SCALE,
                              partial(oracles.amax_to_scale, eps=eps)) for eps in (1e-4, 1e-6, 1e-8, 1e-10)],
    }


def _regions(rows: int, inner: int) -> list[tuple[str, tuple[int, int]]]:
    regions = [("the whole operand", (rows, inner)), ("each row along the inner dim", (1, inner)),
               ("each column (across the inner dim)", (rows, 1))]
    if inner % BLOCK == 0:
        regions.append((f"each 1x{BLOCK} tile", (1, BLOCK)))
    if rows % BLOCK == 0:
        regions.append((f"each {BLOCK}x1 tile (across the inner dim)", (BLOCK, 1)))
    if rows % BLOCK == 0 and inner % BLOCK == 0:
        regions.append((f"each {BLOCK}x{BLOCK} block", (BLOCK, BLOCK)))
    return regions


def _region_name(tile: tuple[int, int], rows: int, inner: int) -> str:
    return next((name for name, t in _regions(rows, inner) if t == tile), f"{tile[0]}x{tile[1]} tiles")


def _tiles(op: _Operand) -> dict[str, list[Hypothesis]]:
    own = _region_name(op.own_tile, op.rows, op.inner)
    return {"regions": [scaled_over(tile, f"amax over {region} instead of {own}")
                        for region, tile in _regions(op.rows, op.inner) if tile != op.own_tile]}


def _sources(op: _Operand) -> dict[str, list[Hypothesis]]:
    return {"values moved": [MOVED[source] for source in (Source.TRANSPOSED, Source.RESHAPED,
                                                          Source.RESHAPED_FROM_TRANSPOSE, Source.PREVIOUS)],
            "delayed scaling": [DELAYED_SCALING],
            "memory misread": [MOVED[Source.STRIDES_IGNORED], MOVED[Source.LEADING_SWAPPED]]}


def _grids(op: _Operand) -> dict[str, list[Hypothesis]]:
    return {"grids": [Hypothesis(description, category, OperandStage.GRID, transform) for category, transform,
                      description in (
        (BugClass.TRANSPOSE, _grid_transposed, "its grid of scales transposed"),
        (BugClass.TRANSPOSE, _grid_reshaped, "its grid of scales reinterpreted with reshape instead of transposed"),
        (BugClass.TRANSPOSE, _grid_transposed_reshaped, "its grid of scales transposed and reshaped back to its own "
                                                        "shape"),
        (BugClass.SCALE, _grid_first, "the GEMM handed the first group's inverse scale for every group (the values "
                                      "quantized with their own)"),
        (BugClass.SCALE, _grid_padding_first, "its scales read from a grid padded to 4 along the inner dim with the "
                                              "padding first: padding bytes consumed as scales"),
        (BugClass.SCALE, _grid_padded_row_major, "its scales written row-major into a grid padded to 4 along the "
                                                 "inner dim that the GEMM reads inner-dim-major: padding and "
                                                 "misplaced scales consumed"))]}


def _saturation(op: _Operand) -> dict[str, list[Hypothesis]]:
    own = FP8_FORMATS[op.fp8]
    return {
        "clipped at an RMS": [Hypothesis(f"clipped at {k} times its RMS before the cast", BugClass.SATURATION,
                                         OperandStage.SOURCE, partial(_clipped_at_rms, float(k)))
                              for k in (2, 3, 4, 6, 8, 10, 16)],
        "clamped to the max": [Hypothesis(f"clamped to +-{own.max:g} (the fp8 max) before it is scaled",
                                          BugClass.SATURATION, OperandStage.SOURCE, partial(_clipped, own.max))],
        "raw values clamped": [Hypothesis(f"its raw values clamped to +-{fmt.max:g} ({fmt.name}'s max) before they "
                                          f"are scaled, the scale from the unclamped amax", BugClass.SATURATION,
                                          OperandStage.SCALED, partial(_raw_clamped, fmt.max))
                               for fmt in (FP8_FORMATS[name] for name in ("e4m3", "e5m2", "e4m3fnuz"))],
        "ranges": _ranges(op.fp8),
    }


def _ranges(fp8: str) -> list[Hypothesis]:
    """Scales aimed at another format's max, clamps at another bound, a cast that does not saturate."""
    e4m3, e5m2, fnuz = FP8_FORMATS["e4m3"].max, FP8_FORMATS["e5m2"].max, FP8_FORMATS["e4m3fnuz"].max
    if fp8 == "e4m3":
        return [
            Hypothesis(f"scaled to e5m2's max ({e5m2:g}) and saturated at e4m3's {e4m3:g}", BugClass.SATURATION,
                       OperandStage.SCALE, partial(_aimed_at, e5m2)),
            Hypothesis(f"scaled to e5m2's max ({e5m2:g}) and cast without saturating: beyond {e4m3:g} it is NaN",
                       BugClass.SATURATION, OperandStage.SATURATION, _not_saturating,
                       also=((OperandStage.SCALE, partial(_aimed_at, e5m2)),)),
            Hypothesis(f"clamped at {fnuz:g} (e4m3fnuz's max) instead of {e4m3:g}", BugClass.SATURATION,
                       OperandStage.SATURATION, partial(_clamped_at, fnuz)),
            Hypothesis(f"scaled to {fnuz:g} (e4m3fnuz's max) instead of {e4m3:g}", BugClass.SCALE, OperandStage.SCALE,
                       partial(_aimed_at, fnuz)),
        ]
    return [
        Hypothesis(f"clamped at e4m3's {e4m3:g} instead of e5m2's {e5m2:g}", BugClass.SATURATION,
                   OperandStage.SATURATION,
                   partial(_clamped_at, e4m3)),
        Hypothesis(f"scaled to e4m3's max ({e4m3:g}) instead of e5m2's", BugClass.SATURATION, OperandStage.SCALE,
                   partial(_aimed_at, e4m3)),
    ]


def _bytes(op: _Operand) -> dict[str, list[Hypothesis]]:
    """The recipe's fp8 bytes, rearranged after the cast (the scales stay where the recipe puts them):
    an fp8 copy kept in the other orientation and recovered with view/reshape instead of .t()."""
    if op.rows == op.inner:
        return {"bytes": [Hypothesis("its fp8 bytes transposed after the cast (the scales are not)",
                                     BugClass.TRANSPOSE, OperandStage.BYTES, _bytes_transposed)]}
    return {"bytes": [
        Hypothesis("its fp8 bytes, kept transposed, recovered with view/reshape instead of .t() (the scales are the "
                   "recipe's)", BugClass.TRANSPOSE, OperandStage.BYTES, _bytes_from_transposed_copy),
        Hypothesis("its fp8 bytes reinterpreted with view/reshape into the transposed shape (the scales are the "
                   "recipe's)", BugClass.TRANSPOSE, OperandStage.BYTES, _bytes_reshaped)]}


FAMILIES = (_formats, _precision, _amax, _scale, _tiles, _sources, _grids, _saturation, _bytes)
# The order the space is tried in, by (family, part): where two hypotheses give the same operand, the
# first one names it. ROCm's formats come late: in their normal range their grid is the OCP formats'
# (e4m3fnuz scaled to 240 is e4m3 scaled to 240 but for the lowest binade), so where nothing falls that
# low the simpler "scaled to 240" wins the tie; a recorded call shows the dtype itself. The GPU's double
# rounding comes last, after every single mistake, which wins a tie (a scale beyond fp16's max makes NaN
# on all-zero groups exactly as a missing amax floor does).
ORDER = (
    (_formats, "another format"), (_formats, "high precision"), (_amax, "without abs"),
    (_precision, "rounded first"), (_precision, "product"), (_precision, "values"), (_amax, "rounded copy"),
    (_formats, "converted"), (_scale, "bf16"), (_scale, "reciprocal"), (_scale, "not inverted"), (_scale, "pow2"),
    (_scale, "no floor"), (_scale, "floors"), (_tiles, "regions"), (_amax, "first group"),
    (_sources, "values moved"), (_sources, "delayed scaling"), (_grids, "grids"), (_saturation, "clipped at an RMS"),
    (_sources, "memory misread"), (_saturation, "clamped to the max"), (_saturation, "raw values clamped"),
    (_bytes, "bytes"), (_saturation, "ranges"), (_formats, "ROCm"), (_precision, "product on the GPU"),
)


def hypothesis_families(cast: Cast, recipe: Recipe, rows: int, inner: int) -> dict[tuple, list[Hypothesis]]:
    """Every family's hypotheses for an operand, by (family, part)."""
    op = _Operand(cast, recipe, rows, inner)
    return {(family, part): hypotheses for family in FAMILIES for part, hypotheses in family(op).items()}


def operand_hypotheses(cast: Cast, recipe: Recipe, rows: int, inner: int) -> list[Hypothesis]:
    """Every mistake tried on an operand cast with `cast` under `recipe`, laid out [rows, inner], in ORDER
    (a microscaled cast: parity.mx_mistakes' space, which builds on this module: imported here)."""
    if cast.scaling.microscaled:
        from parity.mx_mistakes import mx_hypotheses
        return mx_hypotheses(cast, recipe, rows, inner)
    families = hypothesis_families(cast, recipe, rows, inner)
    return [hypothesis for key in ORDER for hypothesis in families[key]]
