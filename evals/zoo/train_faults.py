"""Faults that only training shows, as implementations to load by name (`evals/zoo/train_faults.py:NAME`).

Each is bitwise equal to torchao's tensorwise recipe (fp8_impl is) on a single call, and wrong
only through state that training exercises. Expected localizations (the tiny model; test_train.py
asserts them):

stale_weight_cache        fp8_impl's Float8Linear that quantizes its weight once and keeps the fp8 copy:
                          the optimizer's in-place update is never seen. Exact at step 0; from step 1
                          every layer's output GEMM uses the previous weight, and the first layer to run
                          (blocks.0.attn.c_q) is where training first diverges: (1, blocks.0.attn.c_q, output).
skips_a_layer             fp8_impl's converter with a module filter that leaves SKIPPED_LAYER in bf16, as a
                          wrong fqn pattern would: (0, SKIPPED_LAYER, output).
scale_from_previous_amax  delayed scaling done wrong: each operand is cast with the scale of the amax it had
                          at the layer's PREVIOUS call (input and weight: the previous forward;
                          grad_output: the previous backward); the first call has no history and takes its
                          own amax, so step 0 is exactly torchao's dynamic scaling. At step 1 the first
                          layer's input and weight (updated by the optimizer) have new amaxes, so the first
                          divergence is (1, blocks.0.attn.c_q, output).
amax_once_per_step        the input's amax taken at the first call after the weight changed (an optimizer
                          step bumps the weight's version counter) and reused until it changes again: a
                          cache meant for the weight, applied to the activation. One call per step (no
                          accumulation; a checkpoint recompute sees the same input, so the same amax):
                          exact. Under --grad-accum 2 the second micro-batch is cast with the first's
                          scale, which shows at the first layer whose input amax differs between the two
                          micro-batches: not c_q, k, v (their input, the normalized token embeddings, has
                          the same amax in both: the same embedding rows occur in 256 tokens over a
                          vocabulary of 64) but the attention output projection, whose input mixes each
                          sequence's context: (0, micro-batch 1, blocks.0.attn.c_proj, output).
delayed_scaling           the REFERENCE for the next fault: delayed scaling of the input (activation) done
                          right, as torchao's delayed scaling and Transformer Engine do it: the input's scale
                          comes from the amax recorded during the previous optimizer step (the first step:
                          its own amax) and stays fixed for the whole step, so every call of a step - a
                          micro-batch, a checkpoint recompute - casts with the same scale. Weight and
                          grad_output are scaled dynamically.
recompute_advances_scale  delayed_scaling done wrong under activation checkpointing: it treats EVERY call
                          as a new step (advances its history on each forward), which is the same thing when
                          each step is one forward, so without --checkpoint it is bitwise equal to
                          delayed_scaling. Under --checkpoint the recompute in backward is a second call:
                          it casts the input with the amax the original forward just recorded (this step's),
                          not the scale the forward used (last step's). Step 0 agrees (both scales are the
                          step's own amax); at step 1 the first backward GEMM that consumes a recomputed
                          input is grad_weight = grad_output.T @ input of the LAST block's last layer
                          (backward starts there; the head is not checkpointed). grad_input = grad_output @
                          weight of that layer is still exact: grad_output comes from outside the block and
                          the weight is scaled dynamically. So: (1, blocks.1.mlp.c_proj, grad_weight).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from fp8_impl import Float8Linear, convert_to_float8_training
from fp8_impl.config import E4M3, E5M2
from fp8_impl.matmul import FP8_MAX, _col_major, _gemm, _row_major, amax_to_scale, float8_matmul

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


# ---- scaling state: tensorwise FP8 with each operand's amax chosen by the layer ---------------------

def current_amax(tensor: torch.Tensor) -> torch.Tensor:
    """max |x|, computed as fp8_impl.to_float8 computes it (so the scale has the same bits)."""
    return torch.linalg.vector_norm(tensor.detach(), ord=math.inf)


def _cast(x: torch.Tensor, fp8_dtype: torch.dtype, amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x in fp8 with the scale of `amax` (which may be another call's), saturated as delayed scaling
    needs: (x_fp8, inverse scale). With x's own amax, bitwise fp8_impl.to_float8 (the float32 product
    rounded once onto fp8; the clamp changes nothing when |x| <= amax)."""
    scale = amax_to_scale(amax, fp8_dtype)
    fp8_max = FP8_MAX[fp8_dtype]
    return (x.float() * scale.reshape(1)).clamp(-fp8_max, fp8_max).to(fp8_dtype), scale.reciprocal()


class _ScaledMatmul(torch.autograd.Function):
    """fp8_impl's tensorwise GEMMs (the same layouts, kernels and fast-accumulation flags), with every
    operand's amax asked of the layer: layer.amax(operand, tensor). The fp8 input and weight are saved
    for backward, as tensorwise does: under checkpointing the recompute's casts are what backward uses."""

    @staticmethod
    def forward(ctx, input_2d, weight, layer):
        config = layer.config
        input_fp8, input_inverse = _cast(input_2d, E4M3, layer.amax("input", input_2d))
        weight_fp8, weight_inverse = _cast(weight, E4M3, layer.amax("weight", weight))
        output = _gemm(_row_major(input_fp8), input_inverse, _col_major(weight_fp8.t()), weight_inverse,
                       config.output, input_2d.dtype)
        ctx.save_for_backward(input_fp8, input_inverse, weight_fp8, weight_inverse)
        ctx.layer, ctx.weight_dtype = layer, weight.dtype
        return output

    @staticmethod
    def backward(ctx, grad_output):
        input_fp8, input_inverse, weight_fp8, weight_inverse = ctx.saved_tensors
        config = ctx.layer.config
        go_fp8, go_inverse = _cast(grad_output, E5M2, ctx.layer.amax("grad_output", grad_output))
        grad_input = _gemm(_row_major(go_fp8), go_inverse, _col_major(weight_fp8), weight_inverse,
                           config.grad_input, grad_output.dtype)
        grad_weight = _gemm(_row_major(go_fp8.t()), go_inverse, _col_major(input_fp8), input_inverse,
                            config.grad_weight, grad_output.dtype).to(ctx.weight_dtype)
        return grad_input, grad_weight, None


class _ScaledLinear(Float8Linear):
    """Float8Linear (tensorwise) whose operands' amaxes come from amax(): the base of the scaling faults.
    Here every operand takes its own amax: dynamic scaling, bitwise fp8_impl and torchao."""

    def amax(self, operand: str, tensor: torch.Tensor) -> torch.Tensor:
        return current_amax(tensor)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        output = _ScaledMatmul.apply(input.reshape(-1, input.shape[-1]), self.weight, self)
        return output.reshape(*input.shape[:-1], output.shape[-1])


class scale_from_previous_amax(_ScaledLinear):  # noqa: N801
    """Each operand cast with the amax it had at the layer's previous call (the first call: its own)."""

    def amax(self, operand: str, tensor: torch.Tensor) -> torch.Tensor:
        history = self.__dict__.setdefault("_previous_amax", {})
        current = current_amax(tensor)
        used = history.get(operand, current)  # the bug: last call's amax for this call's tensor
        history[operand] = current
        return used


class amax_once_per_step(_ScaledLinear):  # noqa: N801
    """The input's amax taken once per weight version (optimizer step) and reused for later calls."""

    def amax(self, operand: str, tensor: torch.Tensor) -> torch.Tensor:
        current = current_amax(tensor)
        if operand != "input":
            return current
        version = self.weight._version  # the optimizer's in-place update bumps it: a new step
        cached = self.__dict__.get("_input_amax")
        if cached is None or cached[0] != version:
            cached = self.__dict__["_input_amax"] = (version, current)
        return cached[1]  # the bug: a later micro-batch of the step gets the first one's amax


class delayed_scaling(_ScaledLinear):  # noqa: N801
    """Delayed scaling of the input done right: the scale of the previous step's amax, fixed for the step."""

    ADVANCE_ON_EVERY_CALL = False

    def amax(self, operand: str, tensor: torch.Tensor) -> torch.Tensor:
        current = current_amax(tensor)
        if operand != "input":
            return current
        state = self.__dict__.get("_delayed")
        version = self.weight._version  # the optimizer's in-place update bumps it: a new step
        if state is None or state["version"] != version or self.ADVANCE_ON_EVERY_CALL:
            # a new step: its scale from the amax recorded during the last one (the first step: its own)
            used = current if state is None else state["recorded"]
            state = self.__dict__["_delayed"] = dict(version=version, used=used, recorded=current)
        else:  # another call of the same step: the same scale; the step's amax is the max over its calls
            state["recorded"] = torch.maximum(state["recorded"], current)
        return state["used"]


class recompute_advances_scale(delayed_scaling):  # noqa: N801
    """delayed_scaling that advances its history on every call: a checkpoint recompute gets the next step's scale."""

    ADVANCE_ON_EVERY_CALL = True
