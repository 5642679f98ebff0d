"""The module API: Float8Linear (an nn.Linear drop-in), its config, and the model converter.

The signatures follow torchao.float8, so switching between the two is a one-line import
change:

    from fp8_impl import convert_to_float8_training, Float8LinearConfig
    # from torchao.float8 import convert_to_float8_training, Float8LinearConfig
    model = convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name("tensorwise"))
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

from fp8_impl.config import Float8LinearConfig
from fp8_impl.matmul import check_float8_operands, float8_matmul


def _check_features(in_features: int, out_features: int, config: Float8LinearConfig, where: str = "") -> None:
    align = config.alignment
    for name, value in (("in_features (K)", in_features), ("out_features (N)", out_features)):
        if value % align:
            raise ValueError(
                f"fp8_impl: {where}{name} = {value} is not divisible by {align}, which the {config.recipe.value} "
                f"recipe requires. Fix: pad it to a multiple of {align}, or skip this layer with "
                f"convert_to_float8_training(model, module_filter_fn=lambda mod, fqn: "
                f"mod.in_features % {align} == 0 and mod.out_features % {align} == 0)")


class Float8Linear(nn.Linear):
    """nn.Linear whose three GEMMs run in FP8 (dynamic scaling; the recipe is `config`'s).

    Takes any leading batch dims, bf16/fp16/fp32 input and weight; output and gradient dtypes are
    nn.Linear's. The bias is added in high precision after the GEMM.
    """

    def __init__(self, in_features, out_features, bias=True, device=None, dtype=None, *, config=None):
        config = config if config is not None else Float8LinearConfig()
        _check_features(in_features, out_features, config)
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.config = config

    @classmethod
    def from_float(cls, mod: nn.Linear, config: Optional[Float8LinearConfig] = None) -> "Float8Linear":
        """A Float8Linear that shares `mod`'s parameters (no copy: optimizer state stays valid)."""
        if not isinstance(mod, nn.Linear):
            raise TypeError(f"Float8Linear.from_float needs an nn.Linear, got {type(mod).__name__}")
        with torch.device("meta"):  # no allocation: the parameters are replaced just below
            new = cls(mod.in_features, mod.out_features, bias=False, config=config)
        new.weight, new.bias = mod.weight, mod.bias
        return new

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not isinstance(input, torch.Tensor) or not input.is_floating_point():
            got = input.dtype if isinstance(input, torch.Tensor) else type(input).__name__
            raise TypeError(f"fp8_impl: Float8Linear needs a floating-point input tensor, got {got}")
        if input.dim() < 2:
            raise ValueError(f"fp8_impl: Float8Linear needs input with at least 2 dims [*, K] (M = product of the "
                             f"leading dims must be divisible by 16), got shape {tuple(input.shape)}; use "
                             f"input.unsqueeze(0) and a batch of 16")
        if torch.is_autocast_enabled(input.device.type):  # mirror F.linear under autocast
            input = input.to(torch.get_autocast_dtype(input.device.type))
        lead_shape = input.shape[:-1]
        input_2d = input.reshape(-1, input.shape[-1])
        check_float8_operands(input_2d, self.weight, lead_shape=lead_shape, config=self.config)
        output = float8_matmul(input_2d, self.weight, config=self.config)
        output = output.reshape(*lead_shape, output.shape[-1])
        if self.bias is not None:
            output = output + self.bias.to(output.dtype)
        return output

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, config={self.config.short_str()}"


def convert_to_float8_training(
        module: nn.Module, *, module_filter_fn: Optional[Callable[[nn.Module, str], bool]] = None,
        config: Optional[Float8LinearConfig] = None) -> nn.Module:
    """Swap every nn.Linear in `module` (in place) for a Float8Linear sharing its parameters.

    module_filter_fn(mod, fqn) -> bool chooses which layers to convert. A root nn.Linear is
    returned converted (not changed in place), as in torchao. Layers whose features are not
    divisible by the recipe's alignment (16; 32 for MX; 128 for blockwise) raise a clear error
    naming the layer: filter them out.
    """
    config = config if config is not None else Float8LinearConfig()

    def convert(mod: nn.Linear, fqn: str) -> Float8Linear:
        _check_features(mod.in_features, mod.out_features, config, where=f"layer {fqn or '<root>'!r}: ")
        return Float8Linear.from_float(mod, config=config)

    def wanted(mod: nn.Module, fqn: str) -> bool:
        return isinstance(mod, nn.Linear) and not isinstance(mod, Float8Linear) and (
            module_filter_fn is None or module_filter_fn(mod, fqn))

    if wanted(module, ""):
        return convert(module, "")
    for fqn, mod in list(module.named_modules()):
        if fqn and wanted(mod, fqn):
            parent_fqn, _, child_name = fqn.rpartition(".")
            setattr(module.get_submodule(parent_fqn), child_name, convert(mod, fqn))
    return module
