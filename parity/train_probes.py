"""The probes of `fp8-parity train`: what one converted layer did in the current call.

Each converted layer sits inside a LayerProbe that keeps, for the call, its input, output,
grad_output and grad_input (identity autograd functions on either side of the layer catch the
gradients), and its weight gradient of this call (a hook on the weight parameter, which sees the
call's gradient before it is added into .grad). A forward while the run is in backward is the
activation-checkpoint recompute of the current call (parity.train's docstring): recorded beside
the forward's, never as a new call.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Callable

import torch
from torch import nn

from parity.recipes import GEMMS
from parity.train_plan import TrainError



class _GradTap(torch.autograd.Function):
    """Identity forward; backward hands the gradient that flows through to `keep`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, keep: Callable[[torch.Tensor], None]) -> torch.Tensor:
        ctx.keep = keep
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.keep(grad.detach())
        return grad, None


def _discard(_: torch.Tensor) -> None:
    """The taps of a checkpoint recompute: its graph is never backpropagated, nothing arrives."""


@dataclass
class Call:
    """One call of a converted layer: a micro-batch's forward, its recompute under checkpointing,
    and its backward."""

    input: torch.Tensor  # the forward's: what the output GEMM used
    output: torch.Tensor | None = None
    grad_output: torch.Tensor | None = None
    grad_input: torch.Tensor | None = None  # None when the layer's input needs no gradient
    grad_weight: torch.Tensor | None = None  # this call's, before it is added into .grad
    recomputed_input: torch.Tensor | None = None  # the checkpoint recompute's: what the backward GEMMs used
    # None without recompute, or where the recompute stopped early: torch.utils.checkpoint ends it once
    # the last saved tensor is refilled, inside a block's last layer, before that layer's output exists
    recomputed_output: torch.Tensor | None = None

    def results(self) -> dict[str, torch.Tensor | None]:
        """The three GEMMs' results of the call (after backward)."""
        return {"output": self.output, "grad_input": self.grad_input, "grad_weight": self.grad_weight}

    def input_for(self, gemm: str) -> torch.Tensor:
        """The input the GEMM consumed: the recompute's for grad_weight under checkpointing."""
        return self.recomputed_input if gemm != "output" and self.recomputed_input is not None else self.input


@dataclass
class RunState:
    """Shared by a run's probes: the layers' forward order this call, and whether backward is running."""

    order: list[str] = field(default_factory=list)
    in_backward: bool = False


class LayerProbe(nn.Module):
    """A converted linear layer and what it did in the current call (`call`): identity taps on its
    input and output catch grad_input and grad_output, a hook on its weight catches the call's
    grad_weight. A forward while the run is in backward is the checkpoint recompute of the current
    call (see the module docstring): recorded beside the forward's, never as a new call."""

    def __init__(self, name: str, layer: nn.Module, weight: nn.Parameter, state: RunState):
        super().__init__()
        self.layer, self.name = layer, name
        self._weight, self._state = [weight], state  # in a list: not registered a second time
        self.call: Call | None = None
        weight.register_hook(self._keep_grad_weight)

    @property
    def weight_param(self) -> nn.Parameter:
        return self._weight[0]

    def _keep_grad_weight(self, grad: torch.Tensor) -> None:
        if self.call is not None:
            self.call.grad_weight = grad.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._state.in_backward and self.call is not None:
            return self._recompute(x)
        if self.name in self._state.order:
            raise TrainError(f"layer {self.name!r} ran twice in one forward pass: a layer called more than once per "
                             f"step (shared weights) has two calls the comparison cannot tell apart; give each use "
                             f"its own nn.Linear")
        self._state.order.append(self.name)
        call = self.call = Call(input=x.detach())
        output = self.layer(_GradTap.apply(x, partial(setattr, call, "grad_input")))
        call.output = output.detach()
        return _GradTap.apply(output, partial(setattr, call, "grad_output"))

    def _recompute(self, x: torch.Tensor) -> torch.Tensor:
        """The checkpoint recompute of the current call: the same autograd functions as the forward
        (the recompute must save the same tensors, in the same order), its own records."""
        self.call.recomputed_input = x.detach()
        output = self.layer(_GradTap.apply(x, _discard))
        self.call.recomputed_output = output.detach()
        return _GradTap.apply(output, _discard)

    def results(self) -> dict[str, torch.Tensor | None]:
        """The call's three GEMM results; all None for a layer the call did not run (a user's model may
        leave one out)."""
        return self.call.results() if self.call is not None else dict.fromkeys(GEMMS)

    def recompute_bitwise(self) -> bool | None:
        """Whether the checkpoint recompute's output GEMM gave the forward's bits (None: no recompute)."""
        if self.call is None or self.call.recomputed_output is None:
            return None
        return same(self.call.output, self.call.recomputed_output)

    def operands(self, gemm: str = "output", *, copy: bool = False) -> dict[str, torch.Tensor]:
        """input (the one `gemm` used), weight (its value this step), grad_output; `copy` the weight
        before the optimizer changes it."""
        weight = self.weight_param.detach()
        return {"input": self.call.input_for(gemm), "weight": weight.clone() if copy else weight,
                "grad_output": self.call.grad_output}



def same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Bitwise equal (dtype and shape too); two GEMMs that did not run are equal."""
    if a is None or b is None:
        return a is None and b is None  # both not run (an input that needs no gradient): no difference
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)

