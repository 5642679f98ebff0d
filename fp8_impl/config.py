"""The recipes as configuration: how each operand of each GEMM is cast to FP8, and how each GEMM runs.

A recipe answers three questions per GEMM (output, grad_input, grad_weight): which fp8 format each operand
takes, how many of its elements share a scale (Scaling; none: high precision), and whether the GEMM may
accumulate fast. `Float8LinearConfig.from_recipe_name` builds the recipes of torchao, DeepSeek-V3 and
Blackwell's MXFP8; matmul.py's docstring says why each is what it is.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch


class Float8LinearRecipeName(enum.Enum):
    TENSORWISE = "tensorwise"
    ROWWISE = "rowwise"
    ROWWISE_WITH_GW_HP = "rowwise_with_gw_hp"
    BLOCKWISE = "blockwise"
    MXFP8 = "mxfp8"
    MXFP8_FLOOR = "mxfp8_floor"


class Scaling(enum.Enum):
    """How many scales an operand gets. Axis and block scales run along the GEMM's inner dim."""

    TENSORWISE = "tensorwise"  # one scale for the whole tensor
    AXISWISE = "axiswise"  # one per row of A (and per column of B): amax over the inner dim
    BLOCK_1X128 = "1x128"  # one per row (column of B) per 128 elements of the inner dim
    BLOCK_128X128 = "128x128"  # one per 128x128 block
    MX_1X32 = "1x32"  # MXFP8: a power-of-two (E8M0) scale per 32 elements of the inner dim
    DISABLED = "disabled"  # not cast: this GEMM runs in high precision


# ROCm MI300 (gfx942) uses the "fnuz" FP8 variants (no negative zero, max 240 for e4m3);
# everything else uses the OCP formats. Chosen once, like torchao does.
_IS_MI300 = bool(torch.version.hip and torch.cuda.is_available()
                 and "gfx942" in torch.cuda.get_device_properties(0).gcnArchName)
E4M3 = torch.float8_e4m3fnuz if _IS_MI300 else torch.float8_e4m3fn
E5M2 = torch.float8_e5m2fnuz if _IS_MI300 else torch.float8_e5m2


@dataclass(frozen=True)
class CastConfig:
    scaling: Scaling = Scaling.TENSORWISE
    fp8_dtype: torch.dtype | None = E4M3  # None when scaling is DISABLED

    def __post_init__(self):
        if (self.scaling is Scaling.DISABLED) != (self.fp8_dtype is None):
            raise ValueError(f"CastConfig: scaling {self.scaling.value} goes with fp8_dtype "
                             f"{'None' if self.scaling is Scaling.DISABLED else 'an fp8 dtype'}, got {self.fp8_dtype}")


@dataclass(frozen=True)
class GemmConfig:
    a: CastConfig  # the first operand: input, grad_output, grad_output.T
    b: CastConfig  # the second: weight.T, weight, input
    fast_accum: bool = False

    def __post_init__(self):
        if (self.a.scaling is Scaling.DISABLED) != (self.b.scaling is Scaling.DISABLED):
            raise ValueError("GemmConfig: both operands of a GEMM run in fp8, or both in high precision")
        if not isinstance(self.fast_accum, bool):
            raise TypeError(f"GemmConfig.fast_accum must be a bool, got {self.fast_accum!r}")


_TENSOR, _AXIS, _HIGH = CastConfig(Scaling.TENSORWISE), CastConfig(Scaling.AXISWISE), CastConfig(Scaling.DISABLED, None)
_TILE, _BLOCK = CastConfig(Scaling.BLOCK_1X128), CastConfig(Scaling.BLOCK_128X128)
_MX = GemmConfig(CastConfig(Scaling.MX_1X32), CastConfig(Scaling.MX_1X32))  # every operand along its GEMM's inner dim
_RECIPES = {
    Float8LinearRecipeName.TENSORWISE: dict(
        output=GemmConfig(_TENSOR, _TENSOR, fast_accum=True),
        grad_input=GemmConfig(CastConfig(Scaling.TENSORWISE, E5M2), _TENSOR),
        grad_weight=GemmConfig(CastConfig(Scaling.TENSORWISE, E5M2), _TENSOR)),
    Float8LinearRecipeName.ROWWISE: dict(
        output=GemmConfig(_AXIS, _AXIS, fast_accum=True), grad_input=GemmConfig(_AXIS, _AXIS),
        grad_weight=GemmConfig(_AXIS, _AXIS), round_scales_to_power_of_2=True),
    Float8LinearRecipeName.ROWWISE_WITH_GW_HP: dict(
        output=GemmConfig(_AXIS, _AXIS, fast_accum=True), grad_input=GemmConfig(_AXIS, _TENSOR),
        grad_weight=GemmConfig(_HIGH, _HIGH), round_scales_to_power_of_2=True),
    Float8LinearRecipeName.BLOCKWISE: dict(  # weights in 128x128 blocks; grad_weight's operands in 1x128 tiles
        output=GemmConfig(_TILE, _BLOCK), grad_input=GemmConfig(_TILE, _BLOCK), grad_weight=GemmConfig(_TILE, _TILE)),
    **{name: dict(output=_MX, grad_input=_MX, grad_weight=_MX, mx_rule=rule) for name, rule in (
        (Float8LinearRecipeName.MXFP8, "rceil"), (Float8LinearRecipeName.MXFP8_FLOOR, "floor"))},
}


@dataclass(frozen=True)
class Float8LinearConfig:
    """How the three GEMMs run. Defaults are torchao's tensorwise recipe."""

    recipe: Float8LinearRecipeName = Float8LinearRecipeName.TENSORWISE
    output: GemmConfig = _RECIPES[Float8LinearRecipeName.TENSORWISE]["output"]
    grad_input: GemmConfig = _RECIPES[Float8LinearRecipeName.TENSORWISE]["grad_input"]
    grad_weight: GemmConfig = _RECIPES[Float8LinearRecipeName.TENSORWISE]["grad_weight"]
    round_scales_to_power_of_2: bool = False
    mx_rule: str = "rceil"  # an MXFP8 scale: "rceil" (the smallest 2^e >= amax / 448) or "floor" (OCP MX v1.0)

    def __post_init__(self):
        if not isinstance(self.recipe, Float8LinearRecipeName):
            raise TypeError(f"Float8LinearConfig.recipe must be a Float8LinearRecipeName, got {self.recipe!r}")
        for name in ("output", "grad_input", "grad_weight"):
            if not isinstance(getattr(self, name), GemmConfig):
                raise TypeError(f"Float8LinearConfig.{name} must be a GemmConfig, got {getattr(self, name)!r}")

    @staticmethod
    def from_recipe_name(recipe_name) -> "Float8LinearConfig":
        """The config of a named recipe (a Float8LinearRecipeName or its string value)."""
        names = [r.value for r in Float8LinearRecipeName]
        name = recipe_name.value if isinstance(recipe_name, enum.Enum) else recipe_name
        if name not in names:
            raise ValueError(f"fp8_impl knows the recipes {names}, got {name!r}")
        return Float8LinearConfig(recipe=Float8LinearRecipeName(name), **_RECIPES[Float8LinearRecipeName(name)])

    @property
    def gemms(self) -> tuple[GemmConfig, GemmConfig, GemmConfig]:
        return self.output, self.grad_input, self.grad_weight

    @property
    def alignment(self) -> int:
        """M, K and N must be multiples of this: 16 for cuBLASLt's FP8 GEMMs, 128 for block scales."""
        scalings = {c.scaling for g in self.gemms for c in (g.a, g.b)}
        if Scaling.MX_1X32 in scalings:
            return 32  # whole blocks of 32 along every GEMM's inner dim: M, K and N
        return 128 if scalings & {Scaling.BLOCK_1X128, Scaling.BLOCK_128X128} else 16

    def short_str(self) -> str:
        def cast(c: CastConfig) -> str:
            return "hp" if c.fp8_dtype is None else f"{c.scaling.value}:{'e5m2' if c.fp8_dtype == E5M2 else 'e4m3'}"
        gemms = ", ".join(f"{name}={cast(g.a)} x {cast(g.b)}{' (fast)' if g.fast_accum else ''}"
                          for name, g in zip(("out", "gi", "gw"), self.gemms))
        return f"{self.recipe.value}[{gemms}{'; pow2 scales' if self.round_scales_to_power_of_2 else ''}]"
