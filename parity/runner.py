"""Running implementations on cases and comparing them: one case -> rows; many -> a DataFrame.

What is compared with what is a list of Comparisons (implementation, reference, policy): each
implementation runs once per case, however many comparisons name it. A row is one case x
implementation x reference x tensor x step (tidy): the case's columns, the recipes and the
policy that judges the row, the metrics of parity.metrics, the implementation's contract
problems, the _scaled_mm calls that would fail on an H100, the differences between its
recorded GEMM calls and its recipe's oracle (parity.diagnose), the reason a case was skipped
(an implementation that cannot take it) and the exception if the implementation raised (a
finding, never a crash of the harness).
"""

from __future__ import annotations

import contextlib
import math
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Sequence

import pandas as pd
import torch
from torch import nn

from parity import cpu_gemm, oracles, sandbox, worker
from parity.cases import Case
from parity.contract import (ScaledMMCall, ScaledMMRecorder, TensorContract, contract_violations,
                             expected_contract, sm90_violations)
from parity.data import CaseData, make_data, materialize
from parity.diagnose import call_findings
from parity.env import environment
from parity.impls import Impl
from parity.metrics import METRICS, compare
from parity.policy import Policy, default_policy

# Cases whose GEMM operands have at most this many elements (256 x 256) compute their exact
# references and metrics on the CPU: for tensors this small a GPU kernel launch costs more than
# the arithmetic. The FP8 implementations themselves always run on the requested device.
HOST_METRICS_ELEMENTS = 2 ** 16


@dataclass
class Execution:
    """What one implementation produced on one case."""

    impl: Impl
    steps: list[dict[str, torch.Tensor | None]] = field(default_factory=list)
    calls: list[ScaledMMCall] = field(default_factory=list)
    layouts: list[dict[str, TensorContract | None]] = field(default_factory=list)  # per step: dtype/shape/strides
    problems: list[str] = field(default_factory=list)  # side effects: inputs modified in place, ...
    error: str | None = None  # "<where>: <ExceptionType>: <message> (at file:line)"
    seconds: float = 0.0
    # the forward's output of each step that got that far: a backward that raises keeps the
    # forward's numbers, so a crash does not hide them
    forward_outputs: list[torch.Tensor] = field(default_factory=list)


HARNESS = str(Path(__file__).resolve().parent)
TORCH = str(Path(torch.__file__).resolve().parent)


def _describe_exception(err: BaseException, where: str) -> str:
    """"<where>: <Type>: <first line> (at file:line)", the line being the deepest frame of the
    implementation's own code (outside the harness and torch; torch's own frame when there is none),
    and none for a problem the harness detects itself (a returned tuple)."""
    every = traceback.extract_tb(err.__traceback__)
    frames = [f for f in every if not f.filename.startswith(HARNESS)]
    code = [f for f in frames if not f.filename.startswith(TORCH)]  # the implementation's own lines
    if code or (every and every[-1].filename.startswith(HARNESS)):  # raised by the harness: the user's line or none
        frames = code
    at = f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    message = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return f"{where}: {type(err).__name__}: {message}{at}"


@dataclass(frozen=True)
class Comparison:
    """`impl` against `reference`, judged by `policy`."""

    impl: Impl
    reference: Impl
    policy: Policy


def all_pairs(impls: Sequence[Impl], references: Sequence[Impl], *,
              policy: Policy | None = None) -> list[Comparison]:
    """Every implementation against every reference (not itself), each by its default policy."""
    return [Comparison(impl, reference, policy or default_policy(impl, reference))
            for impl in impls for reference in references if reference.name != impl.name]


def execute(impl: Impl, data: CaseData, *, record: bool = False, keep_data: bool = False) -> Execution:
    """Run `impl` forward and backward on every step of `data`; never raises for impl errors.
    record: record its _scaled_mm calls (keep_data: with their tensors, for parity.diagnose)."""
    case, result = data.case, Execution(impl)
    in_dtype = impl.compute_dtype or case.torch_input_dtype
    w_dtype = impl.compute_dtype or case.torch_weight_dtype
    start = time.perf_counter()
    linear = nn.Linear(case.K, case.N, bias=case.bias, device="meta")
    linear.weight = nn.Parameter(materialize(data.steps[0].weight, case.weight_layout, dtype=w_dtype))
    if case.bias:
        linear.bias = nn.Parameter(data.bias.to(w_dtype).clone())
    recorder = ScaledMMRecorder(case.M, case.K, case.N, keep_data=keep_data) if record else None
    def at(phase: str) -> str:  # where the code under test is, for a worker that dies there
        worker.report_phase(impl.name, phase)
        return phase
    where = at("building the module")
    guards = contextlib.ExitStack()
    guards.enter_context(sandbox.exits_raise())
    if data.device.type == "cpu" and cpu_gemm.enabled():  # below the recorder: it records a call, this computes it
        guards.enter_context(cpu_gemm.FastScaledMM())
    state = sandbox.GlobalState.capture()
    try:
        module, weight, bias = impl.build(linear)
        for step_index, step in enumerate(data.steps):
            if step_index:  # an in-place update, like an optimizer step
                where = at(f"step {step_index}: updating the weight in place")
                with torch.no_grad():
                    weight.copy_(step.weight)
                weight.grad = None
                if bias is not None:
                    bias.grad = None
            input = materialize(step.input, case.input_layout, dtype=in_dtype).requires_grad_()
            grad_output = materialize(step.grad_output, case.grad_output_layout, dtype=in_dtype)
            input_version, weight_version = input._version, weight._version
            weight_before, input_before = weight.detach().clone(), input.detach().clone()
            grad_output_before = grad_output.clone()
            where = at(f"step {step_index}: forward")
            if recorder is not None:
                recorder.phase, recorder.step = "forward", step_index
                with recorder:
                    output = module(input)
            else:
                output = module(input)
            if not isinstance(output, torch.Tensor):
                raise TypeError(f"the module returned {type(output).__name__}, not a tensor")
            _surface_kernel_errors(data.device)
            result.forward_outputs.append(output.detach())
            where = at(f"step {step_index}: backward")
            if recorder is not None:
                recorder.phase = "backward"
                with recorder:
                    output.backward(grad_output)
            else:
                output.backward(grad_output)
            if input._version != input_version or not _same_values(input, input_before):
                result.problems.append(f"step {step_index}: the input was modified in place")
            if weight._version != weight_version or not _same_values(weight, weight_before):
                result.problems.append(f"step {step_index}: the weight was modified in place by forward/backward"
                                       + ("" if weight._version != weight_version else " (through .data)"))
            if not _same_values(grad_output, grad_output_before):  # the caller's gradient, e.g. an in-place mul_
                result.problems.append(f"step {step_index}: grad_output was modified in place by backward")
            if output.untyped_storage().data_ptr() == input.untyped_storage().data_ptr():
                result.problems.append(f"step {step_index}: the output shares memory with the input (a view of it)")
            _surface_kernel_errors(data.device)
            results = dict(output=output.detach(), grad_input=input.grad, grad_weight=weight.grad,
                           grad_bias=None if bias is None else bias.grad)
            result.steps.append(results)
            result.layouts.append({name: t if t is None else TensorContract(t.dtype, tuple(t.shape), tuple(t.stride()))
                                   for name, t in results.items()})
    except (Exception, SystemExit, GeneratorExit) as err:  # noqa: BLE001 - an implementation that raises is a finding
        result.error = _describe_exception(err, where)
        if data.device.type == "cuda" and _cuda_context_lost(data.device):
            # an illegal address or a device-side assert poisons this process's CUDA context: nothing
            # more runs here, so the worker ends and the parent runs the next case on a fresh one
            worker.end_worker(f"raised a CUDA error that leaves the process's CUDA context unusable "
                              f"({result.error.split(': ', 1)[-1]})")
    except KeyboardInterrupt as err:
        if not worker.in_worker():
            raise  # the user's Ctrl-C (in a worker SIGINT is ignored: only the code under test raises it)
        result.error = _describe_exception(err, where)
    finally:
        changed = state.changes_since()
        if changed:
            result.problems.append(f"the implementation changed global state: {'; '.join(changed)} (restored)")
        guards.close()
    if recorder is not None:
        result.calls = recorder.calls
    result.seconds = time.perf_counter() - start
    return result


def _surface_kernel_errors(device: torch.device) -> None:
    """A CUDA kernel's error is asynchronous: wait here, so that it is reported in the phase
    (forward, backward) whose kernel raised it, not in a later one."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _cuda_context_lost(device: torch.device) -> bool:
    try:
        torch.cuda.synchronize(device)
        torch.ones(1, device=device).add(1).item()
        return False
    except Exception:  # noqa: BLE001 - any error here means the context is gone
        return True


def _same_values(tensor: torch.Tensor, before: torch.Tensor) -> bool:
    now = tensor.detach()
    return bool(((now == before) | (now.isnan() & before.isnan())).all())


def _move_to_host(execution: Execution) -> None:
    """Bring an execution's results to the CPU in one transfer per dtype (small cases: metrics of
    small tensors run faster there than as dozens of tiny GPU kernels)."""
    entries = [(step, name, t) for step, results in enumerate(execution.steps) for name, t in results.items()
               if t is not None and t.device.type != "cpu"]
    for dtype in {t.dtype for _, _, t in entries}:
        group = [(step, name, t) for step, name, t in entries if t.dtype == dtype]
        flat = torch.cat([t.reshape(-1) for _, _, t in group]).cpu()
        for (step, name, t), host in zip(group, flat.split([t.numel() for _, _, t in group])):
            execution.steps[step][name] = host.reshape(t.shape)


def emulated_steps_of(data: CaseData, recipe) -> list[oracles.EmulatedStep]:
    """The exact emulation of every step of `data` under `recipe` (with each GEMM's quantized
    operands), computed on first use and kept with the data: a sweep compares several
    implementations against it on each case."""
    if recipe not in data.emulated:  # by the whole description: a variant of a recipe has its own
        data.emulated[recipe] = [oracles.emulate_linear(s.input, s.weight, s.grad_output, recipe,
                                                        keep_operands=True) for s in data.steps]
    return data.emulated[recipe]


def _row_base(case: Case, comparison: Comparison, device_type: str) -> dict:
    return dict(case_id=case.id, **case.as_record(), impl=comparison.impl.name, reference=comparison.reference.name,
                recipe=comparison.impl.recipe.name, reference_recipe=comparison.reference.recipe.name,
                policy=comparison.policy.value, device=device_type)


def skipped_rows(case: Case, comparison: Comparison, reason: str, *, device_type: str) -> list[dict]:
    """The rows of a comparison that was not run: every metric missing, `skipped` says why."""
    base = _row_base(case, comparison, device_type)
    empty = {**{m: math.nan for m in METRICS}, "bitwise": False, "error": None, "reference_error": None,
             "contract": "", "scaled_mm": "", "operands": "", "skipped": reason, "bound_ratio": math.nan,
             "n_beyond_bound": math.nan, "bound_index": None}
    return [dict(base, tensor=tensor, step=step, **empty) for step in range(case.steps) for tensor in case.tensors]


def compare_executions(data: CaseData, candidate: Execution, reference: Execution, *, device_type: str,
                       policy: Policy | None = None) -> list[dict]:
    """Rows of `candidate` against `reference` for every tensor and step of the case."""
    case = data.case
    comparison = Comparison(candidate.impl, reference.impl, policy or default_policy(candidate.impl, reference.impl))
    contract = expected_contract(case, compute_dtype=candidate.impl.compute_dtype)
    gemm_problems: dict[str, list[str]] = {}
    for call in candidate.calls:
        for problem in sm90_violations(call):
            for gemm in call.gemm.split("|"):
                gemm_problems.setdefault(gemm, []).append(f"{call.gemm} GEMM: {problem}")
    emulated_steps, operand_problems, operand_stages = None, {}, {}
    recipe = reference.impl.recipe
    if reference.impl.exact and not (candidate.error or reference.error):
        host = candidate.steps and candidate.steps[0]["output"].device.type == "cpu"
        data = data.on_host() if host else data  # the emulation is exact: it runs where the results are
        emulated_steps = emulated_steps_of(data, recipe)
        if candidate.impl.recipe is recipe:
            for finding in call_findings(candidate.calls, data.steps, recipe, case):
                operand_problems.setdefault((finding.step, finding.gemm), []).append(str(finding))
                operand_stages.setdefault((finding.step, finding.gemm), set()).add(finding.stage)
    rows = []
    for step_index in range(case.steps):
        for tensor in case.tensors:
            row = dict(_row_base(case, comparison, device_type), tensor=tensor, step=step_index,
                       **{m: math.nan for m in METRICS})
            row.update(bitwise=False, error=None, reference_error=None, contract="", skipped=None,
                       scaled_mm="; ".join(gemm_problems.get(tensor, [])),
                       operands="; ".join(operand_problems.get((step_index, tensor), [])),
                       operand_stages=",".join(sorted(operand_stages.get((step_index, tensor), ()))),
                       bound_ratio=math.nan, n_beyond_bound=math.nan, bound_index=None)
            rows.append(row)
            if candidate.error or reference.error or step_index >= len(candidate.steps):
                row["error"] = candidate.error
                row["reference_error"] = reference.error
                continue
            got = candidate.steps[step_index][tensor]
            want = reference.steps[step_index][tensor]
            problems = contract_violations(candidate.layouts[step_index][tensor], contract[tensor], tensor)
            if step_index == 0 and tensor == "output":
                problems = candidate.problems + problems
            row["contract"] = "; ".join(problems)
            row["dtype"] = None if got is None else str(got.dtype).replace("torch.", "")
            if got is None or want is None or tuple(got.shape) != tuple(want.shape):
                continue
            chain = oracles.rounding_chain(case, tensor, candidate.impl.recipe)
            row.update(compare(got, want, dtype=contract[tensor].dtype,
                               overflow_dtype=min(chain, key=lambda dtype: torch.finfo(dtype).max)))
            if emulated_steps is not None:
                # The GEMM's accumulation as the recipe runs it: fast only where the recipe says so.
                fast = tensor != "grad_bias" and recipe.gemm(tensor).fast_accum
                magnitude, inner, value = oracles.magnitude_of(emulated_steps[step_index], data.steps[step_index],
                                                               tensor)
                gamma = oracles.accumulation_gamma(inner, device_type=device_type if tensor != "grad_bias" else "cpu",
                                                   fast_accum=fast)
                row["bound_ratio"], row["n_beyond_bound"], row["bound_index"] = oracles.accumulation_excess(
                    got, want, magnitude=magnitude, gamma=gamma, gemm_value=value,
                    rounding_chain=oracles.rounding_chain(case, tensor, recipe),
                    bias=data.bias if tensor == "output" and case.bias else None)
    return rows


def crash_rows(case: Case, comparisons: Sequence[Comparison], message: str, *, culprit: str,
               device_type: str) -> list[dict]:
    """The rows of a case that did not come back (its worker died): an error of the implementation
    that was running (`culprit`), or of the reference when it was the reference."""
    rows = []
    for comparison in comparisons:
        for row in skipped_rows(case, comparison, "", device_type=device_type):
            row["skipped"] = None
            if comparison.reference.name == culprit and comparison.impl.name != culprit:
                row["reference_error"] = message
            else:
                row["error"] = message
            rows.append(row)
    return rows


def run_case_isolated(case: Case, comparisons: Sequence[Comparison], *, device: str | torch.device = "cpu",
                      runner: "worker.Worker | None" = None, time_limit: float | None = None) -> list[dict]:
    """run_case in a worker process (parity.worker): a death or a hang of the code under test is a
    finding for this case. Without a worker (`runner` None) it runs in this process."""
    if runner is None:
        return run_case(case, comparisons, device=device)
    device_type = torch.device(device).type
    limit = time_limit or worker.default_time_limit(case.M, case.K, case.N, device_type)
    key = runner.remember(f"comparisons-{id(comparisons)}-{len(comparisons)}", list(comparisons))
    if isinstance(key, worker.Died):  # the implementations could not even be sent (an import that exits)
        return worker.died_rows(case, comparisons, key, device_type=device_type)
    printed_before = runner.output_bytes()
    outcome = runner.call(_run_remembered, case, key, str(device), time_limit=limit)
    if isinstance(outcome, worker.Died):
        return worker.died_rows(case, comparisons, outcome, device_type=device_type)
    printed = runner.output_bytes() - printed_before
    if printed > worker.PRINT_LIMIT_BYTES:  # only code under test prints: the built-ins are quiet
        from parity.impls import BUILTINS
        for row in outcome:
            if row["impl"] not in BUILTINS and row["tensor"] == "output" and row["step"] == 0 and not row["skipped"]:
                problem = (f"the implementation printed {printed / 2**20:.1f} MiB during the case (nn.Linear prints "
                           f"nothing; more than {worker.PRINT_LIMIT_BYTES // 1024} KiB floods a training log)")
                row["contract"] = "; ".join(filter(None, [row["contract"], problem]))
    return outcome


def _run_remembered(case: Case, key: str, device: str) -> list[dict]:
    return run_case(case, worker.recall(key), device=device)


def run_case(case: Case, comparisons: Sequence[Comparison], *, device: str | torch.device = "cpu",
             record: bool = True, timings: dict[str, float] | None = None) -> list[dict]:
    """The rows of every comparison on one case (each implementation executed once).

    An implementation that cannot take the case (its recipe's alignment, a CUDA-only kernel)
    gives `skipped` rows instead. `timings`, if given, accumulates the host seconds of each
    phase: data, one entry per implementation, and compare (metrics, bounds)."""
    device = torch.device(device)
    clock = time.perf_counter()

    def lap(phase: str) -> None:
        nonlocal clock
        if timings is not None:
            now = time.perf_counter()
            timings[phase] = timings.get(phase, 0.0) + now - clock
            clock = now

    runnable, rows = [], []
    for comparison in comparisons:
        reason = comparison.impl.unsupported(case, device.type) or comparison.reference.unsupported(case, device.type)
        if reason:
            rows += skipped_rows(case, comparison, reason, device_type=device.type)
        else:
            runnable.append(comparison)
    if not runnable:
        return rows
    data = make_data(case, device)
    small = device.type != "cpu" and max(case.M * case.K, case.N * case.K, case.M * case.N) <= HOST_METRICS_ELEMENTS
    lap("data")
    # the calls' tensors are kept for implementations compared with their own recipe's oracle
    diagnosed = {c.impl.name for c in runnable if c.reference.exact and c.reference.recipe is c.impl.recipe}
    executions: dict[str, Execution] = {}
    for impl in (impl for c in runnable for impl in (c.impl, c.reference)):
        if impl.name not in executions:
            on = data.on_host() if small and impl.device_independent else data
            executions[impl.name] = execute(impl, on, record=record and impl.recipe.is_fp8 and not impl.exact,
                                            keep_data=impl.name in diagnosed)
            if small:
                _move_to_host(executions[impl.name])
            lap(impl.name)
    for comparison in runnable:
        rows.extend(compare_executions(data, executions[comparison.impl.name], executions[comparison.reference.name],
                                       device_type=device.type, policy=comparison.policy))
    lap("compare")
    return rows


def run_cases(cases: Iterable[Case], comparisons: Sequence[Comparison], *, device: str | torch.device = "cpu",
              progress: Callable[[int], None] | None = None) -> pd.DataFrame:
    """All cases -> one tidy DataFrame, with the environment in `df.attrs["env"]`."""
    records = []
    for index, case in enumerate(cases):
        records.extend(run_case(case, comparisons, device=device))
        if progress is not None:
            progress(index + 1)
    frame = pd.DataFrame.from_records(records)
    frame.attrs["env"] = environment(torch.device(device))
    return frame
