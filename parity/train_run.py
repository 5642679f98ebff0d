"""One run of `fp8-parity train`'s lockstep, as it lives in its worker process (parity.train_worker):
its model (the built-in GPT, or your `--model` factory's) with every nn.Linear converted by the run's
implementation, inside probes (parity.train_probes), its optimizer, and what one micro-batch and one
optimizer step do. `evals/scoring/train_cost.py` trains plain runs (no probes) in its own process
through the same functions, as what the statistics are measured against.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from parity import cpu_gemm
from parity.impls import Impl, convert_linears
from parity.model import GPT, GPTConfig, UserModelShape, build_user_model, get_model_config, is_model_factory
from parity.train_plan import TrainError
from parity.train_probes import LayerProbe, RunState


@dataclass
class Run:
    """One implementation's model in the lockstep."""

    role: str
    impl: Impl
    seed: int
    model: nn.Module
    optimizer: torch.optim.Optimizer
    probes: dict[str, LayerProbe]  # empty for plain training (train_cost)
    state: RunState
    micro_losses: list[float] = field(default_factory=list)
    loss: float = math.nan
    grad_norm: float = math.nan


def initial_model(model: str, seed: int) -> tuple[nn.Module, GPTConfig | UserModelShape]:
    """The model named `model` (a built-in name, or `path.py:factory`: your code) with its initial
    weights drawn from `seed`, on the CPU in float32, and the shape of its data."""
    if is_model_factory(model):
        return build_user_model(model, seed)
    config = get_model_config(model)
    return GPT(config).init_weights(seed), config


def check_alignment(model: nn.Module, shape: GPTConfig | UserModelShape, impl: Impl) -> None:
    """ModelError / TrainError naming each GEMM dim of the model that the recipe of `impl` cannot take."""
    alignment, why = impl.recipe.alignment, f"the {impl.recipe.name} recipe of {impl.name}"
    if isinstance(shape, GPTConfig):
        shape.check_alignment(alignment, why=why)
        return
    bad = [f"{name}: in_features = {module.in_features}, out_features = {module.out_features}"
           for name, module in model.named_modules()
           if isinstance(module, nn.Linear) and (module.in_features % alignment or module.out_features % alignment)]
    if shape.tokens_per_step % alignment:
        bad.append(f"tokens per micro-batch (batch_size x seq_len) = {shape.tokens_per_step}")
    if bad:
        raise TrainError(f"--model {shape.name}: {'; '.join(bad)}: not a multiple of {alignment}, which every FP8 "
                         f"GEMM dim needs ({why}): round them to multiples of {alignment}")


def build_run(role: str, impl: Impl, model: nn.Module, shape, *, seed: int, device: str, checkpoint: bool,
              learning_rate: float, instrument: bool = True) -> Run:
    """`model` (initial weights, float32 on the CPU) on `device` in the implementation's dtype, its linears
    converted by `impl` (Impl.build, with the layer's name, so a converter's module filter sees the real
    fqn), inside probes when `instrument`, with its optimizer."""
    check_alignment(model, shape, impl)
    model = model.to(device=device, dtype=impl.compute_dtype or torch.bfloat16)
    if checkpoint:
        model.checkpoint_blocks = True
    state = RunState()
    probes = {}

    def probe(name: str, layer: nn.Module, weight: nn.Parameter) -> LayerProbe:
        probes[name] = LayerProbe(name, layer, weight, state)
        return probes[name]

    convert_linears(model, impl, wrap=probe if instrument else None)
    # AdamW: nanochat trains its embeddings and head with it; deterministic, state per parameter
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, betas=(0.9, 0.95), weight_decay=0.0,
                                  foreach=False)
    return Run(role, impl, seed, model, optimizer, probes, state)


def _fast_gemm(run: Run, device: str):
    """cpu_gemm's fast _scaled_mm around an fp8 run on the CPU (torch's CPU kernel is slow); nothing
    elsewhere. Scoped to the fp8 runs' forward and backward: a dispatch mode costs every op a Python
    call, which the high-precision runs, the comparisons and the numerics need not pay."""
    if device == "cpu" and cpu_gemm.enabled() and run.impl.recipe.is_fp8:
        return cpu_gemm.kernel()
    return contextlib.nullcontext()


def _deterministic_attention(device: str):
    """On CUDA, PyTorch's math attention kernel. Flash (and memory-efficient) attention accumulate dQ
    in backward with atomic adds unless torch.use_deterministic_algorithms(True) is on (which also makes
    other CUDA ops raise), so two runs whose GEMMs agree bitwise would still see other grad_outputs at
    q, k and v, and the lockstep would report a difference no implementation made. The math kernel is
    plain bmm and softmax: deterministic, and for the built-in models a few percent of a step. The CPU's
    attention kernels are deterministic as they are."""
    if torch.device(device).type == "cuda":
        return sdpa_kernel(SDPBackend.MATH)
    return contextlib.nullcontext()


def _no_phase(_: str) -> None:
    """forward_backward's default: nobody is told where the run is."""


def forward_backward(run: Run, tokens: torch.Tensor, *, loss_scale: float = 1.0, device: str = "cpu",
                     phase: Callable[[str], None] = _no_phase) -> None:
    """One micro-batch: forward, loss (kept in run.micro_losses), backward of loss x loss_scale (1/N
    under gradient accumulation: the summed gradients are the mean's). Gradients add into .grad.
    `phase` hears "forward" and "backward" as each starts (a worker reports where a death happened)."""
    run.state.order.clear()
    for probe in run.probes.values():  # a layer this call does not run keeps no record of the last one
        probe.call = None
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    with _fast_gemm(run, device), _deterministic_attention(device):
        phase("forward")
        logits = run.model(inputs)
        if not isinstance(logits, torch.Tensor) or logits.dim() != 3 or logits.shape[:2] != inputs.shape:
            got = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
            raise TrainError(f"the model's forward returned {got} for token ids of shape {tuple(inputs.shape)}: it "
                             f"must return logits [B, T, vocab_size]")
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
        phase("backward")
        run.state.in_backward = True
        try:
            (loss if loss_scale == 1.0 else loss * loss_scale).backward()
        finally:
            run.state.in_backward = False
    run.micro_losses.append(loss.item())


def finish_step(run: Run) -> None:
    """The step's loss (mean over its micro-batches) and gradient norm, then the optimizer step."""
    run.loss = sum(run.micro_losses) / len(run.micro_losses)
    grads = [p.grad.detach().float().pow(2).sum() for p in run.model.parameters() if p.grad is not None]
    run.grad_norm = math.sqrt(float(torch.stack(grads).sum())) if grads else 0.0
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    run.micro_losses.clear()
