"""`fp8-parity train`: parity over real training steps, per-layer numerics, and the first diverging GEMM.

A layer that is bitwise equal to its reference on one call can still drift in training: state kept
across steps (an fp8 weight cached and never invalidated after the optimizer step), a converter
that leaves a layer in bf16, scales that meet real activations and gradients. This module trains
the same model several ways IN LOCKSTEP and compares them GEMM by GEMM at every step.

The runs (each a parity.model.GPT from parity.model's synthetic language, so nothing is downloaded):

    candidate      --impl, every nn.Linear converted through its plug-in form (Impl.build, with
                   the layer's name, so a converter's module filter sees the real fqn)
    against        the implementation the candidate must agree with (default: its recipe's
                   parity reference, torchao's implementation of it)
    baseline       --baseline (default bf16): what FP8 training is measured against
    baseline seed  the baseline again from another init seed: the seed-to-seed noise

All four start from weights drawn from one seed (the fourth from seed + 1), train on the same
batches with the same optimizer, and advance one step at a time together: forward, backward, then
the comparisons, then each run's optimizer step. Each converted layer sits inside a probe that
keeps, for the step, its input, output, grad_output and grad_input (identity autograd functions on
either side of the layer catch the gradients), and its weight and weight gradient. So at every step
the three GEMMs of every layer (output, grad_input, grad_weight) of the candidate are compared
bitwise with the against run's. While the runs agree bitwise their inputs are identical too, so
the FIRST (step, layer, GEMM) that differs, in execution order (forward through the layers, then
backward in reverse), is where the implementations part: later differences are consequences.
That GEMM's operands are saved as a case file (parity.data.write_case_file: this call and the one
before it, so a stale cache shows again), which `fp8-parity check --case-file` and `fp8-parity
bisect --case-file` judge and diagnose exactly.

Every `sample_every` steps (to bound the cost) each run's GEMMs get numerics: SQNR against a float64
shadow GEMM computed on the same operands (the run's own, so it measures this layer's rounding, not
the drift of the trajectory), and for each operand its amax and, under the run's recipe scaling
(parity.oracles.quantize, the same emulation the oracles use), the share of non-zero values that
quantize to zero (underflow) and the share that land on the fp8 format's largest magnitude
(saturated: under dynamic scaling the amax lands there by construction, so this is the share
within one fp8 step of the amax; a wrong or stale scale shows as many more).

The loss is judged over the last `window` steps: the candidate's relative gap to the baseline,
against the baseline's own seed-to-seed gap, with DeepSeek-V3's 0.25% (the relative loss error it
reports for FP8 against BF16 training) as the reference line.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable

import pandas as pd
import torch
import torch.nn.functional as F
from torch import nn

from parity import cpu_gemm, oracles, sandbox
from parity.data import write_case_file
from parity.env import environment
from parity.metrics import sqnr_db
from parity.impls import Impl, default_reference, load_impl
from parity.model import GPT, GPTConfig, MarkovSource, ModelError, batches, get_model_config
from parity.policy import Policy, default_policy
from parity.recipes import GEMMS
from parity.report import Verdict, write_report

# DeepSeek-V3 (arXiv 2412.19437, section 3.3): FP8 training's relative loss error against BF16
# "consistently remains below 0.25%". A reference line, drawn in the report and used as the floor
# of the allowed gap: below it a gap passes even when the seed-to-seed noise happens to be smaller.
DEEPSEEK_RELATIVE_LOSS_GAP = 0.0025
# The step's learning rate. AdamW at 1e-2 takes the tiny model from ln(64) = 4.2 nats to within
# a fraction of a nat of the source's entropy rate in 50 steps: the loss still moves at the end,
# so a gap between implementations is a gap in how they train, not two flat lines.
LEARNING_RATE = 1e-2
ROLES = ("candidate", "against", "baseline", "baseline_seed")
DEFAULT_BASELINE = "bf16"


class TrainError(ValueError):
    """A training comparison that cannot run as asked; the message says what and how to fix it."""


@dataclass(frozen=True)
class TrainPlan:
    """What `fp8-parity train` runs. `window`: steps at the end whose mean loss is judged (default:
    the last fifth, at least one: long enough to average out batch-to-batch noise, short enough to
    be the end of training). `sample_every`: the steps whose numerics are computed (and the last)."""

    impl: str
    against: str | None = None  # None: the candidate recipe's parity reference
    baseline: str = DEFAULT_BASELINE
    model: str = "tiny"
    steps: int = 50
    device: str = "cpu"
    seed: int = 0
    sample_every: int = 5
    window: int | None = None
    lr: float = LEARNING_RATE
    form: str | None = None
    recipe: str | None = None

    def __post_init__(self):
        if self.steps < 1:
            raise TrainError(f"steps = {self.steps}: train at least one step (e.g. --steps 50)")
        if self.sample_every < 1:
            raise TrainError(f"sample_every = {self.sample_every} must be at least 1 (1: numerics at every step)")
        if self.window is not None and not 1 <= self.window <= self.steps:
            raise TrainError(f"window = {self.window} must be from 1 to steps = {self.steps}")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise TrainError(f"lr = {self.lr} must be a positive finite number (e.g. {LEARNING_RATE})")
        try:
            get_model_config(self.model)
        except ModelError as err:
            raise TrainError(str(err)) from None

    @property
    def config(self) -> GPTConfig:
        return get_model_config(self.model)

    @property
    def loss_window(self) -> int:
        return self.window or max(1, self.steps // 5)

    def sampled(self, step: int) -> bool:
        return step % self.sample_every == 0 or step == self.steps - 1


# ---- probes: what one converted layer did in the current step ------------------------------------

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


class LayerProbe(nn.Module):
    """A converted linear layer and what it saw this step: input, output, grad_output, grad_input
    (grad_weight is its weight's .grad)."""

    def __init__(self, name: str, layer: nn.Module, weight: nn.Parameter, order: list[str]):
        super().__init__()
        self.layer, self.name = layer, name
        self._weight, self._order = [weight], order  # in lists: not registered a second time
        self.seen: dict[str, torch.Tensor] = {}

    @property
    def weight_param(self) -> nn.Parameter:
        return self._weight[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._order.append(self.name)
        self.seen = {"input": x.detach()}
        output = self.layer(_GradTap.apply(x, partial(self.seen.__setitem__, "grad_input")))
        self.seen["output"] = output.detach()
        return _GradTap.apply(output, partial(self.seen.__setitem__, "grad_output"))

    def results(self) -> dict[str, torch.Tensor]:
        """The three GEMMs' results of the step (after backward)."""
        return {"output": self.seen["output"], "grad_input": self.seen.get("grad_input"),
                "grad_weight": self.weight_param.grad}

    def operands(self, *, copy: bool = False) -> dict[str, torch.Tensor]:
        """input, weight (its value this step), grad_output; `copy` before the optimizer changes the weight."""
        weight = self.weight_param.detach()
        return {"input": self.seen["input"], "weight": weight.clone() if copy else weight,
                "grad_output": self.seen["grad_output"]}


@dataclass
class Run:
    """One implementation's model in the lockstep."""

    role: str
    impl: Impl
    seed: int
    model: GPT
    optimizer: torch.optim.Optimizer
    probes: dict[str, LayerProbe]
    order: list[str]  # the probes' names in the order their forwards ran this step
    loss: float = math.nan
    grad_norm: float = math.nan


def linear_names(model: nn.Module) -> list[str]:
    return [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]


def build_run(role: str, impl: Impl, config: GPTConfig, *, seed: int, device: str, lr: float) -> Run:
    """The model from `seed`, its linears converted by `impl` (Impl.build) inside probes, and its optimizer."""
    config.check_alignment(impl.recipe.alignment, why=f"the {impl.recipe.name} recipe of {impl.name}")
    model = GPT(config).init_weights(seed).to(device=device, dtype=impl.compute_dtype or torch.bfloat16)
    order: list[str] = []
    probes = {}
    for name in linear_names(model):
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        layer, weight, _ = impl.build(getattr(parent, leaf), name=name)
        probes[name] = LayerProbe(name, layer, weight, order)
        setattr(parent, leaf, probes[name])
    # AdamW: nanochat trains its embeddings and head with it; deterministic, state per parameter
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0, foreach=False)
    return Run(role, impl, seed, model, optimizer, probes, order)


def forward_backward(run: Run, tokens: torch.Tensor) -> None:
    run.optimizer.zero_grad(set_to_none=True)
    run.order.clear()
    logits = run.model(tokens[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    loss.backward()
    run.loss = loss.item()
    grads = [p.grad.detach().float().pow(2).sum() for p in run.model.parameters() if p.grad is not None]
    run.grad_norm = math.sqrt(float(torch.stack(grads).sum()))


# ---- numerics -----------------------------------------------------------------------------------

def shadow_gemms(input_2d: torch.Tensor, weight: torch.Tensor, grad_output_2d: torch.Tensor) -> dict:
    """The three GEMMs in float64 on the same operands."""
    x, w, g = (t.to(torch.float64) for t in (input_2d, weight, grad_output_2d))
    return {"output": x @ w.t(), "grad_input": g @ w, "grad_weight": g.t() @ x}


def operand_stats(values: torch.Tensor, cast, pow2: bool) -> dict:
    """amax, and under the cast's scaling, % of non-zero values quantized to zero and % on the fp8 max."""
    amax = values.abs().max().item() if values.numel() else 0.0
    if cast.fp8 is None:  # a high-precision operand: nothing is quantized
        return dict(amax=amax, underflow_pct=math.nan, saturated_pct=math.nan)
    quantized = oracles.quantize(values, cast, pow2=pow2).values
    nonzero = values != 0
    count = max(int(nonzero.sum()), 1)
    fp8_max = oracles.FORMATS[cast.dtype].max
    return dict(amax=amax, underflow_pct=100.0 * int((nonzero & (quantized == 0)).sum()) / count,
                saturated_pct=100.0 * int((nonzero & (quantized.abs() == fp8_max)).sum()) / count)


def gemm_numerics(probe: LayerProbe, recipe) -> dict[str, dict]:
    """Per GEMM: the SQNR against the float64 shadow and the stats of its two operands (a, b)."""
    ops = probe.operands()
    input_2d = ops["input"].reshape(-1, ops["input"].shape[-1])
    grad_output_2d = ops["grad_output"].reshape(-1, ops["grad_output"].shape[-1])
    shadows = shadow_gemms(input_2d, ops["weight"], grad_output_2d)
    views = oracles.operand_views(input_2d, ops["weight"], grad_output_2d)
    results = probe.results()
    numerics = {}
    for gemm_name in GEMMS:
        gemm = recipe.gemm(gemm_name)
        got = results[gemm_name]
        row = {"sqnr_db": math.nan if got is None else sqnr_db(got.reshape(shadows[gemm_name].shape),
                                                                shadows[gemm_name])}
        for side, operand, values, cast in zip("ab", gemm.operands, views[gemm_name], (gemm.a, gemm.b)):
            stats = operand_stats(values.cpu(), cast, recipe.pow2_scales)
            row.update({f"{side}_operand": operand, **{f"{side}_{key}": value for key, value in stats.items()}})
        numerics[gemm_name] = row
    return numerics


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return a is not None and b is not None and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def execution_order(forward_order: list[str]) -> list[tuple[str, str]]:
    """(layer, GEMM) in the order they run: each layer's output in forward order, then backward in
    reverse layer order, grad_input before grad_weight."""
    return ([(name, "output") for name in forward_order]
            + [(name, gemm) for name in reversed(forward_order) for gemm in ("grad_input", "grad_weight")])


# ---- the lockstep ---------------------------------------------------------------------------------

@dataclass
class Divergence:
    """The first (step, layer, GEMM) where the candidate differs from the against run."""

    step: int
    layer: str
    gemm: str
    case_file: Path | None = None

    def __str__(self) -> str:
        return f"step {self.step}, layer {self.layer}, GEMM {self.gemm}"


@dataclass
class TrainResult:
    plan: TrainPlan
    frame: pd.DataFrame  # tidy: one row per step x run x layer x GEMM
    source: MarkovSource
    runs: dict[str, str]  # role -> implementation name
    bitwise_required: bool
    divergence: Divergence | None = None
    loss_differs_at: int | None = None  # a step whose loss differs while every GEMM agreed
    crash: str | None = None  # an implementation that raised: where, and its exception (training stops there)
    seconds: float = 0.0
    verdict: Verdict | None = None


def run_training(plan: TrainPlan, *, out_dir: str | Path | None = None,
                 progress: Callable[[int, int], None] | None = None) -> TrainResult:
    """Train every run of `plan` in lockstep; the rows, the first divergence (its case file written
    into `out_dir`, when given) and the verdict."""
    start = time.perf_counter()
    config = plan.config
    candidate = load_impl(plan.impl, form=plan.form, recipe=plan.recipe)
    against = load_impl(plan.against) if plan.against else default_reference(candidate, torch.device(plan.device).type)
    baseline = load_impl(plan.baseline)
    impls = {"candidate": candidate, "against": against, "baseline": baseline, "baseline_seed": baseline}
    source, tokens = batches(config, plan.steps, plan.seed)
    runs = [build_run(role, impl, config, seed=plan.seed + (role == "baseline_seed"), device=plan.device, lr=plan.lr)
            for role, impl in impls.items()]
    bitwise_required = default_policy(candidate, against) is Policy.BITWISE
    rows: list[dict] = []
    divergence, loss_differs_at, previous, crash = None, None, None, None
    fast_cpu_gemm = plan.device == "cpu" and cpu_gemm.enabled()  # torch's CPU _scaled_mm is slow (cpu_gemm)
    with cpu_gemm.FastScaledMM() if fast_cpu_gemm else contextlib.nullcontext():
        for step, batch in enumerate(tokens):
            batch = batch.to(plan.device)
            try:  # os._exit raises too: a run cut short must never read as a pass
                with sandbox.exits_raise():
                    for run in runs:
                        forward_backward(run, batch)
            except (Exception, SystemExit) as err:  # noqa: BLE001 - an implementation that raises is a finding
                crash = f"{run.impl.name} ({run.role}) raised at step {step}: {type(err).__name__}: {err}"
                break
            cand, ref = runs[0], runs[1]
            bitwise = {(name, gemm): _same(cand.probes[name].results()[gemm], ref.probes[name].results()[gemm])
                       for name in cand.probes for gemm in GEMMS}
            if divergence is None:
                first = next((key for key in execution_order(cand.order) if not bitwise[key]), None)
                if first is not None:
                    divergence = Divergence(step, *first)
                    if out_dir is not None:
                        divergence.case_file = _save_divergence(divergence, cand, ref, previous, plan, out_dir)
                elif loss_differs_at is None and cand.loss != ref.loss:
                    loss_differs_at = step
            if divergence is None:  # the operands of this call, for a case file of a divergence at the next
                previous = {name: probe.operands(copy=True) for name, probe in cand.probes.items()}
            sampled = plan.sampled(step)
            for run in runs:
                numerics = {name: gemm_numerics(probe, run.impl.recipe) for name, probe in run.probes.items()} \
                    if sampled else {}
                for name in run.probes:
                    for gemm in GEMMS:
                        rows.append(dict(step=step, role=run.role, impl=run.impl.name, recipe=run.impl.recipe.name,
                                         seed=run.seed, layer=name, gemm=gemm, loss=run.loss,
                                         grad_norm=run.grad_norm, sampled=sampled,
                                         bitwise=bitwise[name, gemm] if run is cand else None,
                                         **numerics.get(name, {}).get(gemm, {})))
            for run in runs:
                run.optimizer.step()
            if progress is not None:
                progress(step + 1, plan.steps)
    frame = pd.DataFrame.from_records(rows)
    frame.attrs["env"] = dict(environment(plan.device), model=plan.model, steps=plan.steps,
                              entropy_rate=round(source.entropy_rate, 6), seconds=round(time.perf_counter() - start, 1))
    result = TrainResult(plan, frame, source, {run.role: run.impl.name for run in runs}, bitwise_required,
                         divergence, loss_differs_at, crash, time.perf_counter() - start)
    result.verdict = train_verdict(result)
    return result


def _save_divergence(divergence: Divergence, cand: Run, ref: Run, previous: dict | None, plan: TrainPlan,
                     out_dir: str | Path) -> Path:
    """The candidate's operands of the diverging layer at this step, and at the step before (a cache
    that goes stale after an optimizer step needs a call before), as a case file."""
    name = divergence.layer
    calls = ([previous[name]] if previous is not None else []) + [cand.probes[name].operands()]
    meta = dict(layer=name, gemm=divergence.gemm, step=divergence.step,
                steps=list(range(divergence.step - len(calls) + 1, divergence.step + 1)),
                impl=cand.impl.name, against=ref.impl.name, recipe=cand.impl.recipe.name, model=plan.model)
    file_name = f"divergence-step{divergence.step}-{name}-{divergence.gemm}.pt"
    return write_case_file(Path(out_dir) / file_name, calls, meta=meta)


# ---- the verdict and the report ---------------------------------------------------------------------

def loss_table(result: TrainResult) -> pd.DataFrame:
    """Per run: mean loss over the last `window` steps, its relative gap to the baseline, its excess over
    the source's entropy rate (the floor)."""
    frame, window = result.frame, result.plan.loss_window
    per_step = frame.drop_duplicates(["step", "role"])
    last = per_step[per_step["step"] >= result.plan.steps - window]
    mean = last.groupby("role", sort=False)["loss"].mean()
    floor = result.source.entropy_rate
    records = [dict(role=role, impl=result.runs[role], seed=int(per_step[per_step["role"] == role]["seed"].iloc[0]),
                    **{f"mean loss, last {window} steps": mean[role],
                       "gap to baseline %": 100 * (mean[role] - mean["baseline"]) / mean["baseline"],
                       "excess over floor": mean[role] - floor})
               for role in ROLES]
    return pd.DataFrame.from_records(records)


def train_verdict(result: TrainResult) -> Verdict:
    plan, details = result.plan, []
    if result.crash is not None:
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
    details.append(f"the loss floor (the source's entropy rate) is {result.source.entropy_rate:.4f} nats; the "
                   f"candidate ends {table.loc['candidate', 'excess over floor']:.4f} above it")
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
        details.insert(0, f"{pair} are bitwise equal in every GEMM of every layer at all {plan.steps} steps")
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


def bitwise_table(result: TrainResult) -> pd.DataFrame:
    rows = result.frame[result.frame["role"] == "candidate"]
    grouped = rows.groupby("gemm", sort=False)
    differing = rows[~rows["bitwise"].astype(bool)].groupby("gemm", sort=False)["step"].min()
    return pd.DataFrame({"layer x steps": grouped.size(), "bitwise %": grouped["bitwise"].mean().mul(100).round(2),
                         "first step differing": differing}).reset_index()


def numerics_table(result: TrainResult, role: str = "candidate") -> pd.DataFrame:
    rows = result.frame[(result.frame["role"] == role) & result.frame["sampled"]]
    grouped = rows.groupby(["layer", "gemm"], sort=False)
    return pd.DataFrame({
        "min SQNR dB": grouped["sqnr_db"].min().round(2), "median SQNR dB": grouped["sqnr_db"].median().round(2),
        "max amax a": grouped["a_amax"].max(), "max underflow % a": grouped["a_underflow_pct"].max().round(3),
        "max saturated % a": grouped["a_saturated_pct"].max().round(3), "max amax b": grouped["b_amax"].max(),
        "max underflow % b": grouped["b_underflow_pct"].max().round(3),
        "max saturated % b": grouped["b_saturated_pct"].max().round(3),
    }).reset_index()


def curve_table(result: TrainResult) -> pd.DataFrame:
    per_step = result.frame.drop_duplicates(["step", "role"])
    sampled = per_step[per_step["sampled"]]
    return sampled.pivot(index="step", columns="role", values="loss")[list(ROLES)].round(5).reset_index()


def plot_loss(fig, result: TrainResult) -> None:
    axes = fig.add_subplot()
    per_step = result.frame.drop_duplicates(["step", "role"])
    for role in ROLES:
        rows = per_step[per_step["role"] == role]
        axes.plot(rows["step"], rows["loss"], label=f"{role}: {result.runs[role]}")
    axes.axhline(result.source.entropy_rate, color="gray", linestyle="--", label="entropy rate (floor)")
    axes.set_xlabel("step")
    axes.set_ylabel("loss (nats)")
    axes.legend()


def write_train_report(result: TrainResult, out_dir: str | Path) -> list[Path]:
    """results.csv.gz, env.json, loss.png, summary.md and index.html, through parity.report's one writer."""
    plan = result.plan
    title = f"fp8-parity train: {result.runs['candidate']}, {plan.model} model, {plan.steps} steps on {plan.device}"
    if result.crash is not None:  # what ran before the crash, and the crash
        crash = pd.DataFrame.from_records([dict(finding=result.crash)])
        frame = result.frame if len(result.frame) else crash
        return write_report(frame, out_dir, title=title, verdict=result.verdict, plots=False,
                            tables=[("Crash", "the implementation raised; training stopped at that step", crash)])
    tables = [
        ("Loss", f"mean over the last {plan.loss_window} steps; the floor is the source's entropy rate "
                 f"{result.source.entropy_rate:.4f} nats", loss_table(result)),
        (f"Bitwise equality with {result.runs['against']}", "every layer's GEMM at every step", bitwise_table(result)),
        (f"Numerics of {result.runs['candidate']} per layer and GEMM", f"steps sampled every {plan.sample_every}; "
         "SQNR against a float64 GEMM on the same operands; a/b: the GEMM's two operands; underflow: non-zero "
         "values quantized to zero; saturated: values on the fp8 max", numerics_table(result)),
        ("Loss at the sampled steps", None, curve_table(result)),
    ]
    return write_report(result.frame, out_dir, title=title, verdict=result.verdict, tables=tables, plots=False,
                        extra_plots={"loss.png": partial(plot_loss, result=result)})
