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
from pathlib import Path
from typing import Callable

import pandas as pd
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from parity import cpu_gemm, sandbox
from parity.data import write_case_file
from parity.env import environment
from parity.impls import Impl, convert_linears, default_reference, load_impl
from parity.model import GPT, GPTConfig, MarkovSource, TokenFile, UserModelShape, batches, build_user_model
from parity.policy import Policy, default_policy
from parity.recipes import GEMMS
from parity.report import Verdict
from parity.train_calls import bisect_command, judge_case_file, judge_first_call
from parity.train_numerics import gemm_numerics
from parity.train_plan import DEEPSEEK_RELATIVE_LOSS_GAP, ROLES, Divergence, TrainError, TrainPlan, TrainResult
from parity.train_probes import LayerProbe, RunState, same




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



def _load_impls(plan: TrainPlan) -> dict[str, Impl]:
    """The implementation of each role: --impl, --against (default: its recipe's parity reference),
    --baseline twice (the second run from another seed)."""
    candidate = load_impl(plan.impl, form=plan.form, recipe=plan.recipe)
    against = load_impl(plan.against) if plan.against else default_reference(candidate, torch.device(plan.device).type)
    baseline = load_impl(plan.baseline)
    return {"candidate": candidate, "against": against, "baseline": baseline, "baseline_seed": baseline}


PHASES = ("train_s", "compare_s", "numerics_s")  # a step's time: training, bitwise comparisons, numerics


@dataclass
class _Lockstep:
    """The runs of a plan advancing together, and what their comparison found so far."""

    plan: TrainPlan
    runs: list[Run]
    out_dir: str | Path | None
    rows: list[dict] = field(default_factory=list)
    timing: list[dict] = field(default_factory=list)
    divergence: Divergence | None = None
    loss_differs_at: int | None = None
    crash: str | None = None
    recompute_differs: tuple[int, int, str] | None = None
    previous: dict | None = None  # the candidate's operands of the last call, for a divergence at the next
    first_call: tuple[str, dict] | None = None  # the first layer's operands at its first call (parity.train_calls)

    def step(self, step: int, micro_batches: list[torch.Tensor]) -> bool:
        """Train, compare and record one step (all its micro-batches), then each run's optimizer step;
        False when an implementation raised (training stops there)."""
        plan, sampled = self.plan, self.plan.sampled(step)
        phases = dict.fromkeys(PHASES, 0.0)
        step_rows: list[dict] = []
        step_start = _clock(plan.device)
        for micro, batch in enumerate(micro_batches):
            begin = _clock(plan.device)
            if not self._train(step, micro, batch.to(plan.device)):
                return False
            compared = _clock(plan.device)
            phases["train_s"] += compared - begin
            bitwise, recomputed = self._compare(step, micro)
            numerics_start = _clock(plan.device)
            phases["compare_s"] += numerics_start - compared
            step_rows += self._rows(step, micro, sampled, bitwise, recomputed)
            phases["numerics_s"] += _clock(plan.device) - numerics_start
        optimizer_start = _clock(plan.device)
        for run in self.runs:
            finish_step(run)
        if self.divergence is None and self.loss_differs_at is None and self.runs[0].loss != self.runs[1].loss:
            self.loss_differs_at = step
        step_end = _clock(plan.device)
        phases["train_s"] += step_end - optimizer_start
        seconds = step_end - step_start
        by_role = {run.role: run for run in self.runs}
        for row in step_rows:
            run = by_role[row["role"]]
            row.update(loss=run.loss, grad_norm=run.grad_norm, step_seconds=seconds)
        self.rows += step_rows
        self.timing.append(dict(step=step, sampled=sampled, seconds=seconds, **phases))
        return True

    def _train(self, step: int, micro: int, batch: torch.Tensor) -> bool:
        """Forward and backward of every run on the micro-batch; False (and the crash) when one raised."""
        run = self.runs[0]
        try:  # os._exit raises too: a run cut short must never read as a pass
            with sandbox.exits_raise():
                for run in self.runs:
                    forward_backward(run, batch, loss_scale=1.0 / self.plan.grad_accum, device=self.plan.device)
        except TrainError:
            raise  # the harness cannot run this model as asked: not a finding about the implementation
        except (Exception, SystemExit) as err:  # noqa: BLE001 - an implementation that raises is a finding
            where = f" (micro-batch {micro})" if self.plan.grad_accum > 1 else ""
            self.crash = f"{run.impl.name} ({run.role}) raised at step {step}{where}: {type(err).__name__}: {err}"
            return False
        return True

    def _compare(self, step: int, micro: int) -> tuple[dict, dict]:
        """The candidate's GEMMs against the against run's, bitwise, and each run's recompute against its
        forward; the first divergence (its case file saved) and the first recompute that differs."""
        cand, ref = self.runs[0], self.runs[1]
        bitwise = {(name, gemm): same(cand.probes[name].results()[gemm], ref.probes[name].results()[gemm])
                   for name in cand.probes for gemm in GEMMS}
        if self.divergence is None:
            first = next((key for key in execution_order(cand.state.order) if not bitwise[key]), None)
            if first is not None:
                self.divergence = Divergence(step, *first, micro=micro, grad_accum=self.plan.grad_accum)
                if self.out_dir is not None:
                    self.divergence.case_file = _save_divergence(self.divergence, cand, ref, self.previous, self.plan,
                                                                 self.out_dir)
        if self.first_call is None:
            ran = [name for name in cand.state.order if cand.probes[name].call.grad_output is not None]
            if ran:
                self.first_call = ran[0], {key: value.detach().clone()
                                           for key, value in cand.probes[ran[0]].operands().items()}
        if self.divergence is None:  # the operands of this call, for a case file of a divergence at the next;
            # the weight is copied at a step's last micro-batch only: before that, no optimizer step changes it
            last_micro = micro == self.plan.grad_accum - 1
            self.previous = {name: probe.operands(copy=last_micro) for name, probe in cand.probes.items()
                             if probe.call is not None and probe.call.grad_output is not None}
        recomputed = {run.role: {name: probe.recompute_bitwise() for name, probe in run.probes.items()}
                      for run in self.runs}
        if self.recompute_differs is None:
            self.recompute_differs = next(((step, micro, name) for name in cand.state.order
                                           if recomputed["candidate"][name] is False), None)
        return bitwise, recomputed

    def _rows(self, step: int, micro: int, sampled: bool, bitwise: dict, recomputed: dict) -> list[dict]:
        """One row per run, layer and GEMM of the micro-batch, with the numerics at a sampled step."""
        rows = []
        for run in self.runs:
            numerics = {name: gemm_numerics(probe, run.impl.recipe) for name, probe in run.probes.items()} \
                if sampled else {}
            for name in run.probes:
                for gemm in GEMMS:
                    rows.append(dict(
                        step=step, micro=micro, role=run.role, impl=run.impl.name, recipe=run.impl.recipe.name,
                        seed=run.seed, layer=name, gemm=gemm, sampled=sampled,
                        bitwise=bitwise[name, gemm] if run is self.runs[0] else None,
                        recompute_bitwise=recomputed[run.role][name] if gemm == "output" else None,
                        **numerics.get(name, {}).get(gemm, {})))
        return rows


def run_training(plan: TrainPlan, *, out_dir: str | Path | None = None,
                 progress: Callable[[int, int], None] | None = None) -> TrainResult:
    """Train every run of `plan` in lockstep; the rows, the first divergence (its case file written
    into `out_dir`, when given), the timing and the verdict."""
    start = time.perf_counter()
    impls = _load_impls(plan)
    models = Models.build(plan)
    runs = [build_run(role, impl, models, seed=plan.seed + (role == "baseline_seed"), plan=plan)
            for role, impl in impls.items()]
    source, micro_batches = _micro_batches(plan, models.shape)
    bitwise_required = default_policy(impls["candidate"], impls["against"]) is Policy.BITWISE
    lockstep = _Lockstep(plan, runs, out_dir)
    for step in range(plan.steps):
        if not lockstep.step(step, micro_batches[step]):
            break
        if progress is not None:
            progress(step + 1, plan.steps)
    frame = pd.DataFrame.from_records(lockstep.rows)
    timing_frame = pd.DataFrame.from_records(lockstep.timing, columns=["step", "sampled", "seconds", *PHASES])
    total = time.perf_counter() - start
    frame.attrs["env"] = dict(
        environment(plan.device), model=plan.model, steps=plan.steps, grad_accum=plan.grad_accum,
        checkpoint=plan.checkpoint, data=plan.data, lr=plan.learning_rate,
        entropy_rate=None if source.entropy_rate is None else round(source.entropy_rate, 6), seconds=round(total, 1),
        seconds_per_step=round(float(timing_frame["seconds"].mean()), 4) if len(timing_frame) else None)
    result = TrainResult(plan, frame, source, {run.role: run.impl.name for run in runs}, bitwise_required,
                         lockstep.divergence, lockstep.loss_differs_at, lockstep.crash, total,
                         layers=list(runs[0].probes), timing=timing_frame, recompute_differs=lockstep.recompute_differs)
    result.finding, result.calls_case_file = _finding(plan, impls, lockstep, out_dir)
    result.verdict = train_verdict(result)
    return result


def _finding(plan: TrainPlan, impls: dict[str, Impl], lockstep: _Lockstep,
             out_dir: str | Path | None) -> tuple[str | None, Path | None]:
    """check's finding on the first divergence's case file, or, where the runs never parted, on the first
    layer's first call (with its case file, kept where check found something): parity.train_calls."""
    candidate, against = impls["candidate"], impls["against"]
    if lockstep.crash is not None or not candidate.recipe.is_fp8:
        return None, None
    if lockstep.divergence is not None:
        if lockstep.divergence.case_file is None:
            return None, None
        return judge_case_file(candidate, against, lockstep.divergence.case_file, plan.device), None
    if lockstep.loss_differs_at is not None or lockstep.first_call is None:
        return None, None
    layer, operands = lockstep.first_call
    meta = dict(impl=candidate.name, against=against.name, recipe=candidate.recipe.name, model=plan.model)
    return judge_first_call(candidate, against, layer, operands, plan.device, out_dir, meta)


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


# ---- plain training: what the statistics are measured against (evals/scoring/train_cost.py) ------

def run_plain(plan: TrainPlan, roles: tuple[str, ...] = ROLES) -> dict:
    """The plan's runs of `roles` trained in lockstep WITHOUT probes, comparisons or numerics: each
    micro-batch's forward, backward and loss.item() (a training loop logs its loss), each step's
    optimizer step. {"seconds", "seconds_per_step", "losses" (role -> last step's loss)}."""
    impls = _load_impls(plan)
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
    if result.finding is not None:  # check's words for what the diverging (or first) GEMM was handed
        details.insert(0, f"finding: {result.finding}")
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
    calls_differ = result.divergence is None and result.finding is not None  # parity.train_calls
    if calls_differ:
        parity_ok = False
        where = f" (case file: {result.calls_case_file})" if result.calls_case_file else ""
        details.insert(1, f"check's comparisons of the first layer's first call{where} find what the numbers here "
                          f"do not show")
        headline = (f"FAIL: {result.runs['candidate']}'s _scaled_mm calls are not the {_candidate_recipe(result)} "
                    f"recipe's, though it trains in bitwise lockstep with {result.runs['against']} on {plan.device}")
    elif not parity_ok:
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
    case_file = result.calls_case_file if calls_differ else result.divergence and result.divergence.case_file
    next_step = None
    if case_file is not None and not parity_ok:
        next_step = bisect_command(result.runs["candidate"], result.runs["against"], plan.device, case_file,
                                   recipe=plan.recipe, form=plan.form)
    return Verdict(bool(parity_ok and loss_ok), headline, details, next_step)


def _candidate_recipe(result: TrainResult) -> str:
    """The candidate's recipe, as its rows name it."""
    rows = result.frame[result.frame["role"] == "candidate"]
    return str(rows["recipe"].iloc[0]) if len(rows) else "its"
