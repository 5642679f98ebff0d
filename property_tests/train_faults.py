"""Faults that only training shows, as implementations to load by name (`property_tests/train_faults.py:NAME`).

stale_weight_cache   fp8_impl's Float8Linear that quantizes its weight once and keeps the fp8 copy:
                     the optimizer's in-place update is never seen. Exact at step 0; from step 1 (the
                     second step) every layer's output GEMM uses the previous weight, and the first layer
                     to run (blocks.0.attn.c_q) is where training first diverges.
skips_a_layer        fp8_impl's converter with a module filter that leaves SKIPPED_LAYER in bf16, as a
                     wrong fqn pattern would: that layer's output GEMM differs from step 0.

Bitwise equal to torchao's tensorwise recipe everywhere else (fp8_impl is).
"""

from __future__ import annotations

import torch
from torch import nn

from fp8_impl import Float8Linear, convert_to_float8_training
from fp8_impl.matmul import float8_matmul

SKIPPED_LAYER = "blocks.1.mlp.c_fc"


class stale_weight_cache(Float8Linear):  # noqa: N801 - named as the fault it is, like the mutants
    """Float8Linear whose weight is read once: later calls reuse the first call's weight values."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        cached = getattr(self, "_cached_weight", None)
        if cached is None:
            # the bug: a copy taken at the first call, never invalidated after an optimizer step
            cached = self._cached_weight = self.weight.detach().clone()
        # the gradient still flows to the parameter (through a straight-through view of the stale values)
        weight = self.weight + (cached - self.weight).detach()
        output = float8_matmul(input.reshape(-1, input.shape[-1]), weight, config=self.config)
        return output.reshape(*input.shape[:-1], output.shape[-1])


def skips_a_layer(model: nn.Module, **kwargs) -> nn.Module:
    """fp8_impl's convert_to_float8_training, with a filter that wrongly skips SKIPPED_LAYER."""
    return convert_to_float8_training(model, module_filter_fn=lambda mod, fqn: fqn != SKIPPED_LAYER, **kwargs)


class raises_at_second_step(Float8Linear):  # noqa: N801
    """Float8Linear that raises from its second call on: a crash is a finding of `train`, not of the harness."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._calls = getattr(self, "_calls", 0) + 1
        if self._calls > 1:
            raise RuntimeError("planted: the second call raises")
        return super().forward(input)


class exits_at_second_step(Float8Linear):  # noqa: N801
    """Float8Linear that calls os._exit(0) from its second call on: the run must not end as a pass."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._calls = getattr(self, "_calls", 0) + 1
        if self._calls > 1:
            import os
            os._exit(0)
        return super().forward(input)
