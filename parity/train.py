"""`fp8-parity train`: parity over real training steps, per-layer numerics, and the first diverging GEMM.

A layer that is bitwise equal to its reference on one call can still drift in training: state kept
across steps (an fp8 weight cached and never invalidated after the optimizer step, a scale taken
from the previous call's amax), state kept across the calls of one step (an amax taken once per
optimizer step under gradient accumulation, a scaling history that the recompute of activation
checkpointing advances), a converter that leaves a layer in bf16, scales that meet real activations
and gradients. This module trains the same model several ways IN LOCKSTEP and compares them GEMM by
GEMM at every call.

Each run lives in its own worker process (parity.worker, through parity.train_worker): it builds its
model there (your --model factory runs there), loads and converts its implementation there, and
answers each micro-batch and optimizer step in plain data. This process never imports your code: it
keeps the lockstep, compares, judges and writes the case file and the report. A run that raises,
exits the process (with any code, through posix._exit too), is killed, runs past its time limit
(--timeout, per call: one run's micro-batch or optimizer step) or changes torch's global state is a
finding that names the run, the step and the phase; Ctrl-C or SIGTERM stops training within about a
second and keeps the steps that finished (the report is headed INCOMPLETE).

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
run's (through fingerprints of every bit, and a divergence confirmed on the tensors themselves:
parity.train_worker says why). While the runs agree bitwise their inputs are identical too, so the FIRST (step,
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

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pandas as pd
import torch

from parity import train_worker
from parity.data import write_case_file
from parity.env import environment
from parity.exits import handled_stop
from parity.impls import ImplError, default_reference, load_impl
from parity.model import GPTConfig, MarkovSource, ModelError, TokenFile, UserModelShape, batches
from parity.policy import Policy, default_policy
from parity.recipes import GEMMS
from parity.train_calls import judge_case_file, judge_first_call
from parity.train_plan import ROLES, Divergence, RunImpl, TrainError, TrainPlan, TrainResult
from parity.train_probes import Call, same
from parity.train_run import build_run, forward_backward, initial_model
from parity.train_verdict import loss_table, losses_per_step, train_verdict  # noqa: F401 - the report's, from here
from parity.worker import Died, Worker, prestart, torch_device_type

PHASES = ("train_s", "compare_s", "numerics_s")  # a step's time: training, bitwise comparisons, numerics
COMPARED = ("candidate", "against")  # the runs whose GEMMs are compared bitwise

# Time limits of a run's calls in its worker. Building a run imports torch's and torchao's modules the
# fork server has not (tens of seconds on a loaded two-core machine), your code, draws the initial
# weights and converts the model: BUILD_S (or --timeout, where larger). A micro-batch or an optimizer
# step: CALL_FLOOR_S for first-call kernel setup (torchao's first conversion imports inductor's code
# generators), plus the call's multiply-adds at a pessimistic rate (parity.worker.default_time_limit's:
# float64 emulations on a 2-core CPU run about 1e9 a second, an H200 1e12, with its margin of 40x): per
# parameter and token, 3 of training, 1 of a checkpoint recompute and 3 of the float64 shadow GEMMs at a
# sampled step.
BUILD_S = 300.0
CALL_FLOOR_S = 120.0
MULTIPLY_ADDS_PER_PARAMETER_AND_TOKEN = 7


def default_time_limit(matmul_params: int, tokens_per_micro_batch: int, device_type: str) -> float:
    """Seconds one run's micro-batch (or optimizer step) may take."""
    rate = 1e12 if device_type == "cuda" else 1e9
    return CALL_FLOOR_S + 40 * MULTIPLY_ADDS_PER_PARAMETER_AND_TOKEN * matmul_params * tokens_per_micro_batch / rate


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


def _usage_error(usage: dict) -> Exception:
    """The usage error a worker found, raised again here (exit 2)."""
    kind = {"impl": ImplError, "model": ModelError}.get(usage["kind"], TrainError)
    return kind(usage["message"])


# ---- the lockstep ---------------------------------------------------------------------------------

@dataclass
class _RemoteRun:
    """One run of the lockstep, living in its worker: what this process knows of it."""

    role: str
    seed: int
    worker: Worker
    name: str = ""  # its implementation's name (the spec it was asked to load, until the worker answers)
    impl: RunImpl | None = None
    layers: list[str] = field(default_factory=list)
    loss: float = math.nan
    grad_norm: float = math.nan
    state_changed: bool = False  # its first change of torch's global state is a finding; later ones repeat it


@dataclass
class _Lockstep:
    """The runs of a plan advancing together, and what their comparison found so far."""

    plan: TrainPlan
    runs: list[_RemoteRun]
    out_dir: str | Path | None
    timeout: float | None = None  # --timeout: each call's limit
    time_limit: float = BUILD_S  # the limit of a micro-batch or an optimizer step, set once the runs are built
    harness_limit: float = BUILD_S  # the harness's own work on a micro-batch (fingerprints, numerics): the default
    rows: list[dict] = field(default_factory=list)
    timing: list[dict] = field(default_factory=list)
    divergence: Divergence | None = None
    loss_differs_at: int | None = None
    crash: str | None = None
    recompute_differs: tuple[int, int, str] | None = None
    state_changes: list[str] = field(default_factory=list)
    interrupted: str | None = None
    first_call: tuple[str, dict] | None = None  # the first layer's operands at its first call (parity.train_calls)
    first_call_sought: bool = False

    def call(self, run: _RemoteRun, fn: Callable, *args, at: str, time_limit: float | None = None,
             **kwargs) -> dict | None:
        """fn(*args, **kwargs) in the run's worker: its reply, or None when the run raised, died or ran
        past its time limit (self.crash says which, where). A usage error is raised again here."""
        reply = run.worker.call(fn, *args, time_limit=time_limit or self.time_limit, **kwargs)
        if isinstance(reply, Died):
            printed = f" (its last output: {reply.output!r})" if reply.output else ""
            self.crash = f"{run.name} ({run.role}) {reply.what} during {reply.phase or at}{printed}"
            return None
        changes = reply.get("state_changes")
        if changes and not run.state_changed:
            run.state_changed = True
            self.state_changes.append(f"{run.name} ({run.role}) changed global state during {at}: "
                                      f"{'; '.join(changes)} (restored)")
        if "usage" in reply:
            raise _usage_error(reply["usage"])
        if "crash" in reply:
            self.crash = f"{run.name} ({run.role}) raised at {at}: {reply['crash']}"
            return None
        return reply

    # ---- building the runs

    def start(self) -> GPTConfig | UserModelShape | None:
        """Build every run in its worker (the candidate first: its recipe names the default --against);
        the shape of the data, or None when a run crashed or died while being built."""
        plan = self.plan
        candidate, against, baseline, baseline_seed = self.runs
        built = self._build(candidate, (plan.impl, plan.form, plan.recipe))
        if built is None:
            return None
        against_name = plan.against or built["impl"]["default_against"]
        replies = [built]
        for run, spec in ((against, against_name), (baseline, plan.baseline), (baseline_seed, plan.baseline)):
            replies.append(self._build(run, (spec, None, None)))
            if replies[-1] is None:
                return None
        matmul_params = built["matmul_params"]
        if built["shape"] is None:
            shape = plan.config
        else:
            shape = UserModelShape(**built["shape"])
            if len({reply["digest"] for reply in replies[:3]}) > 1:
                raise ModelError(f"--model {plan.model!r}: the factory gave other initial weights in two calls under "
                                 f"torch.manual_seed({plan.seed}): draw them from torch's global generator, so that "
                                 f"every run starts from the same model")
        default = default_time_limit(matmul_params, shape.batch_size * shape.seq_len, torch_device_type(plan.device))
        self.time_limit = self.timeout or default
        self.harness_limit = max(default, self.time_limit)
        return shape

    def _build(self, run: _RemoteRun, spec: tuple[str, str | None, str | None]) -> dict | None:
        plan = self.plan
        run.name = spec[0]
        setup = dict(role=run.role, impl=spec, model=plan.model, seed=run.seed, device=plan.device,
                     checkpoint=plan.checkpoint, learning_rate=plan.learning_rate)
        reply = self.call(run, train_worker.start_run, setup, at="building the run",
                          time_limit=max(BUILD_S, self.timeout or 0.0))
        if reply is not None:
            run.impl, run.layers = RunImpl.from_reply(reply["impl"]), reply["layers"]
            run.name = run.impl.name
        return reply

    # ---- one step

    def _keeps_previous(self, run: _RemoteRun) -> bool:
        """Whether the run's worker keeps the operands of each call for the next one's case file."""
        return run.role == "candidate" and self.divergence is None and self.out_dir is not None

    def step(self, step: int, micro_batches: list[torch.Tensor]) -> bool:
        """Train, compare and record one step (all its micro-batches), then each run's optimizer step;
        False when a run raised, died or ran out of time (training stops there)."""
        plan, sampled = self.plan, self.plan.sampled(step)
        phases = dict.fromkeys(PHASES, 0.0)
        step_rows: list[dict] = []
        step_start = time.perf_counter()
        for micro, batch in enumerate(micro_batches):
            at = f"step {step}" + (f", micro-batch {micro}" if plan.grad_accum > 1 else "")
            begin = time.perf_counter()
            replies = {}
            for run in self.runs:
                trained = self.call(run, train_worker.micro_batch, batch, at=at, where=at,
                                    loss_scale=1.0 / plan.grad_accum, first_micro=micro == 0,
                                    keep_previous=self._keeps_previous(run))
                measured = trained and self.call(run, train_worker.measure, at=at, time_limit=self.harness_limit,
                                                 where=at, results=run.role in COMPARED, recompute=plan.checkpoint,
                                                 sampled=sampled)
                if measured is None:
                    return False
                replies[run.role] = dict(trained, **measured)
                phases["numerics_s"] += measured.get("numerics_s", 0.0)
            compared = time.perf_counter()
            phases["train_s"] += compared - begin
            bitwise = self._compare(step, micro, replies)
            if bitwise is None or not self._keep_first_call(replies["candidate"]["order"]):
                return False
            recomputed = self._recomputed(step, micro, replies)
            phases["compare_s"] += time.perf_counter() - compared
            step_rows += self._rows(step, micro, sampled, replies, bitwise, recomputed)
        phases["train_s"] -= phases["numerics_s"]  # the workers computed them inside their micro-batch calls
        optimizer_start = time.perf_counter()
        for run in self.runs:
            reply = self.call(run, train_worker.finish, at=f"step {step}", where=f"step {step}",
                              keep_previous=self._keeps_previous(run))
            if reply is None:
                return False
            run.loss, run.grad_norm = reply["loss"], reply["grad_norm"]
        if self.divergence is None and self.loss_differs_at is None and self.runs[0].loss != self.runs[1].loss:
            self.loss_differs_at = step
        step_end = time.perf_counter()
        phases["train_s"] += step_end - optimizer_start
        seconds = step_end - step_start
        by_role = {run.role: run for run in self.runs}
        for row in step_rows:
            run = by_role[row["role"]]
            row.update(loss=run.loss, grad_norm=run.grad_norm, step_seconds=seconds)
        self.rows += step_rows
        self.timing.append(dict(step=step, sampled=sampled, seconds=seconds, **phases))
        return True

    def _keep_first_call(self, order: list[str]) -> bool:
        """The candidate's first layer's operands at its first call (where no divergence is known yet), for
        check's comparisons at the end (parity.train_calls); False when the run died sending them."""
        if self.first_call_sought or self.divergence is not None or not self.runs[0].impl.recipe.is_fp8:
            return True
        self.first_call_sought = True  # once: the first micro-batch
        for name in order:
            tensors = self.call(self.runs[0], train_worker.call_tensors, name, at=f"sending {name}'s tensors")
            if tensors is None:
                return False
            call = tensors["call"]
            if call is not None and call["grad_output"] is not None:
                self.first_call = name, {"input": Call(**{k: v for k, v in call.items() if k != "weight"})
                                         .input_for("output"), "weight": call["weight"],
                                         "grad_output": call["grad_output"]}
                return True
        return True

    def _compare(self, step: int, micro: int, replies: dict[str, dict]) -> dict | None:
        """The candidate's GEMMs against the against run's, by the fingerprints of their bits; the first
        that differs, in execution order, confirmed on the tensors themselves, is the divergence (its
        case file saved). None when a run died while sending its tensors."""
        candidate, against = replies["candidate"]["results"], replies["against"]["results"]
        bitwise = {(name, gemm): candidate[name][index] == against[name][index]
                   for name in self.runs[0].layers for index, gemm in enumerate(GEMMS)}
        if self.divergence is not None:
            return bitwise
        for name, gemm in execution_order(replies["candidate"]["order"]):
            if bitwise[name, gemm]:
                continue
            tensors = {}
            for run in self.runs[:2]:
                tensors[run.role] = self.call(run, train_worker.call_tensors, name, at=f"step {step}: sending "
                                              f"{name}'s tensors")
                if tensors[run.role] is None:
                    return None
            ours, theirs = tensors["candidate"]["call"], tensors["against"]["call"]
            if same(ours[gemm], theirs[gemm]):  # fingerprints that differ on equal bits: not one was seen
                bitwise[name, gemm] = True
                continue
            self.divergence = Divergence(step, name, gemm, micro=micro, grad_accum=self.plan.grad_accum)
            if self.out_dir is not None:
                self.divergence.case_file = self._save_case_file(tensors["candidate"])
            break
        return bitwise

    def _recomputed(self, step: int, micro: int, replies: dict[str, dict]) -> dict[str, dict[str, bool | None]]:
        """Per run and layer, whether the checkpoint recompute's output GEMM gave the forward's bits
        (None: no recompute); the candidate's first that did not."""
        recomputed = {role: {name: None if pair is None else pair[0] == pair[1]
                             for name, pair in reply.get("recompute", {}).items()}
                      for role, reply in replies.items()}
        if self.recompute_differs is None:
            self.recompute_differs = next(((step, micro, name) for name in replies["candidate"]["order"]
                                           if recomputed["candidate"].get(name) is False), None)
        return recomputed

    def _save_case_file(self, tensors: dict) -> Path | None:
        """The candidate's operands of the diverging layer at this call (the input its diverging GEMM
        consumed: under checkpointing a backward GEMM's is the recompute's), and at the call before (a
        cache that goes stale after an optimizer step needs a call before), as a case file."""
        divergence, plan = self.divergence, self.plan
        fields = {name: value for name, value in tensors["call"].items() if name != "weight"}
        call = Call(**fields)
        if call.grad_output is None:  # its output never reached the loss: no backward operands
            return None
        current = {"input": call.input_for(divergence.gemm), "weight": tensors["call"]["weight"],
                   "grad_output": call.grad_output}
        calls = ([tensors["previous"]] if tensors["previous"] is not None else []) + [current]
        meta = dict(layer=divergence.layer, gemm=divergence.gemm, step=divergence.step, micro=divergence.micro,
                    grad_accum=plan.grad_accum, checkpoint=plan.checkpoint,
                    steps=list(range(divergence.step - len(calls) + 1, divergence.step + 1)),
                    impl=self.runs[0].name, against=self.runs[1].name, recipe=self.runs[0].impl.recipe_name,
                    model=plan.model)
        micro = f"-micro{divergence.micro}" if plan.grad_accum > 1 else ""
        file_name = f"divergence-step{divergence.step}{micro}-{divergence.layer}-{divergence.gemm}.pt"
        return write_case_file(Path(self.out_dir) / file_name, calls, meta=meta)

    def _rows(self, step: int, micro: int, sampled: bool, replies: dict[str, dict], bitwise: dict,
              recomputed: dict) -> list[dict]:
        """One row per run, layer and GEMM of the micro-batch, with the numerics at a sampled step."""
        rows = []
        for run in self.runs:
            numerics = replies[run.role].get("numerics", {})
            for name in run.layers:
                for gemm in GEMMS:
                    rows.append(dict(
                        step=step, micro=micro, role=run.role, impl=run.name, recipe=run.impl.recipe_name,
                        seed=run.seed, layer=name, gemm=gemm, sampled=sampled,
                        bitwise=bitwise[name, gemm] if run.role == "candidate" else None,
                        recompute_bitwise=recomputed[run.role].get(name) if gemm == "output" else None,
                        **numerics.get(name, {}).get(gemm, {})))
        return rows

    # ---- the result

    def result(self, source: MarkovSource | TokenFile | None, seconds: float) -> TrainResult:
        plan = self.plan
        frame = pd.DataFrame.from_records(self.rows)
        timing = pd.DataFrame.from_records(self.timing, columns=["step", "sampled", "seconds", *PHASES])
        frame.attrs["env"] = dict(
            environment(plan.device), model=plan.model, steps=plan.steps, grad_accum=plan.grad_accum,
            checkpoint=plan.checkpoint, data=plan.data, lr=plan.learning_rate, interrupted=self.interrupted,
            entropy_rate=None if source is None or source.entropy_rate is None else round(source.entropy_rate, 6),
            seconds=round(seconds, 1),
            seconds_per_step=round(float(timing["seconds"].mean()), 4) if len(timing) else None)
        candidate, against = self.runs[0].impl, self.runs[1].impl
        bitwise_required = (candidate is not None and against is not None
                            and default_policy(candidate, against) is Policy.BITWISE)
        result = TrainResult(plan, frame, source, {run.role: run.name for run in self.runs}, bitwise_required,
                             self.divergence, self.loss_differs_at, self.crash, seconds,
                             layers=list(self.runs[0].layers), timing=timing, recompute_differs=self.recompute_differs,
                             state_changes=list(self.state_changes), interrupted=self.interrupted)
        result.finding, result.calls_case_file = self._finding()
        result.verdict = train_verdict(result)
        return result

    def _finding(self) -> tuple[str | None, Path | None]:
        """check's finding on the first divergence's case file, or, where the runs never parted, on the first
        layer's first call (with its case file, kept where check found something): parity.train_calls. The
        implementations run there in a worker, as check runs them."""
        plan, candidate_run, against_run = self.plan, self.runs[0], self.runs[1]
        if (self.crash is not None or self.interrupted is not None or self.state_changes
                or candidate_run.impl is None or against_run.impl is None or not candidate_run.impl.recipe.is_fp8):
            return None, None
        if self.divergence is None and (self.loss_differs_at is not None or self.first_call is None):
            return None, None
        if self.divergence is not None and self.divergence.case_file is None:
            return None, None
        candidate = load_impl(plan.impl, form=plan.form, recipe=plan.recipe, time_limit=self.harness_limit)
        against = load_impl(against_run.name, time_limit=self.harness_limit)
        if self.divergence is not None:
            return judge_case_file(candidate, against, self.divergence.case_file, plan.device), None
        layer, operands = self.first_call
        meta = dict(impl=candidate.name, against=against.name, recipe=candidate.recipe.name, model=plan.model)
        return judge_first_call(candidate, against, layer, operands, plan.device, self.out_dir, meta)


def run_training(plan: TrainPlan, *, out_dir: str | Path | None = None,
                 progress: Callable[[int, int], None] | None = None, timeout: float | None = None) -> TrainResult:
    """Train every run of `plan` in lockstep, each in its own worker process; the rows, the first
    divergence (its case file written into `out_dir`, when given), the timing and the verdict.
    `timeout`: the time limit of each call of a run (a micro-batch, an optimizer step), past which the
    run is stopped and is a finding (default: default_time_limit). Ctrl-C or SIGTERM stops training:
    the result holds the steps that finished (result.interrupted names the signal)."""
    start = time.perf_counter()
    device_type = torch_device_type(plan.device)
    prestart(device_type, len(ROLES))  # CUDA workers spawn side by side (the CPU's fork at once)
    runs = [_RemoteRun(role, plan.seed + (role == "baseline_seed"), Worker(device_type)) for role in ROLES]
    lockstep = _Lockstep(plan, runs, out_dir, timeout=timeout)
    source = None
    try:
        shape = lockstep.start()
        if shape is not None:
            source, micro_batches = _micro_batches(plan, shape)
            for step in range(plan.steps):
                if not lockstep.step(step, micro_batches[step]):
                    break
                if progress is not None:
                    progress(step + 1, plan.steps)
    except KeyboardInterrupt as err:  # Ctrl-C or SIGTERM: the worker in a call is killed already
        lockstep.interrupted = handled_stop(err).name
    finally:
        for run in runs:
            run.worker.close()
    return lockstep.result(source, time.perf_counter() - start)


def _micro_batches(plan: TrainPlan, shape) -> tuple[MarkovSource | TokenFile, list[list[torch.Tensor]]]:
    """The data source and, per step, its grad_accum micro-batches (the same for every run). The
    micro-batches of a step are consecutive draws, so --grad-accum 1 trains on the batches it always did."""
    data = None if plan.data is None else TokenFile.load(plan.data, vocab_size=shape.vocab_size,
                                                         length=shape.seq_len + 1)
    source, tokens = batches(shape, plan.steps * plan.grad_accum, plan.seed, data=data)
    return source, [tokens[step * plan.grad_accum:(step + 1) * plan.grad_accum] for step in range(plan.steps)]


# ---- plain training: what the statistics are measured against (evals/scoring/train_cost.py) ------

def run_plain(plan: TrainPlan, roles: tuple[str, ...] = ROLES) -> dict:
    """The plan's runs of `roles` trained in lockstep in THIS process, WITHOUT workers, probes,
    comparisons or numerics: each micro-batch's forward, backward and loss.item() (a training loop logs
    its loss), each step's optimizer step. {"seconds", "seconds_per_step", "losses" (role -> last step's
    loss)}. It imports the implementations here: for the harness's built-ins (train_cost's), not your code."""
    candidate = load_impl(plan.impl, form=plan.form, recipe=plan.recipe)
    against = load_impl(plan.against) if plan.against else default_reference(candidate, torch_device_type(plan.device))
    impls = {"candidate": candidate, "against": against, "baseline": load_impl(plan.baseline)}
    impls["baseline_seed"] = impls["baseline"]
    runs, shape = [], None
    for role in roles:
        seed = plan.seed + (role == "baseline_seed")
        model, shape = initial_model(plan.model, seed)
        runs.append(build_run(role, impls[role], model, shape, seed=seed, device=plan.device,
                              checkpoint=plan.checkpoint, learning_rate=plan.learning_rate, instrument=False))
    _, micro_batches = _micro_batches(plan, shape)
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
