"""Recipes as data: what an FP8 implementation's numerics are, described once, read everywhere.

A recipe says, for each of the three GEMMs of a linear layer (output = input @ weight.T,
grad_input = grad_output @ weight, grad_weight = grad_output.T @ input), how each operand is
cast: its fp8 format and the granularity of its scales (one per tensor, one per row along the
GEMM's inner dim, one per 1x128 tile, one per 128x128 block, or none: high precision), how
scales are rounded, and whether the GEMM accumulates fast. From that description:

    the exact oracle         parity.oracles emulates the recipe's quantization and GEMMs
    the expected SQNR        a quantization-noise model per operand format (expected_sqnr_db)
    the _scaled_mm rules     parity.contract checks each recorded call against its kind
    case alignment           which M, K, N a case needs (blockwise: multiples of 128)
    the policy               parity.policy decides bitwise / accumulation / sqnr / paired
    bench's traffic model    the fewest bytes the quantization glue must move (glue_bytes)

Nothing outside this module compares a recipe's name: modules ask a Recipe its properties.
The built-ins follow torchao 0.18 (tensorwise, rowwise, rowwise_with_gw_hp; torchao/float8/
config.py) and DeepSeek-V3 (blockwise: 1x128 activation and gradient tiles, 128x128 weight
blocks; torchao.prototype.blockwise_fp8_training); `bf16` and `fp64` describe nn.Linear run in
that precision, the references the FP8 recipes are measured against.
"""

from __future__ import annotations

import difflib
import enum
import math
from dataclasses import dataclass, field

import torch

from parity.names import FP8_RECIPES  # noqa: F401 - re-exported (see below RECIPES)

GEMMS = ("output", "grad_input", "grad_weight")
# (A, B) of each GEMM, and the dimension it sums over
OPERANDS = {"output": ("input", "weight"), "grad_input": ("grad_output", "weight"),
            "grad_weight": ("grad_output", "input")}
INNER_DIM = {"output": "K", "grad_input": "N", "grad_weight": "M"}
BLOCK = 128  # the side of DeepSeek-V3's scale tiles and blocks (1x128, 128x128)
MX_BLOCK, NVFP4_BLOCK = 32, 16  # the blocks of MXFP8 and NVFP4 (parity.mx)


@dataclass(frozen=True)
class Fp8Format:
    """An fp8 format's numbers: the largest magnitude a cast saturates at and the spacing of its grid."""

    name: str  # as recipes and messages name it ("e4m3" is torch's float8_e4m3fn)
    dtype: torch.dtype
    max: float  # the largest finite magnitude
    mantissa_bits: int
    min_exponent: int  # exponent of the smallest normal number (subnormals share its quantum)


# The one table of fp8 formats in parity/ (parity.oracles reads it by name and by dtype). fp8_impl/ keeps
# its own constants on purpose: the oracle checks fp8_impl independently, so fp8_impl must not import parity.
# Recipes cast to the OCP formats; ROCm's fnuz formats are among bisect's hypotheses (parity.mistakes).
# NVFP4's elements are FP4 E2M1 (0.5 to 6, one mantissa bit), stored two per byte (torch.float4_e2m1fn_x2).
FP8_FORMATS = {fmt.name: fmt for fmt in (
    Fp8Format("e4m3", torch.float8_e4m3fn, 448.0, 3, -6),
    Fp8Format("e5m2", torch.float8_e5m2, 57344.0, 2, -14),
    Fp8Format("e4m3fnuz", torch.float8_e4m3fnuz, 240.0, 3, -7),
    Fp8Format("e5m2fnuz", torch.float8_e5m2fnuz, 57344.0, 2, -15),
    Fp8Format("e2m1", torch.float4_e2m1fn_x2, 6.0, 1, 0),
)}
FP8_DTYPES = {name: FP8_FORMATS[name].dtype for name in ("e4m3", "e5m2", "e2m1")}  # the formats a recipe casts to


class Scaling(str, enum.Enum):
    """How many elements share a scale. Axis and block scales run along the GEMM's inner dim."""

    TENSORWISE = "tensorwise"  # one scale for the operand
    AXISWISE = "axiswise"  # one per row of A / per column of B (amax over the inner dim)
    BLOCK_1X128 = "1x128"  # one per row of A (column of B) per 128 elements of the inner dim
    BLOCK_128X128 = "128x128"  # one per 128x128 block
    MX_1X32 = "1x32"  # MXFP8: one power-of-two E8M0 scale per 32 elements of the inner dim (parity.mx)
    NV_1X16 = "1x16"  # NVFP4: one E4M3 scale per 16 elements of the inner dim, times one float32 per tensor
    NONE = "none"  # not quantized: the GEMM runs in high precision

    def tile(self, rows: int, inner: int) -> tuple[int, int]:
        """Elements sharing one scale, as (rows, inner) of the operand laid out [rows, inner]."""
        return {Scaling.TENSORWISE: (rows, inner), Scaling.AXISWISE: (1, inner), Scaling.BLOCK_1X128: (1, BLOCK),
                Scaling.BLOCK_128X128: (BLOCK, BLOCK), Scaling.MX_1X32: (1, MX_BLOCK),
                Scaling.NV_1X16: (1, NVFP4_BLOCK), Scaling.NONE: (rows, inner)}[self]

    @property
    def microscaled(self) -> bool:
        """A block-scaled format of Blackwell's GEMMs (MXFP8, NVFP4): scales of 32 or 16 elements (parity.mx)."""
        return self in (Scaling.MX_1X32, Scaling.NV_1X16)


@dataclass(frozen=True)
class Cast:
    """How one operand of one GEMM is cast."""

    scaling: Scaling
    fp8: str | None = "e4m3"  # "e4m3" | "e5m2" | None (high precision)

    def __post_init__(self):
        object.__setattr__(self, "scaling", Scaling(self.scaling))
        if (self.scaling is Scaling.NONE) != (self.fp8 is None):
            raise ValueError(f"Cast: scaling {self.scaling.value} goes with fp8 "
                             f"{'None' if self.scaling is Scaling.NONE else 'e4m3 or e5m2'}, got {self.fp8!r}")
        if self.fp8 is not None and self.fp8 not in FP8_DTYPES:
            raise ValueError(f"Cast: fp8 format {self.fp8!r} is not one of {list(FP8_DTYPES)}")

    @property
    def dtype(self) -> torch.dtype | None:
        return None if self.fp8 is None else FP8_DTYPES[self.fp8]

    def short_str(self) -> str:
        return "hp" if self.fp8 is None else f"{self.scaling.value} {self.fp8}"


@dataclass(frozen=True)
class Gemm:
    name: str  # output | grad_input | grad_weight
    a: Cast
    b: Cast
    fast_accum: bool = False

    def __post_init__(self):
        if self.name not in GEMMS:
            raise ValueError(f"Gemm: name {self.name!r} is not one of {GEMMS}")
        if (self.a.fp8 is None) != (self.b.fp8 is None):
            raise ValueError(f"Gemm {self.name}: both operands are fp8, or both high precision")

    @property
    def high_precision(self) -> bool:
        return self.a.fp8 is None

    @property
    def kind(self) -> str:
        """The scaled GEMM this is, named as torch.nn.functional.ScalingType: TensorWise, RowWise
        (axis scales; a tensorwise partner is broadcast to a row), BlockWise (1x128 / 128x128), or
        none (a plain high-precision matmul)."""
        kinds = {self.a.scaling, self.b.scaling}
        if Scaling.NONE in kinds:
            return "none"
        if kinds == {Scaling.MX_1X32}:
            return "BlockWise1x32"
        if kinds == {Scaling.NV_1X16}:
            return "BlockWise1x16"
        if kinds & {Scaling.BLOCK_1X128, Scaling.BLOCK_128X128}:
            return "BlockWise"
        return "RowWise" if Scaling.AXISWISE in kinds else "TensorWise"

    @property
    def operands(self) -> tuple[str, str]:
        return OPERANDS[self.name]

    def short_str(self) -> str:
        return f"{self.name}: {self.a.short_str()} x {self.b.short_str()}{', fast accum' if self.fast_accum else ''}"


# Relative noise power that casting one operand adds to a GEMM result, for data without
# structure (Gaussian): calibrated on medians measured on CPU and H200 (tensorwise e4m3 x e4m3
# 28.5 dB -> 31.5 dB per e4m3 operand; e4m3 x e5m2 24.6 dB -> 25.6 dB per e5m2 operand). Finer
# scales (rows, tiles) keep the relative precision of a format and change only what outliers do:
# measured rowwise 28.5 and blockwise 28.6 dB on the H200. The result's rounding to bf16 adds
# the 50.8 dB measured for bf16 nn.Linear against fp64.
# Microscaled casts (medians of the exact emulation over 40 Gaussian bf16 cases from 32 to 224, CPU,
# 2026-12-07): MXFP8 with RCEIL 28.5 dB per GEMM, as tensorwise e4m3 (31.5 per operand); with FLOOR
# 27.65 dB (30.7 per operand: amax mantissas above 1.75 saturate); NVFP4 17.4 dB (20.4 per e2m1 operand).
OPERAND_NOISE = {"e4m3": 10 ** (-31.5 / 10), "e5m2": 10 ** (-25.6 / 10), "e4m3 floor": 10 ** (-30.7 / 10),
                 "e2m1": 10 ** (-20.4 / 10), None: 0.0}
OUTPUT_ROUNDING_NOISE = 10 ** (-50.8 / 10)
# grad_bias is a high-precision sum of grad_output in every recipe: no FP8 cast touches it, so the
# noise model above has nothing to predict, and its expected SQNR is a fixed, conservative value
# instead (the sum is rounded to the output dtype only: medians of 53 to 57 dB in the CPU quick
# sweep); its floor lies SQNR_MARGIN_DB below it, as every tensor's does (parity.policy.sqnr_floor)
GRAD_BIAS_SQNR_DB = 40.0
GRAD_BIAS_WHY = ("grad_bias is a high-precision sum of grad_output in every recipe (no FP8 cast), so the "
                 "quantization-noise model does not apply: its expected SQNR is a fixed, conservative "
                 "value (parity.recipes.GRAD_BIAS_SQNR_DB) that a correct sum clears by far")


@dataclass(frozen=True)
class Recipe:
    name: str
    summary: str
    gemms: tuple[Gemm, Gemm, Gemm]
    pow2_scales: bool = False  # scales rounded down to a power of two
    # scales computed as fp8_max * (1 / amax) in float32, two roundings (what torch does with
    # `448.0 / amax` on a float32 tensor), instead of the quotient rounded once (torchao: amax in
    # float64). No built-in recipe does this; bisect adopts it when an implementation does, so that
    # a mistake beside this one-ulp rounding difference is still named (parity.bisect)
    reciprocal_scales: bool = False
    # axis- and block-scaled GEMMs write bf16 and cast to fp16/fp32 (torchao 0.18, on every device:
    # torch's CUTLASS rowwise kernel, used below cuBLAS 12.9, writes bf16 only; torchao's blockwise
    # layer is bf16-only)
    scaled_out_bf16: bool = False
    # torchao: an axis-scaled GEMM without fast accumulation runs the tensorwise kernel with unit
    # scales and multiplies the (power-of-two) scales in afterwards: the call's scales are ones
    unit_scales_without_fast_accum: bool = False
    high_precision: torch.dtype | None = None  # bf16/fp64 references: nn.Linear in this dtype
    # how a 1x32 (MXFP8) cast picks its power-of-two E8M0 scale: "rceil" (cuBLAS's cast) or "floor" (OCP MX
    # v1.0), the values of parity.mx.ScaleRule; None for the other recipes
    mx_rule: str | None = None
    # the implementation a candidate of this recipe keeps bitwise parity with, per device type
    parity_reference: dict = field(default_factory=dict)

    def __post_init__(self):
        if tuple(g.name for g in self.gemms) != GEMMS:
            raise ValueError(f"Recipe {self.name}: gemms must be {GEMMS} in that order")

    def __hash__(self) -> int:
        return hash(self.name)

    def gemm(self, name: str) -> Gemm:
        return self.gemms[GEMMS.index(name)]

    @property
    def is_fp8(self) -> bool:
        return self.high_precision is None

    @property
    def microscaled(self) -> bool:
        """A block-scaled recipe of Blackwell's GEMMs (MXFP8, NVFP4: parity.mx)."""
        return any(cast.scaling.microscaled for gemm in self.gemms for cast in (gemm.a, gemm.b))

    @property
    def nan_stays_in_its_block(self) -> bool:
        """Whether a NaN in an operand must come out NaN in its own block only: MXFP8's rule (OCP MX: the block's
        scale is NaN). Not NVFP4's: its per-tensor scale comes from the tensor's amax, and NVIDIA's description
        says nothing of a NaN there (the oracle's NaN amax spreads it; an amax that skips it keeps it local)."""
        return self.microscaled and not any(cast.scaling is Scaling.NV_1X16 for gemm in self.gemms
                                            for cast in (gemm.a, gemm.b))

    @property
    def alignment(self) -> int:
        """M, K and N must be multiples of this: 16 (cuBLASLt's FP8 GEMMs), 128 with block scales,
        1 for a high-precision reference."""
        if not self.is_fp8:
            return 1
        blocks = any(g.kind == "BlockWise" for g in self.gemms)
        # MXFP8 and NVFP4 (MX-SPEC.md): dims in whole blocks of 32; NVFP4's blocks are 16 long, but torch's
        # _scaled_mm_v2 needs the packed inner dim (K / 2 bytes of fp4) divisible by 16 too: K a multiple of 32
        return BLOCK if blocks else MX_BLOCK if self.microscaled else 16

    def unsupported(self, M: int, K: int, N: int) -> str | None:
        """Why a case of these dims cannot run under this recipe, or None."""
        bad = [f"{name} = {value}" for name, value in (("M", M), ("K", K), ("N", N)) if value % self.alignment]
        return (f"{', '.join(bad)} not a multiple of {self.alignment}, which the {self.name} recipe needs"
                if bad else None)

    def casts_of(self, operand: str) -> list[tuple[Gemm, Cast]]:
        """Every (GEMM, cast) in which `operand` (input, weight, grad_output) takes part."""
        return [(g, c) for g in self.gemms for role, c in zip(g.operands, (g.a, g.b)) if role == operand]

    def expected_sqnr_db(self, tensor: str) -> float:
        """Predicted SQNR (dB) of a tensor against float64 on unstructured data: the noise powers of
        the two casts of its GEMM plus the result's rounding (see OPERAND_NOISE)."""
        if tensor == "grad_bias":
            return GRAD_BIAS_SQNR_DB
        gemm = self.gemm(tensor)
        floor = " floor" if self.mx_rule == "floor" else ""
        noise = sum(OPERAND_NOISE[cast.fp8 and cast.fp8 + floor] for cast in (gemm.a, gemm.b)) + OUTPUT_ROUNDING_NOISE
        return round(-10 * math.log10(noise), 1)

    def glue_bytes(self, M: int, K: int, N: int, *, hp_bytes: int = 2) -> int:
        """The fewest bytes the quantization glue must move per fwd+bwd: an operand cast in any GEMM
        is read twice (amax, then the cast, which writes every fp8 layout the GEMMs need from that
        one read), and each GEMM that takes it in fp8 gets its own 1-byte copy (row-major as A,
        column-major as B; axis and tile scales along a different dim also differ in value)."""
        sizes = {"input": M * K, "weight": N * K, "grad_output": M * N}
        total = 0
        for operand, size in sizes.items():
            fp8_uses = sum(1 for _, cast in self.casts_of(operand) if cast.fp8 is not None)
            total += (2 * hp_bytes + fp8_uses) * size if fp8_uses else 0
        return total

    def flops(self, M: int, K: int, N: int) -> tuple[int, int]:
        """(flops of the fp8 GEMMs, flops of the high-precision GEMMs) of one fwd+bwd."""
        fp8 = sum(2 * M * K * N for g in self.gemms if not g.high_precision and self.is_fp8)
        return fp8, 6 * M * K * N - fp8

    def short_str(self) -> str:
        extras = [*(["pow2 scales"] if self.pow2_scales else []),
                  *([f"{self.mx_rule} e8m0 scales"] if self.mx_rule else []),
                  *(["scales via a float32 reciprocal"] if self.reciprocal_scales else []), f"dims % {self.alignment}"]
        return f"{self.name} ({'; '.join(g.short_str() for g in self.gemms)}; {', '.join(extras)})"


def _gemms(output, grad_input, grad_weight) -> tuple[Gemm, Gemm, Gemm]:
    return (Gemm("output", *output[:2], fast_accum=output[2]), Gemm("grad_input", *grad_input[:2]),
            Gemm("grad_weight", *grad_weight[:2]))


_T4, _T5 = Cast(Scaling.TENSORWISE, "e4m3"), Cast(Scaling.TENSORWISE, "e5m2")
_A4 = Cast(Scaling.AXISWISE, "e4m3")
_B1, _B128 = Cast(Scaling.BLOCK_1X128, "e4m3"), Cast(Scaling.BLOCK_128X128, "e4m3")
_HP = Cast(Scaling.NONE, None)
_MX, _NV = Cast(Scaling.MX_1X32, "e4m3"), Cast(Scaling.NV_1X16, "e2m1")
# MXFP8 and NVFP4 as /work/wt/MX-SPEC.md fixes them (written from OCP MX v1.0 and NVIDIA's NVFP4
# description, parity.mx): every operand of every GEMM blocked along that GEMM's inner dim (so input,
# weight and grad_output are each cast twice, once per axis), no fast accumulation (cuBLAS ignores the
# flag for block-scaled GEMMs), the results written in the output dtype. Their real GEMMs need SM100; the
# exact emulation is the reference everywhere (torchao's MX layer is judged against it, not beside it)
_MX_REFERENCE = {"cpu": "emulated:{}", "cuda": "emulated:{}"}

RECIPES: dict[str, Recipe] = {r.name: r for r in (
    Recipe("tensorwise", "one scale per tensor; e4m3 input and weight, e5m2 grad_output (torchao's default)",
           _gemms((_T4, _T4, True), (_T5, _T4), (_T5, _T4)),
           parity_reference={"cpu": "torchao:tensorwise", "cuda": "torchao:tensorwise"}),
    Recipe("rowwise", "one power-of-two scale per row along each GEMM's inner dim; e4m3 everywhere (torchao)",
           _gemms((_A4, _A4, True), (_A4, _A4), (_A4, _A4)), pow2_scales=True, scaled_out_bf16=True,
           unit_scales_without_fast_accum=True,
           parity_reference={"cpu": "torchao:rowwise", "cuda": "torchao:rowwise"}),
    Recipe("rowwise_with_gw_hp", "rowwise output; grad_input against a tensorwise weight; grad_weight in high "
           "precision (torchao)", _gemms((_A4, _A4, True), (_A4, _T4), (_HP, _HP)), pow2_scales=True,
           scaled_out_bf16=True, unit_scales_without_fast_accum=True,
           parity_reference={"cpu": "torchao:rowwise_with_gw_hp", "cuda": "torchao:rowwise_with_gw_hp"}),
    Recipe("blockwise", "DeepSeek-V3: 1x128 tiles for activations and gradients, 128x128 blocks for weights, "
           "e4m3 everywhere", _gemms((_B1, _B128, False), (_B1, _B128), (_B1, _B1)), scaled_out_bf16=True,
           # torchao's blockwise training JIT-compiles and autotunes Triton kernels for every new shape
           # (minutes for a check's hundred shapes), so checks compare with the exact emulation; its
           # bitwise parity with fp8_impl on the H200 is a GPU test (test_fp8_impl.py)
           parity_reference={"cpu": "emulated:blockwise", "cuda": "emulated:blockwise"}),
    Recipe("mxfp8", "MXFP8 (OCP MX): 32-element blocks along each GEMM's inner dim, e4m3 elements, power-of-two "
           "E8M0 scales rounded up (RCEIL, cuBLAS's cast)", _gemms((_MX, _MX, False), (_MX, _MX), (_MX, _MX)),
           mx_rule="rceil", parity_reference={k: v.format("mxfp8") for k, v in _MX_REFERENCE.items()}),
    Recipe("mxfp8_floor", "MXFP8 with OCP MX v1.0's FLOOR scale rule (floor(log2 amax) - 8; the largest elements "
           "may saturate)", _gemms((_MX, _MX, False), (_MX, _MX), (_MX, _MX)), mx_rule="floor",
           parity_reference={k: v.format("mxfp8_floor") for k, v in _MX_REFERENCE.items()}),
    Recipe("nvfp4", "NVFP4: 16-element blocks along each GEMM's inner dim, e2m1 elements, an E4M3 scale per block "
           "times a float32 scale per tensor (no stochastic rounding, no Hadamard transform)",
           _gemms((_NV, _NV, False), (_NV, _NV), (_NV, _NV)),
           parity_reference={k: v.format("nvfp4") for k, v in _MX_REFERENCE.items()}),
    Recipe("bf16", "nn.Linear in bfloat16", _gemms((_HP, _HP, False), (_HP, _HP), (_HP, _HP)),
           high_precision=torch.bfloat16),
    Recipe("fp64", "nn.Linear in float64", _gemms((_HP, _HP, False), (_HP, _HP), (_HP, _HP)),
           high_precision=torch.float64),
)}
# FP8_RECIPES, the names of those whose is_fp8 holds, comes from parity.names: the parser lists them without
# importing torch (property_tests/test_names.py checks the two agree)
DEFAULT_RECIPE = RECIPES["tensorwise"]  # what code claims when it says nothing: torchao's default, fp8_impl's


class RecipeError(ValueError):
    """An unknown recipe name; the message lists the known ones and the closest match."""


def get_recipe(name: str | Recipe) -> Recipe:
    """The recipe named `name`, or RecipeError with a "did you mean"."""
    if isinstance(name, Recipe):
        return name
    recipe = RECIPES.get(str(name).strip())
    if recipe is None:
        close = difflib.get_close_matches(str(name), list(RECIPES), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise RecipeError(f"unknown recipe {name!r}{hint or ';'} known recipes: {', '.join(RECIPES)}")
    return recipe
