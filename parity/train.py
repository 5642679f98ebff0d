"""`fp8-parity train`: parity over real training steps, per-layer numerics, and the first diverging GEMM.

A layer that is bitwise equal to its reference on one call can still drift in training: state kept
across steps (an fp8 weight cached and never invalidated after the optimizer step, a scale taken
from the previous call's amax), state kept across the calls of one step (an amax taken once per
optimizer step under gradient accumulation, a scaling history that the recompute of activation
checkpointing advances), a converter that leaves a layer in bf16, scales that meet real activations
and gradients. This module trains the same model several ways IN LOCKSTEP and compares them GEMM by
GEMM at every call.

The runs (each a parity.model.GPT on parity.model's synthetic language, so nothing is downloaded,
or your own model and data: see below):

    candidate      --impl, every nn.Linear converted through its plug-in form (Impl.build, with
                   the layer's name, so a converter's module filter sees the real fqn)
    against        the implementation the candidate must agree with (default: its recipe's
                   parity reference, torchao's implementation of it)
    baseline       --baseline (default bf16): what FP8 training is measured against
    baseline seed  the baseline again from another init seed: the seed-to-seed noise

All four start from weights drawn from one seed (the fourth from seed + 1), train on the same
batches with the same optimizer, and advance together: each micro-batch (one per step, or
--grad-accum N of them, their losses scaled by 1/N and their gradients summed) runs forward and
backward in every run, then the comparisons, and after the step's last micro-batch each run's
optimizer step. Each converted layer sits inside a probe that keeps, for the call, its input,
output, grad_output and grad_input (identity autograd functions on either side of the layer catch
the gradients), and its weight gradient of this call (a hook on the weight parameter, which sees
the call's gradient before it is added into .grad). So at every call the three GEMMs of every
layer (output, grad_input, grad_weight) of the candidate are compared bitwise with the against
run's. While the runs agree bitwise their inputs are identical too, so the FIRST (step,
micro-batch, layer, GEMM) that differs, in execution order (forward through the layers, then
backward in reverse), is where the implementations part: later differences are consequences.
That GEMM's operands are saved as a case file (parity.data.write_case_file: this call and the one
before it, so a stale cache shows again), which `fp8-parity check --case-file` and `fp8-parity
bisect --case-file` judge and diagnose exactly.

Activation checkpointing (--checkpoint: torch.utils.checkpoint, non-reentrant, around each block)
runs each block's forward a second time during backward, and that recompute, not the original
forward, produces the tensors the backward GEMMs use (non-reentrant checkpointing backpropagates
through the ORIGINAL graph, with its saved tensors refilled from the recompute). The probes know
the phase (the harness flags a run as in backward around loss.backward()), so a forward call
during backward is the recompute of the current call: it does not count as a new call, it leaves
the recorded input and output of the forward alone, and it records its own input (what the
backward GEMMs consumed: grad_weight = grad_output.T @ recomputed input) and its output (the
output GEMM redone: an implementation whose recompute gives other bits than its forward, as one
that advances scaling state on every call, shows there). Numerics and case files of the backward
GEMMs use the recomputed input; those of the output GEMM the forward's.

On CUDA the lockstep runs attention with PyTorch's math kernel: flash attention's backward adds dQ
up with atomics (not deterministic by default), so two runs with bitwise-equal GEMMs would see other
gradients at q, k and v, a difference no implementation made.

Every `sample_every` steps (to bound the cost) each run's GEMMs get numerics: SQNR against a float64
shadow GEMM computed on the same operands (the run's own, so it measures this layer's rounding, not
the drift of the trajectory), and for each operand its amax and, under the run's recipe scaling
(parity.oracles.quantize, the same emulation the oracles use), the share of non-zero values that
quantize to zero (underflow) and the share that land on the fp8 format's largest magnitude
(saturated: under dynamic scaling the amax lands there by construction, so this is the share
within one fp8 step of the amax; a wrong or stale scale shows as many more). Every step is timed
(a CUDA device is synchronized before each reading), split into training, comparisons and
numerics, so the report says what the statistics cost.

The loss is judged over the last `window` steps: the candidate's relative gap to the baseline,
against the baseline's own seed-to-seed gap, with DeepSeek-V3's 0.25% (the relative loss error it
reports for FP8 against BF16 training) as the reference line.

Your own model and data (parity.model's docstring has the protocol):

    --model path/to/file.py:factory   factory() returns an nn.Module mapping token ids [B, T] to
                                      logits [B, T, vocab_size], with int attributes vocab_size,
                                      seq_len and optionally batch_size (default 8); its weights
                                      are drawn under torch.manual_seed(seed)
    --data FILE                       token ids in a .pt or .npy file, or UTF-8 text read as bytes
                                      (vocabulary 256); no entropy rate is known, so no loss floor
"""

from __future__ import annotations

import contextlib
import copy
import math
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Callable

import pandas as pd
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from parity import cpu_gemm, oracles, sandbox
from parity.data import write_case_file
from parity.env import environment
from parity.impls import Impl, convert_linears, default_reference, load_impl
from parity.metrics import sqnr_db
from parity.model import (GPT, GPTConfig, MarkovSource, ModelError, TokenFile, UserModelShape, batches,
                          build_user_model, get_model_config, is_model_factory, load_model_factory)
from parity.policy import Policy, default_policy
from parity.recipes import GEMMS
from parity.report import Verdict

# DeepSeek-V3 (arXiv 2412.19437, section 3.3): FP8 training's relative loss error against BF16
# "consistently remains below 0.25%". A reference line, drawn in the report and used as the floor
# of the allowed gap: below it a gap passes even when the seed-to-seed noise happens to be smaller.
DEEPSEEK_RELATIVE_LOSS_GAP = 0.0025
# The learning rate of your own model (--model file.py:factory) unless --lr says otherwise; the
# built-in models carry theirs (GPTConfig.learning_rate: 1e-2 for tiny, 3e-3 for d12).
LEARNING_RATE = 1e-2
ROLES = ("candidate", "against", "baseline", "baseline_seed")
DEFAULT_BASELINE = "bf16"


class TrainError(ValueError):
    """A training comparison that cannot run as asked; the message says what and how to fix it."""


@dataclass(frozen=True)
class TrainPlan:
    """What `fp8-parity train` runs. `window`: steps at the end whose mean loss is judged (default:
    the last fifth, at least one: long enough to average out batch-to-batch noise, short enough to
    be the end of training). `sample_every`: the steps whose numerics are computed (and the last).
    `model`: a built-in name or `path.py:factory`; `lr`: None for the model's own; `grad_accum`:
    micro-batches a step; `checkpoint`: torch.utils.checkpoint around each block of the built-in
    GPT; `data`: a token or text file instead of the synthetic source."""

    impl: str
    against: str | None = None  # None: the candidate recipe's parity reference
    baseline: str = DEFAULT_BASELINE
    model: str = "tiny"
    steps: int = 50
    device: str = "cpu"
    seed: int = 0
    sample_every: int = 5
    window: int | None = None
    lr: float | None = None
    form: str | None = None
    recipe: str | None = None
    grad_accum: int = 1
    checkpoint: bool = False
    data: str | None = None

    def __post_init__(self):
        if self.steps < 1:
            raise TrainError(f"steps = {self.steps}: train at least one step (e.g. --steps 50)")
        if self.sample_every < 1:
            raise TrainError(f"sample_every = {self.sample_every} must be at least 1 (1: numerics at every step)")
        if self.window is not None and not 1 <= self.window <= self.steps:
            raise TrainError(f"window = {self.window} must be from 1 to steps = {self.steps}")
        if self.lr is not None and not (math.isfinite(self.lr) and self.lr > 0):
            raise TrainError(f"lr = {self.lr} must be a positive finite number (e.g. {LEARNING_RATE})")
        if self.grad_accum < 1:
            raise TrainError(f"grad_accum = {self.grad_accum} must be at least 1 (1: no gradient accumulation)")
        if self.data is not None and not Path(self.data).is_file():
            raise TrainError(f"--data {self.data!r} does not exist (resolved to {Path(self.data).resolve()}): give "
                             f"a .pt or .npy file of token ids or a UTF-8 text file")
        try:
            if self.user_model:
                load_model_factory(self.model)  # imports the file: a typo shows before anything trains
            else:
                get_model_config(self.model)
        except ModelError as err:
            raise TrainError(str(err)) from None
        if self.checkpoint and self.user_model:
            raise TrainError(f"--checkpoint wraps the blocks of the built-in GPT; for your own model "
                             f"({self.model}) call torch.utils.checkpoint(..., use_reentrant=False) in its forward "
                             f"instead (the probes handle the recompute either way) and leave out --checkpoint")

    @property
    def user_model(self) -> bool:
        return is_model_factory(self.model)

    @property
    def config(self) -> GPTConfig:
        """The built-in model's config (a user's model has none: see build_models)."""
        return get_model_config(self.model)

    @property
    def learning_rate(self) -> float:
        if self.lr is not None:
            return self.lr
        return LEARNING_RATE if self.user_model else self.config.learning_rate

    @property
    def loss_window(self) -> int:
        return self.window or max(1, self.steps // 5)

    def sampled(self, step: int) -> bool:
        return step % self.sample_every == 0 or step == self.steps - 1


# ---- probes: what one converted layer did in the current call -------------------------------------

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
        return _same(self.call.output, self.call.recomputed_output)

    def operands(self, gemm: str = "output", *, copy: bool = False) -> dict[str, torch.Tensor]:
        """input (the one `gemm` used), weight (its value this step), grad_output; `copy` the weight
        before the optimizer changes it."""
        weight = self.weight_param.detach()
        return {"input": self.call.input_for(gemm), "weight": weight.clone() if copy else weight,
                "grad_output": self.call.grad_output}


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


@dataclass
class Models:
    """The models of a plan: its data shape, and the initial model of each seed (on the CPU, float32)."""

    shape: GPTConfig | UserModelShape
    initial: dict[int, nn.Module]

    @classmethod
    def build(cls, plan: TrainPlan) -> "Models":
        seeds = (plan.seed, plan.seed + 1)
        if plan.user_model:
            models = {seed: build_user_model(plan.model, seed) for seed in seeds}
            return cls(models[plan.seed][1], {seed: model for seed, (model, _) in models.items()})
        config = plan.config
        return cls(config, {seed: GPT(config).init_weights(seed) for seed in seeds})


def _check_user_model_alignment(model: nn.Module, shape: UserModelShape, alignment: int, why: str) -> None:
    """TrainError naming each linear layer (and the tokens of a micro-batch) not a multiple of `alignment`."""
    bad = [f"{name}: in_features = {module.in_features}, out_features = {module.out_features}"
           for name, module in model.named_modules()
           if isinstance(module, nn.Linear) and (module.in_features % alignment or module.out_features % alignment)]
    if shape.tokens_per_step % alignment:
        bad.append(f"tokens per micro-batch (batch_size x seq_len) = {shape.tokens_per_step}")
    if bad:
        raise TrainError(f"--model {shape.name}: {'; '.join(bad)}: not a multiple of {alignment}, which every FP8 "
                         f"GEMM dim needs ({why}): round them to multiples of {alignment}")


def build_run(role: str, impl: Impl, models: Models, *, seed: int, plan: TrainPlan, instrument: bool = True) -> Run:
    """A copy of the model of `seed`, its linears converted by `impl` (Impl.build), inside probes when
    `instrument`, on the plan's device, with its optimizer."""
    why = f"the {impl.recipe.name} recipe of {impl.name}"
    if isinstance(models.shape, GPTConfig):
        models.shape.check_alignment(impl.recipe.alignment, why=why)
    else:
        _check_user_model_alignment(models.initial[seed], models.shape, impl.recipe.alignment, why)
    model = copy.deepcopy(models.initial[seed]).to(device=plan.device, dtype=impl.compute_dtype or torch.bfloat16)
    if plan.checkpoint:
        model.checkpoint_blocks = True
    state = RunState()
    probes = {}

    def probe(name: str, layer: nn.Module, weight: nn.Parameter) -> LayerProbe:
        probes[name] = LayerProbe(name, layer, weight, state)
        return probes[name]

    convert_linears(model, impl, wrap=probe if instrument else None)
    # AdamW: nanochat trains its embeddings and head with it; deterministic, state per parameter
    optimizer = torch.optim.AdamW(model.parameters(), lr=plan.learning_rate, betas=(0.9, 0.95), weight_decay=0.0,
                                  foreach=False)
    return Run(role, impl, seed, model, optimizer, probes, state)


def _fast_gemm(run: Run, device: str):
    """cpu_gemm's fast _scaled_mm around an fp8 run on the CPU (torch's CPU kernel is slow); nothing
    elsewhere. Scoped to the fp8 runs' forward and backward: a dispatch mode costs every op a Python
    call, which the high-precision runs, the comparisons and the numerics need not pay."""
    if device == "cpu" and cpu_gemm.enabled() and run.impl.recipe.is_fp8:
        return cpu_gemm.FastScaledMM()
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


def forward_backward(run: Run, tokens: torch.Tensor, *, loss_scale: float = 1.0, device: str = "cpu") -> None:
    """One micro-batch: forward, loss (kept in run.micro_losses), backward of loss x loss_scale (1/N
    under gradient accumulation: the summed gradients are the mean's). Gradients add into .grad."""
    run.state.order.clear()
    for probe in run.probes.values():  # a layer this call does not run keeps no record of the last one
        probe.call = None
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    with _fast_gemm(run, device), _deterministic_attention(device):
        logits = run.model(inputs)
        if not isinstance(logits, torch.Tensor) or logits.dim() != 3 or logits.shape[:2] != inputs.shape:
            got = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
            raise TrainError(f"the model's forward returned {got} for token ids of shape {tuple(inputs.shape)}: it "
                             f"must return logits [B, T, vocab_size]")
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
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


# ---- numerics -----------------------------------------------------------------------------------

def shadow_gemm(gemm: str, input_2d: torch.Tensor, weight: torch.Tensor, grad_output_2d: torch.Tensor):
    """The GEMM in float64 on the same operands."""
    x, w, g = (t.to(torch.float64) for t in (input_2d, weight, grad_output_2d))
    return {"output": lambda: x @ w.t(), "grad_input": lambda: g @ w, "grad_weight": lambda: g.t() @ x}[gemm]()


def operand_stats(values: torch.Tensor, cast, pow2: bool) -> torch.Tensor:
    """[amax, underflow %, saturated %] (float64, on the operand's device: the caller reads all of a
    layer's at once). Under the cast's scaling: % of non-zero values quantized to zero and % on the fp8
    max; NaN for a high-precision operand (nothing is quantized)."""
    amax = values.abs().amax().to(torch.float64) if values.numel() else values.new_zeros((), dtype=torch.float64)
    if cast.fp8 is None:
        nan = torch.full((), math.nan, dtype=torch.float64, device=values.device)
        return torch.stack([amax, nan, nan])
    quantized = oracles.quantize(values, cast, pow2=pow2).values
    nonzero = values != 0
    count = nonzero.sum().clamp(min=1).to(torch.float64)
    fp8_max = oracles.FORMATS[cast.dtype].max
    # counted in float64: 100 x a count of millions is not exact in float32
    underflow = (nonzero & (quantized == 0)).sum().to(torch.float64)
    saturated = (nonzero & (quantized.abs() == fp8_max)).sum().to(torch.float64)
    return torch.stack([amax, 100.0 * underflow / count, 100.0 * saturated / count])


def gemm_numerics(probe: LayerProbe, recipe) -> dict[str, dict]:
    """Per GEMM: the SQNR against the float64 shadow and the stats of its two operands (a, b), each on
    the operands that GEMM consumed."""
    call, weight = probe.call, probe.weight_param.detach()
    if call is None or call.grad_output is None:  # not run this call, or its output did not reach the loss
        return {}
    grad_output_2d = call.grad_output.reshape(-1, call.grad_output.shape[-1])
    results = call.results()
    numerics, stats = {}, []
    for gemm_name in GEMMS:
        input_2d = call.input_for(gemm_name).reshape(-1, weight.shape[1])
        gemm = recipe.gemm(gemm_name)
        got = results[gemm_name]
        row = {"sqnr_db": math.nan}
        if got is not None:
            shadow = shadow_gemm(gemm_name, input_2d, weight, grad_output_2d)
            row["sqnr_db"] = sqnr_db(got.reshape(shadow.shape), shadow)
        views = oracles.operand_views(input_2d, weight, grad_output_2d)[gemm_name]
        for side, operand, values, cast in zip("ab", gemm.operands, views, (gemm.a, gemm.b)):
            row[f"{side}_operand"] = operand
            stats.append(operand_stats(values, cast, recipe.pow2_scales))
        numerics[gemm_name] = row
    values = iter(torch.stack(stats).tolist())  # one device-to-host copy for the layer's operands
    for gemm_name in GEMMS:
        for side in "ab":
            amax, underflow, saturated = next(values)
            numerics[gemm_name].update({f"{side}_amax": amax, f"{side}_underflow_pct": underflow,
                                        f"{side}_saturated_pct": saturated})
    return numerics


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None  # both not run (an input that needs no gradient): no difference
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def execution_order(forward_order: list[str]) -> list[tuple[str, str]]:
    """(layer, GEMM) in the order they run: each layer's output in forward order, then backward in
    reverse layer order, grad_input before grad_weight."""
    return ([(name, "output") for name in forward_order]
            + [(name, gemm) for name in reversed(forward_order) for gemm in ("grad_input", "grad_weight")])


def _clock(device: str) -> float:
    """perf_counter after the device's queued work is done (CUDA runs asynchronously)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


# ---- the lockstep ---------------------------------------------------------------------------------

@dataclass
class Divergence:
    """The first (step, micro-batch, layer, GEMM) where the candidate differs from the against run."""

    step: int
    layer: str
    gemm: str
    case_file: Path | None = None
    micro: int = 0
    grad_accum: int = 1

    def __str__(self) -> str:
        micro = f", micro-batch {self.micro} of {self.grad_accum}" if self.grad_accum > 1 else ""
        return f"step {self.step}{micro}, layer {self.layer}, GEMM {self.gemm}"


@dataclass
class TrainResult:
    plan: TrainPlan
    frame: pd.DataFrame  # tidy: one row per step x micro-batch x run x layer x GEMM
    source: MarkovSource | TokenFile
    runs: dict[str, str]  # role -> implementation name
    bitwise_required: bool
    divergence: Divergence | None = None
    loss_differs_at: int | None = None  # a step whose loss differs while every GEMM agreed
    crash: str | None = None  # an implementation that raised: where, and its exception (training stops there)
    seconds: float = 0.0
    verdict: Verdict | None = None
    layers: list[str] = field(default_factory=list)  # the converted layers, in the model's order
    timing: pd.DataFrame | None = None  # one row per completed step: seconds, split by phase
    recompute_differs: tuple[int, int, str] | None = None  # (step, micro, layer): the candidate's recompute


def run_training(plan: TrainPlan, *, out_dir: str | Path | None = None,
                 progress: Callable[[int, int], None] | None = None) -> TrainResult:
    """Train every run of `plan` in lockstep; the rows, the first divergence (its case file written
    into `out_dir`, when given), the timing and the verdict."""
    start = time.perf_counter()
    candidate = load_impl(plan.impl, form=plan.form, recipe=plan.recipe)
    against = load_impl(plan.against) if plan.against else default_reference(candidate, torch.device(plan.device).type)
    baseline = load_impl(plan.baseline)
    impls = {"candidate": candidate, "against": against, "baseline": baseline, "baseline_seed": baseline}
    models = Models.build(plan)
    runs = [build_run(role, impl, models, seed=plan.seed + (role == "baseline_seed"), plan=plan)
            for role, impl in impls.items()]
    source, micro_batches = _micro_batches(plan, models.shape)
    bitwise_required = default_policy(candidate, against) is Policy.BITWISE
    rows: list[dict] = []
    timing: list[dict] = []
    divergence, loss_differs_at, previous, crash, recompute_differs = None, None, None, None, None
    loss_scale = 1.0 / plan.grad_accum
    for step in range(plan.steps):
        sampled = plan.sampled(step)
        phases = dict.fromkeys(("train_s", "compare_s", "numerics_s"), 0.0)
        step_rows: list[dict] = []
        step_start = _clock(plan.device)
        for micro, batch in enumerate(micro_batches[step]):
            batch = batch.to(plan.device)
            begin = _clock(plan.device)
            run = runs[0]
            try:  # os._exit raises too: a run cut short must never read as a pass
                with sandbox.exits_raise():
                    for run in runs:
                        forward_backward(run, batch, loss_scale=loss_scale, device=plan.device)
            except TrainError:
                raise  # the harness cannot run this model as asked: not a finding about the implementation
            except (Exception, SystemExit) as err:  # noqa: BLE001 - an implementation that raises is a finding
                where = f" (micro-batch {micro})" if plan.grad_accum > 1 else ""
                crash = f"{run.impl.name} ({run.role}) raised at step {step}{where}: {type(err).__name__}: {err}"
                break
            compared = _clock(plan.device)
            phases["train_s"] += compared - begin
            cand, ref = runs[0], runs[1]
            bitwise = {(name, gemm): _same(cand.probes[name].results()[gemm], ref.probes[name].results()[gemm])
                       for name in cand.probes for gemm in GEMMS}
            if divergence is None:
                first = next((key for key in execution_order(cand.state.order) if not bitwise[key]), None)
                if first is not None:
                    divergence = Divergence(step, *first, micro=micro, grad_accum=plan.grad_accum)
                    if out_dir is not None:
                        divergence.case_file = _save_divergence(divergence, cand, ref, previous, plan, out_dir)
            if divergence is None:  # the operands of this call, for a case file of a divergence at the next;
                # the weight is copied at a step's last micro-batch only: before that, no optimizer step changes it
                last_micro = micro == plan.grad_accum - 1
                previous = {name: probe.operands(copy=last_micro) for name, probe in cand.probes.items()
                            if probe.call is not None and probe.call.grad_output is not None}
            recomputed = {run.role: {name: probe.recompute_bitwise() for name, probe in run.probes.items()}
                          for run in runs}
            if recompute_differs is None:
                recompute_differs = next(((step, micro, name) for name in cand.state.order
                                          if recomputed["candidate"][name] is False), None)
            numerics_start = _clock(plan.device)
            phases["compare_s"] += numerics_start - compared
            for run in runs:
                numerics = {name: gemm_numerics(probe, run.impl.recipe) for name, probe in run.probes.items()} \
                    if sampled else {}
                for name in run.probes:
                    for gemm in GEMMS:
                        step_rows.append(dict(
                            step=step, micro=micro, role=run.role, impl=run.impl.name, recipe=run.impl.recipe.name,
                            seed=run.seed, layer=name, gemm=gemm, sampled=sampled,
                            bitwise=bitwise[name, gemm] if run is cand else None,
                            recompute_bitwise=recomputed[run.role][name] if gemm == "output" else None,
                            **numerics.get(name, {}).get(gemm, {})))
            phases["numerics_s"] += _clock(plan.device) - numerics_start
        if crash is not None:
            break
        optimizer_start = _clock(plan.device)
        for run in runs:
            finish_step(run)
        if divergence is None and loss_differs_at is None and runs[0].loss != runs[1].loss:
            loss_differs_at = step
        step_end = _clock(plan.device)
        phases["train_s"] += step_end - optimizer_start
        seconds = step_end - step_start
        by_role = {run.role: run for run in runs}
        for row in step_rows:
            run = by_role[row["role"]]
            row.update(loss=run.loss, grad_norm=run.grad_norm, step_seconds=seconds)
        rows += step_rows
        timing.append(dict(step=step, sampled=sampled, seconds=seconds, **phases))
        if progress is not None:
            progress(step + 1, plan.steps)
    frame = pd.DataFrame.from_records(rows)
    timing_frame = pd.DataFrame.from_records(timing, columns=["step", "sampled", "seconds", *phases])
    total = time.perf_counter() - start
    frame.attrs["env"] = dict(
        environment(plan.device), model=plan.model, steps=plan.steps, grad_accum=plan.grad_accum,
        checkpoint=plan.checkpoint, data=plan.data, lr=plan.learning_rate,
        entropy_rate=None if source.entropy_rate is None else round(source.entropy_rate, 6), seconds=round(total, 1),
        seconds_per_step=round(float(timing_frame["seconds"].mean()), 4) if len(timing_frame) else None)
    result = TrainResult(plan, frame, source, {run.role: run.impl.name for run in runs}, bitwise_required,
                         divergence, loss_differs_at, crash, total, layers=list(runs[0].probes),
                         timing=timing_frame, recompute_differs=recompute_differs)
    result.verdict = train_verdict(result)
    return result


def _micro_batches(plan: TrainPlan, shape) -> tuple[MarkovSource | TokenFile, list[list[torch.Tensor]]]:
    """The data source and, per step, its grad_accum micro-batches (the same for every run). The
    micro-batches of a step are consecutive draws, so --grad-accum 1 trains on the batches it always did."""
    data = None if plan.data is None else TokenFile.load(plan.data, vocab_size=shape.vocab_size,
                                                         length=shape.seq_len + 1)
    source, tokens = batches(shape, plan.steps * plan.grad_accum, plan.seed, data=data)
    return source, [tokens[step * plan.grad_accum:(step + 1) * plan.grad_accum] for step in range(plan.steps)]


def _save_divergence(divergence: Divergence, cand: Run, ref: Run, previous: dict | None, plan: TrainPlan,
                     out_dir: str | Path) -> Path | None:
    """The candidate's operands of the diverging layer at this call (the input its diverging GEMM
    consumed: under checkpointing a backward GEMM's is the recompute's), and at the call before (a
    cache that goes stale after an optimizer step needs a call before), as a case file."""
    name = divergence.layer
    if cand.probes[name].call.grad_output is None:  # its output never reached the loss: no backward operands
        return None
    calls = ([previous[name]] if previous is not None and name in previous else []) \
        + [cand.probes[name].operands(divergence.gemm)]
    meta = dict(layer=name, gemm=divergence.gemm, step=divergence.step, micro=divergence.micro,
                grad_accum=plan.grad_accum, checkpoint=plan.checkpoint,
                steps=list(range(divergence.step - len(calls) + 1, divergence.step + 1)),
                impl=cand.impl.name, against=ref.impl.name, recipe=cand.impl.recipe.name, model=plan.model)
    micro = f"-micro{divergence.micro}" if plan.grad_accum > 1 else ""
    file_name = f"divergence-step{divergence.step}{micro}-{name}-{divergence.gemm}.pt"
    return write_case_file(Path(out_dir) / file_name, calls, meta=meta)


# ---- plain training: what the statistics are measured against (property_tests/train_cost.py) ------

def run_plain(plan: TrainPlan, roles: tuple[str, ...] = ROLES) -> dict:
    """The plan's runs of `roles` trained in lockstep WITHOUT probes, comparisons or numerics: each
    micro-batch's forward, backward and loss.item() (a training loop logs its loss), each step's
    optimizer step. {"seconds", "seconds_per_step", "losses" (role -> last step's loss)}."""
    candidate = load_impl(plan.impl, form=plan.form, recipe=plan.recipe)
    against = load_impl(plan.against) if plan.against else default_reference(candidate, torch.device(plan.device).type)
    baseline = load_impl(plan.baseline)
    impls = {"candidate": candidate, "against": against, "baseline": baseline, "baseline_seed": baseline}
    models = Models.build(plan)
    runs = [build_run(role, impls[role], models, seed=plan.seed + (role == "baseline_seed"), plan=plan,
                      instrument=False) for role in roles]
    _, micro_batches = _micro_batches(plan, models.shape)
    start = _clock(plan.device)
    for step in range(plan.steps):
        for batch in micro_batches[step]:
            batch = batch.to(plan.device)
            for run in runs:
                forward_backward(run, batch, loss_scale=1.0 / plan.grad_accum, device=plan.device)
        for run in runs:
            run.loss = sum(run.micro_losses) / len(run.micro_losses)
            run.micro_losses.clear()
            run.optimizer.step()
            run.optimizer.zero_grad(set_to_none=True)
    seconds = _clock(plan.device) - start
    return dict(seconds=seconds, seconds_per_step=seconds / plan.steps, losses={run.role: run.loss for run in runs})


# ---- the verdict and the report ---------------------------------------------------------------------

def losses_per_step(frame: pd.DataFrame) -> pd.DataFrame:
    """One row per (step, role) of the tidy table: the loss, seed and sampling of each run's step."""
    return frame.drop_duplicates(["step", "role"])


def loss_table(result: TrainResult) -> pd.DataFrame:
    """Per run: mean loss over the last `window` steps, its relative gap to the baseline, its excess over
    the source's entropy rate (the floor; none for --data)."""
    frame, window = result.frame, result.plan.loss_window
    steps = losses_per_step(frame)
    last = steps[steps["step"] >= result.plan.steps - window]
    mean = last.groupby("role", sort=False)["loss"].mean()
    floor = math.nan if result.source.entropy_rate is None else result.source.entropy_rate
    records = [dict(role=role, impl=result.runs[role], seed=int(steps[steps["role"] == role]["seed"].iloc[0]),
                    **{f"mean loss, last {window} steps": mean[role],
                       "gap to baseline %": 100 * (mean[role] - mean["baseline"]) / mean["baseline"],
                       "excess over floor": mean[role] - floor})
               for role in ROLES]
    return pd.DataFrame.from_records(records)


def train_verdict(result: TrainResult) -> Verdict:
    plan, details = result.plan, []
    if result.crash is not None or not len(result.frame):
        done = int(result.frame["step"].max()) + 1 if len(result.frame) else 0
        return Verdict(False, f"FAIL: {result.crash}", [f"training stopped there, after {done} complete steps"],
                       None)
    table = loss_table(result).set_index("role")
    gap_column = "gap to baseline %"
    gap = table.loc["candidate", gap_column] / 100
    noise = abs(table.loc["baseline_seed", gap_column]) / 100
    allowed = max(noise, DEEPSEEK_RELATIVE_LOSS_GAP)
    loss_ok = gap <= allowed  # a candidate that trains better than the baseline is not a finding
    details.append(f"loss over the last {plan.loss_window} steps: {result.runs['candidate']} is "
                   f"{100 * gap:+.3f}% from {result.runs['baseline']}; seed-to-seed noise of the baseline "
                   f"{100 * noise:.3f}%, DeepSeek-V3's line 0.25%: allowed {100 * allowed:.3f}%")
    if result.source.entropy_rate is not None:
        details.append(f"the loss floor (the source's entropy rate) is {result.source.entropy_rate:.4f} nats; the "
                       f"candidate ends {table.loc['candidate', 'excess over floor']:.4f} above it")
    else:
        details.append(f"no loss floor: the data ({result.source.kind} from {result.source.path}) has no known "
                       f"entropy rate")
    if result.recompute_differs is not None:
        step, micro, layer = result.recompute_differs
        where = f"step {step}" + (f", micro-batch {micro}" if plan.grad_accum > 1 else "")
        details.append(f"under --checkpoint the candidate's recompute of {layer}'s output GEMM gives other bits than "
                       f"its forward first at {where}: its backward GEMMs consume tensors the forward never made "
                       f"(state advanced between the two calls)")
    parity_ok = True
    pair = f"{result.runs['candidate']} and {result.runs['against']}"
    if result.divergence is not None:
        parity_ok = not result.bitwise_required
        where = f" (case file: {result.divergence.case_file})" if result.divergence.case_file else ""
        details.insert(0, f"{pair} first differ at {result.divergence}{where}"
                       + ("" if result.bitwise_required else "; their recipes differ, so bitwise equality is not "
                          "required"))
    elif result.loss_differs_at is not None:
        parity_ok = not result.bitwise_required
        details.insert(0, f"every GEMM of {pair} agrees bitwise, but the loss differs from step "
                       f"{result.loss_differs_at}: outside the converted layers")
    else:
        calls = f" and all {plan.grad_accum} micro-batches of each" if plan.grad_accum > 1 else ""
        details.insert(0, f"{pair} are bitwise equal in every GEMM of every layer at all {plan.steps} steps{calls}")
    if not parity_ok:
        first = result.divergence or f"the loss at step {result.loss_differs_at}"
        headline = f"FAIL: {pair} must be bitwise equal and diverge first at {first}"
    elif not loss_ok:
        headline = (f"FAIL: {result.runs['candidate']} trains {100 * gap:.3f}% worse than {result.runs['baseline']} "
                    f"over the last {plan.loss_window} steps, beyond the allowed {100 * allowed:.3f}%")
    else:
        headline = (f"PASS: {result.runs['candidate']} trains {plan.steps} steps of the {plan.model} model "
                    + ("in bitwise lockstep with " + result.runs["against"] if result.divergence is None else
                       "(its recipe differs from " + result.runs["against"] + "'s)")
                    + f", within {100 * allowed:.3f}% of {result.runs['baseline']}'s loss")
    next_step = None
    if result.divergence is not None and result.divergence.case_file is not None and not parity_ok:
        next_step = (f"fp8-parity bisect --impl {result.runs['candidate']} --against {result.runs['against']} "
                     f"--device {plan.device} --case-file {result.divergence.case_file}")
    return Verdict(bool(parity_ok and loss_ok), headline, details, next_step)
