"""The space of mistakes bisect tries: every way one operand's cast can go wrong, and where its values come from.

parity.diagnose compares what a GEMM was handed (a recorded call) or what it computed (its result)
with what each hypothesis here says the GEMM would get: one mistake in the cast of one operand
(another fp8 format; amax without abs, over another region or without its floor; a scale rounded,
not inverted, not rounded to a power of two or aimed at another max; a clamp at another bound), or
the operand's values taken from elsewhere (transposed, reshaped, read with the wrong strides, the
previous call's). The recipe's correct quantization is parity.oracles'; a hypothesis is data: a
name (its description), a bug class and what it changes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from parity import oracles
from parity.cases import Case, Layout
from parity.data import StepData, materialize
from parity.oracles import Quantized
from parity.recipes import BLOCK, FP8_DTYPES, Cast, Recipe, Scaling

FP8_MAX_OF = {"e4m3": 448.0, "e5m2": 57344.0}


# ---- the space of mistakes ------------------------------------------------------------------------

@dataclass(frozen=True)
class Hypothesis:
    """One mistake in casting one operand: quantize() overrides and where the values come from."""

    category: str
    description: str
    options: dict = field(default_factory=dict)
    source: str = "same"  # same, or one of MOVED's (where the operand's values come from)
    amax_source: str = "same"  # where its amax comes from: same (its values'), or previous (delayed scaling)

    @property
    def keeps_high_precision(self) -> bool:
        """The operand is not cast to fp8 at all (a recorded call shows that by its dtype)."""
        return "cast" in self.options and self.options["cast"].fp8 is None


def _regions(rows: int, inner: int) -> list[tuple[str, tuple[int, int]]]:
    regions = [("the whole operand", (rows, inner)), ("each row along the inner dim", (1, inner)),
               ("each column (across the inner dim)", (rows, 1))]
    if inner % BLOCK == 0:
        regions.append(("each 1x128 tile", (1, BLOCK)))
    if rows % BLOCK == 0:
        regions.append(("each 128x1 tile (across the inner dim)", (BLOCK, 1)))
    if rows % BLOCK == 0 and inner % BLOCK == 0:
        regions.append(("each 128x128 block", (BLOCK, BLOCK)))
    return regions


# Where an operand's values come from, whatever its cast: the same mistakes for fp8 and high-precision operands
MOVED = {source: Hypothesis(category, description, source=source) for source, category, description in (
    ("transposed", "transpose", "the operand transposed (read the other way round)"),
    ("reshaped", "transpose", "the operand reinterpreted with reshape instead of a transpose"),
    ("reshaped_from_transpose", "transpose", "the operand made from its transpose with reshape instead of .t()"),
    ("previous", "stale_state", "the operand of the previous call (a stale cache)"),
    ("strides_ignored", "layout", "the operand read as if contiguous from non-contiguous memory"),
    ("leading_swapped", "transpose", "its tokens flattened from the leading dims in the wrong order (dims swapped "
                                     "before the reshape)"))}
NARROWER = (("bfloat16", torch.bfloat16), ("float16", torch.float16))


def high_precision_hypotheses() -> list[Hypothesis]:
    """Every mistake tried on an operand a GEMM takes in high precision (no fp8 cast)."""
    return [*(Hypothesis("precision", f"the operand rounded to {name} before the GEMM", {"source_dtype": dtype})
              for name, dtype in NARROWER), *MOVED.values()]


# A rounding of the scale rather than a structural mistake: one ulp off torchao's scale in some groups.
# parity.bisect, finding it, diagnoses again under a recipe that rounds its scales this way
# (Recipe.reciprocal_scales), so that a mistake beside it is named too.
RECIPROCAL_SCALES = ("its scale computed as fp8_max * (1 / amax) in float32 (a Python number divided by a float32 "
                     "tensor: two roundings, one ulp off the exact scale in about a quarter of the groups; compute "
                     "it in float64 and round once, as torchao does)")
EXACT_SCALES = "its scale the exact quotient fp8_max / amax rounded once, where its other scales take two roundings"


def operand_hypotheses(cast: Cast, recipe: Recipe, rows: int, inner: int) -> list[Hypothesis]:
    """Every mistake tried on an operand cast with `cast` under `recipe`, laid out [rows, inner]."""
    other = "e5m2" if cast.fp8 == "e4m3" else "e4m3"
    own_tile = cast.scaling.tile(rows, inner)
    hypotheses = [
        Hypothesis("fp8_dtype", f"cast to {other} instead of {cast.fp8}", {"cast": Cast(cast.scaling, other)}),

        Hypothesis("precision", f"the operand used in high precision where the recipe casts it to {cast.fp8}",
                   {"cast": Cast(Scaling.NONE, None)}),
        Hypothesis("scale", "amax = max(x) instead of max(|x|)", {"absolute_amax": False}),
        *(Hypothesis("precision", f"the operand rounded to {name} before its cast", {"source_dtype": dtype})
          for name, dtype in NARROWER),
        *(Hypothesis("precision", f"the operand multiplied by its scale in {name} (a {name} tensor times a 0-dim "
                                  f"float32 scale stays {name}): rounded twice, to {name} and then to {cast.fp8}",
                     {"scaled_dtype": dtype}) for name, dtype in NARROWER),
        *(Hypothesis("precision", f"the operand rounded to {name} after its amax and before its scaling (the "
                                  f"scale from the unrounded values)", {"values_dtype": dtype})
          for name, dtype in NARROWER),
        *(Hypothesis("scale", f"its amax taken from a copy rounded to {name}", {"amax_dtype": dtype})
          for name, dtype in NARROWER),
        Hypothesis("fp8_dtype", f"its {cast.fp8} values converted to {other} (the scale still {cast.fp8}'s)",
                   {"converted_to": FP8_DTYPES[other]}),
        Hypothesis("scale", "its scale rounded to bfloat16", {"scale_dtype": torch.bfloat16}),
        Hypothesis("scale", EXACT_SCALES if recipe.reciprocal_scales else RECIPROCAL_SCALES,
                   {"via_reciprocal": not recipe.reciprocal_scales}),
        Hypothesis("scale", "the GEMM handed its scale instead of the inverse", {"inverse_scale": False}),
        Hypothesis("scale", "scales not rounded down to a power of two" if recipe.pow2_scales else
                   "scales rounded down to a power of two", {"pow2": not recipe.pow2_scales}),
        Hypothesis("scale", "no floor under amax: an all-zero group gets an infinite scale", {"eps": 0.0}),
        *(Hypothesis("scale", f"a floor of {eps:g} under amax instead of {oracles.EPS:g}", {"eps": eps})
          for eps in (1e-4, 1e-6, 1e-8, 1e-10)),
        *(Hypothesis("scale", f"amax over {region} instead of {_region_name(own_tile, rows, inner)}",
                     {"tile": tile}) for region, tile in _regions(rows, inner) if tile != own_tile),
        *([Hypothesis("scale", "every group scaled by the first group's amax (a scale indexed [0] and broadcast)",
                      {"first_amax": True})] if own_tile != (rows, inner) else []),
        MOVED["transposed"], MOVED["reshaped"], MOVED["reshaped_from_transpose"], MOVED["previous"],
        Hypothesis("stale_state", "its scale from the previous call's amax, applied to this call's values (delayed "
                                  "scaling: a scale computed in one call and kept for the next)",
                   amax_source="previous"),
        *(Hypothesis(category, description, {"grid": grid}) for category, grid, description in (
            ("transpose", "transposed", "its grid of scales transposed"),
            ("transpose", "reshaped", "its grid of scales reinterpreted with reshape instead of transposed"),
            ("scale", "first", "the GEMM handed the first group's inverse scale for every group (the values "
                               "quantized with their own)"),
            ("scale", "padding_first", "its scales read from a grid padded to 4 along the inner dim with the "
                                       "padding first: padding bytes consumed as scales"),
            ("scale", "padded_row_major", "its scales written row-major into a grid padded to 4 along the inner "
                                          "dim that the GEMM reads inner-dim-major: padding and misplaced scales "
                                          "consumed"))),
        *(Hypothesis("saturation", f"clipped at {k} times its RMS before the cast", {"clip_rms": float(k)})
          for k in (2, 3, 4, 6, 8, 10, 16)),
        MOVED["strides_ignored"], MOVED["leading_swapped"],
    ]
    hypotheses.append(Hypothesis("saturation", f"clamped to +-{FP8_MAX_OF[cast.fp8]:g} (the fp8 max) before it is "
                                               f"scaled", {"clip_abs": FP8_MAX_OF[cast.fp8]}))
    hypotheses += [Hypothesis("saturation", f"its raw values clamped to +-{bound:g} ({name}) before they are "
                                            f"scaled, the scale from the unclamped amax", {"value_clamp": bound})
                   for name, bound in (("e4m3's max", 448.0), ("e5m2's max", 57344.0), ("e4m3fnuz's max", 240.0))]
    # the recipe's fp8 bytes, rearranged after the cast (the scales stay where the recipe puts them):
    # an fp8 copy kept in the other orientation and recovered with view/reshape instead of .t()
    if rows == inner:
        hypotheses.append(Hypothesis("transpose", "its fp8 bytes transposed after the cast (the scales are not)",
                                     {"bytes": "transposed"}))
    else:
        hypotheses += [
            Hypothesis("transpose", "its fp8 bytes, kept transposed, recovered with view/reshape instead of .t() "
                                    "(the scales are the recipe's)", {"bytes": "from_transposed_copy"}),
            Hypothesis("transpose", "its fp8 bytes reinterpreted with view/reshape into the transposed shape "
                                    "(the scales are the recipe's)", {"bytes": "reshaped"})]
    if cast.fp8 == "e4m3":
        hypotheses += [
            Hypothesis("saturation", "scaled to e5m2's max (57344) and saturated at e4m3's 448",
                       {"target_max": 57344.0}),
            Hypothesis("saturation", "scaled to e5m2's max (57344) and cast without saturating: beyond 448 it is NaN",
                       {"target_max": 57344.0, "overflow_nan": True}),
            Hypothesis("saturation", "clamped at 240 (e4m3fnuz's max) instead of 448", {"clamp_max": 240.0}),
            Hypothesis("scale", "scaled to 240 (e4m3fnuz's max) instead of 448", {"target_max": 240.0}),
        ]
    else:
        hypotheses += [
            Hypothesis("saturation", "clamped at e4m3's 448 instead of e5m2's 57344", {"clamp_max": 448.0}),
            Hypothesis("saturation", "scaled to e4m3's max (448) instead of e5m2's", {"target_max": 448.0}),
        ]
    # ROCm's formats last: in their normal range their grid is the OCP formats' (e4m3fnuz scaled to
    # 240 is e4m3 scaled to 240 but for the lowest binade), so where nothing falls that low the
    # simpler "scaled to 240" hypothesis above wins the tie; a recorded call shows the dtype itself
    hypotheses += [Hypothesis("fp8_dtype", f"cast to {name} (ROCm's format, max {oracles.FORMATS[dtype].max:g}) "
                                           f"instead of {cast.fp8}", {"fp8_format": dtype})
                   for name, dtype in (("e4m3fnuz", torch.float8_e4m3fnuz), ("e5m2fnuz", torch.float8_e5m2fnuz))]
    # On a GPU a 0-dim float32 scale on the device is no CPU scalar: the kernel converts it to the
    # tensor's dtype before multiplying (on the CPU it is read in float32), so the same line of code
    # also rounds the scale there; the GEMM still gets the unrounded scale's inverse. Two roundings in
    # one: after every single mistake, which wins a tie (a scale beyond fp16's max makes NaN on
    # all-zero groups exactly as a missing amax floor does)
    hypotheses += [Hypothesis("precision", f"the operand multiplied by its scale in {name} on the GPU (the 0-dim "
                                           f"scale converted to {name} first, then the product): rounded twice, to "
                                           f"{name} and then to {cast.fp8}", {"scaled_dtype": dtype,
                                                                               "multiplier_dtype": dtype})
                   for name, dtype in NARROWER]
    return hypotheses


def _region_name(tile: tuple[int, int], rows: int, inner: int) -> str:
    return next((name for name, t in _regions(rows, inner) if t == tile), f"{tile[0]}x{tile[1]} tiles")


def quantize_mistaken(source: torch.Tensor, cast: Cast, recipe: Recipe, options: dict) -> Quantized | None:
    options = dict(options)
    grid, rearranged = options.pop("grid", None), options.pop("bytes", None)
    clip, clip_abs = options.pop("clip_rms", None), options.pop("clip_abs", None)
    if options.get("value_clamp") is not None and float(source.abs().max()) <= options["value_clamp"]:
        return None  # nothing clamped: the same as the correct cast
    source_dtype = options.pop("source_dtype", None)
    if source_dtype is not None:
        rounded = source.to(source_dtype).to(source.dtype)
        if torch.equal(rounded, source):
            return None  # already in that precision: the same as the correct cast
        source = rounded
    if clip is not None or clip_abs is not None:
        bound = clip_abs if clip is None else clip * float(source.double().pow(2).mean().sqrt())
        if not bound or float(source.abs().max()) <= bound:
            return None  # nothing clipped: the same as the correct cast
        source = source.clamp(-bound, bound)
    try:
        q = oracles.quantize(source, options.pop("cast", cast), **{**oracles.scale_rounding(recipe), **options})
    except RuntimeError:  # a tile that does not divide this operand
        return None
    if rearranged is not None:
        q = _rearranged_bytes(q, rearranged)
    return q if grid is None else _misread_grid(q, grid)


def _rearranged_bytes(q: Quantized, how: str) -> Quantized:
    """The same scales with the fp8 values [rows, inner] rearranged: transposed (square), read
    from a transposed copy [inner, rows] as if it were [rows, inner], or reshaped into
    [inner, rows] and transposed back."""
    values = q.values
    rows, inner = values.shape
    if how == "transposed":
        values = values.t()
    elif how == "from_transposed_copy":
        values = values.t().contiguous().reshape(rows, inner)
    else:
        values = values.reshape(inner, rows).t()
    return Quantized(values.contiguous(), q.inv_scale, q.tile, q.fp8_dtype)


def _misread_grid(q: Quantized, how: str) -> Quantized | None:
    """The same fp8 values with their grid of inverse scales [rows / r, inner / i] misread."""
    g = q.inv_scale
    rows, cols = g.shape
    if rows * cols == 1 or (how == "transposed" and rows != cols) or (how == "reshaped" and rows == cols):
        return None
    if how == "transposed":
        g = g.t()
    elif how == "first":
        g = g[:1, :1].expand(rows, cols)
    elif how == "reshaped":  # the grid in its transposed (GEMM) layout, reshaped instead of transposed back
        g = g.reshape(cols, rows).t()
    elif how == "padding_first":  # the inner-dim blocks padded to a multiple of 4 with ones in front
        pad = -cols % 4
        if not pad:
            return None
        g = torch.cat([g.new_ones(rows, pad), g], dim=1)[:, :cols]
    else:  # padded_row_major: [inner blocks padded to 4, rows] written row-major, read inner-major
        padded = -(-cols // 4) * 4
        if padded == cols:
            return None
        flat = torch.ones(padded * rows, dtype=g.dtype, device=g.device)
        flat[: rows * cols] = g.t().reshape(-1)  # the [cols, rows] grid, row by row
        g = flat.reshape(rows, padded)[:, :cols]  # read as [padded, rows] stored inner-major
    return Quantized(q.values, g.contiguous(), q.tile, q.fp8_dtype)


# ---- what a GEMM's operands are, from the data -------------------------------------------------

@dataclass
class OperandSources:
    """Where an operand's values can come from: the step's tensors and the alternatives the
    hypotheses need (the previous call's, the case's memory read with contiguous strides)."""

    step: StepData
    previous: StepData | None = None
    strided: StepData | None = None  # each non-contiguous operand read as if contiguous (None: all are)

    def quantized(self, hypothesis: Hypothesis, gemm: str, role: str, cast: Cast, recipe: Recipe,
                  shape: tuple[int, ...]) -> Quantized | None:
        """The operand `hypothesis` says the GEMM got, or None where the hypothesis cannot apply (no
        previous call, another shape, a tile that does not divide it)."""
        source = self.view(gemm, role, hypothesis.source)
        if source is None or tuple(source.shape) != tuple(shape):
            return None
        options = hypothesis.options
        if hypothesis.amax_source != "same":
            amax_of = self.view(gemm, role, hypothesis.amax_source)
            if amax_of is None or tuple(amax_of.shape) != tuple(shape):
                return None
            options = {**options, "amax_of": amax_of}
        return quantize_mistaken(source, cast, recipe, options)

    def view(self, gemm: str, role: str, source: str) -> torch.Tensor | None:
        base = {"same": self.step, "previous": self.previous, "strides_ignored": self.strided,
                "transposed": self.step, "reshaped": self.step, "reshaped_from_transpose": self.step,
                "leading_swapped": self.step}[source]
        if base is None:
            return None
        if source == "leading_swapped":  # N-D input and grad_output flattened with their first two dims swapped
            if base.input.dim() < 3:
                return None
            base = StepData(base.input.transpose(0, 1), base.weight, base.grad_output.transpose(0, 1))
        K, N = base.input.shape[-1], base.weight.shape[0]
        views = oracles.operand_views(base.input.reshape(-1, K), base.weight, base.grad_output.reshape(-1, N))
        operand = views[gemm][0 if role == "a" else 1]
        rows, inner = operand.shape
        if source == "transposed":
            return operand.t() if rows == inner else None
        if source == "reshaped":  # the code holds the operand [rows, inner] and reshapes it where .t() belongs
            return operand.reshape(inner, rows).t() if rows != inner else None
        if source == "reshaped_from_transpose":  # the code holds its transpose [inner, rows] and does the same
            return operand.t().reshape(rows, inner) if rows != inner else None
        return operand


def strides_ignored(step: StepData, case: Case) -> StepData | None:
    """The step's tensors as an implementation that ignores strides reads them from the case's
    memory layouts (as_strided with contiguous strides over the same storage); None when every
    operand is contiguous."""
    layouts = (case.input_layout, case.weight_layout, case.grad_output_layout)
    if all(layout is Layout.CONTIGUOUS for layout in layouts):
        return None

    def read(values: torch.Tensor, layout: Layout) -> torch.Tensor:
        stored = materialize(values, layout)
        strides = [1] * stored.dim()
        for i in range(stored.dim() - 2, -1, -1):
            strides[i] = strides[i + 1] * stored.shape[i + 1]
        return torch.as_strided(stored, stored.shape, strides).clone()
    return StepData(read(step.input, layouts[0]), read(step.weight, layouts[1]), read(step.grad_output, layouts[2]))
