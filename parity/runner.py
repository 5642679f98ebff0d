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
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Sequence

import pandas as pd
import torch
from torch import nn

from parity import cpu_gemm, hopper_oracle, oracles, sandbox, transfer, worker
from parity.cases import Case
from parity.contract import (Breach, CallProblem, ContractProblem, ScaledMMCall, ScaledMMRecorder, TensorContract,
                             contract_problems, expected_contract, sm90_problems)
from parity.data import CaseData, make_data, materialize
from parity.diagnose import call_findings
from parity.env import environment
from parity.impls import Impl, ImplError, reload_impl
from parity.metrics import compare
from parity.policy import Policy, default_policy
from parity.rows import Raised, Row
from parity.rows import frame as rows_frame
from parity.vocabulary import Phase

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
    problems: list[ContractProblem] = field(default_factory=list)  # side effects: inputs modified in place, ...
    error: Raised | None = None
    seconds: float = 0.0
    # the forward's output of each step that got that far: a backward that raises keeps the
    # forward's numbers, so a crash does not hide them
    forward_outputs: list[torch.Tensor] = field(default_factory=list)


HARNESS = str(Path(__file__).resolve().parent)
TORCH = str(Path(torch.__file__).resolve().parent)


def _raised(err: BaseException, phase: Phase, step: int | None) -> Raised:
    """The exception, where the code under test was, and the deepest frame of the implementation's own
    code (outside the harness and torch; torch's own frame when there is none), none for a problem the
    harness detects itself (a returned tuple)."""
    every = traceback.extract_tb(err.__traceback__)
    frames = [f for f in every if not f.filename.startswith(HARNESS)]
    code = [f for f in frames if not f.filename.startswith(TORCH)]  # the implementation's own lines
    if code or (every and every[-1].filename.startswith(HARNESS)):  # raised by the harness: the user's line or none
        frames = code
    at = f"{frames[-1].filename}:{frames[-1].lineno}" if frames else ""
    return Raised(phase, step, type(err).__name__, _first_line(err), at)


# an exception's first line, as far as a finding quotes it: a 50 MiB message is not echoed, and the quote with
# its finding's words stays within the line a command prints (exits.MESSAGE_CHARS, 600), which cuts no further
MESSAGE_CHARS = 500


def _first_line(err: BaseException) -> str:
    """The first line of str(err), at most MESSAGE_CHARS long; what it is when str() itself raises."""
    try:
        text = str(err).strip()
    except BaseException as inner:  # noqa: BLE001 - an exception whose __str__ raises is still a finding
        return f"<its message could not be read: str() raised {type(inner).__name__}>"
    line = text.split("\n", 1)[0] if text else ""
    return line if len(line) <= MESSAGE_CHARS else f"{line[:MESSAGE_CHARS]}... ({len(text)} characters in all)"


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


class _Run:
    """One implementation running a case's steps (execute): where it is (for a worker that dies there,
    and for the exception it raises) and what it gave."""

    def __init__(self, impl: Impl, data: CaseData, recorder: ScaledMMRecorder | None, result: Execution):
        self.impl, self.data, self.recorder, self.result = impl, data, recorder, result
        self.phase, self.step = Phase.BUILD, None
        self.in_dtype = impl.compute_dtype or data.case.torch_input_dtype
        self.w_dtype = impl.compute_dtype or data.case.torch_weight_dtype

    def at(self, phase: Phase, step: int | None = None) -> None:
        self.phase, self.step = phase, step
        worker.report_phase(self.impl.name, phase.at(step))

    def linear(self) -> nn.Linear:
        """The nn.Linear the implementation is built from, holding the case's first weight."""
        case = self.data.case
        linear = nn.Linear(case.K, case.N, bias=case.bias, device="meta")
        linear.weight = nn.Parameter(materialize(self.data.steps[0].weight, case.weight_layout, dtype=self.w_dtype))
        if case.bias:
            linear.bias = nn.Parameter(self.data.bias.to(self.w_dtype).clone())
        return linear

    def recorded(self, phase: str, step_index: int, run: Callable):
        """run(), its _scaled_mm calls recorded as the `phase` of step `step_index` (when recording)."""
        if self.recorder is None:
            return run()
        self.recorder.phase, self.recorder.step = phase, step_index
        with self.recorder:
            return run()

    def run_step(self, step_index: int, module, weight, bias) -> None:
        case, step, result = self.data.case, self.data.steps[step_index], self.result
        if step_index:  # an in-place update, like an optimizer step
            self.at(Phase.UPDATE, step_index)
            with torch.no_grad():
                weight.copy_(step.weight)
            weight.grad = None
            if bias is not None:
                bias.grad = None
        input = materialize(step.input, case.input_layout, dtype=self.in_dtype).requires_grad_()
        grad_output = materialize(step.grad_output, case.grad_output_layout, dtype=self.in_dtype)
        versions = input._version, weight._version
        before = input.detach().clone(), weight.detach().clone(), grad_output.clone()
        self.at(Phase.FORWARD, step_index)
        output = self.recorded("forward", step_index, lambda: module(input))
        if not isinstance(output, torch.Tensor):
            raise TypeError(f"the module returned {type(output).__name__}, not a tensor")
        _surface_kernel_errors(self.data.device)
        result.forward_outputs.append(output.detach())
        self.at(Phase.BACKWARD, step_index)
        self.recorded("backward", step_index, lambda: output.backward(grad_output))
        result.problems += _side_effects(step_index, (input, weight, grad_output, output), versions, before)
        _surface_kernel_errors(self.data.device)
        results = dict(output=output.detach(), grad_input=input.grad, grad_weight=weight.grad,
                       grad_bias=None if bias is None else bias.grad)
        result.steps.append(results)
        result.layouts.append({name: t if t is None else TensorContract(t.dtype, tuple(t.shape), tuple(t.stride()))
                               for name, t in results.items()})


def _side_effects(step_index: int, tensors, versions, before) -> list[ContractProblem]:
    """What a call did beside its results: the caller's tensors written in place, an output that is a
    view of the input."""
    input, weight, grad_output, output = tensors
    input_version, weight_version = versions
    input_before, weight_before, grad_output_before = before
    problems = []
    if input._version != input_version or not _same_values(input, input_before):
        problems.append(ContractProblem(Breach.MODIFIED_IN_PLACE, "input", step_index))
    if weight._version != weight_version or not _same_values(weight, weight_before):
        problems.append(ContractProblem(Breach.MODIFIED_IN_PLACE, "weight", step_index,
                                        detail="" if weight._version != weight_version else " (through .data)"))
    if not _same_values(grad_output, grad_output_before):  # the caller's gradient, e.g. an in-place mul_
        problems.append(ContractProblem(Breach.MODIFIED_IN_PLACE, "grad_output", step_index))
    if output.untyped_storage().data_ptr() == input.untyped_storage().data_ptr():
        problems.append(ContractProblem(Breach.SHARES_MEMORY, "output", step_index))
    return problems


def execute(impl: Impl, data: CaseData, *, record: bool = False, keep_data: bool = False) -> Execution:
    """Run `impl` forward and backward on every step of `data`; never raises for impl errors.
    record: record its _scaled_mm calls (keep_data: with their tensors, for parity.diagnose).
    The code under test (`impl.remote`) runs in the worker of the innermost `executing_in`, never here."""
    if impl.remote:
        return _execute_remote(impl, data, record=record, keep_data=keep_data)
    case, result = data.case, Execution(impl)
    start = time.perf_counter()
    recorder = ScaledMMRecorder(case.M, case.K, case.N, keep_data=keep_data) if record else None
    run = _Run(impl, data, recorder, result)
    linear = run.linear()
    run.at(Phase.BUILD)
    guards = contextlib.ExitStack()
    guards.enter_context(sandbox.exits_raise())
    if data.device.type == "cpu" and cpu_gemm.enabled():  # below the recorder: it records a call, this computes it
        guards.enter_context(cpu_gemm.kernel())
    state = sandbox.GlobalState.capture()
    try:
        module, weight, bias = impl.build(linear)
        for step_index in range(len(data.steps)):
            run.run_step(step_index, module, weight, bias)
    except KeyboardInterrupt as err:
        if not worker.in_worker():
            raise  # the user's Ctrl-C (in a worker SIGINT is ignored: only the code under test raises it)
        _ended_by(err, run)
    except BaseException as err:  # noqa: BLE001 - an implementation that raises anything is a finding
        _ended_by(err, run)
        if data.device.type == "cuda" and _cuda_context_lost(data.device):
            # an illegal address or a device-side assert poisons this process's CUDA context: nothing
            # more runs here, so the worker ends and the parent runs the next case on a fresh one
            worker.end_worker(f"raised a CUDA error that leaves the process's CUDA context unusable "
                              f"({result.error.after_where})")
    finally:
        changed = state.changes_since()
        if changed:
            result.problems.append(ContractProblem(Breach.GLOBAL_STATE, detail="; ".join(changed)))
        guards.close()
    if recorder is not None:
        result.calls = recorder.calls
    result.seconds = time.perf_counter() - start
    return result


def _ended_by(err: BaseException, run: _Run) -> None:
    """The case ended with `err`: the execution's error, and the recorded call whose exception it is."""
    run.result.error = _raised(err, run.phase, run.step)
    if run.recorder is not None:
        run.recorder.mark_ended_case(err)


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


def skipped_rows(case: Case, comparison: Comparison, reason: str, *, device_type: str) -> list[Row]:
    """The rows of a comparison that was not run: every metric missing, `skipped` says why."""
    base = _row_base(case, comparison, device_type)
    return [Row(**base, tensor=tensor, step=step, skipped=reason) for step in range(case.steps)
            for tensor in case.tensors]


def _gpu_problems(calls: Sequence[ScaledMMCall]) -> dict[str, list[CallProblem]]:
    """GEMM -> the problems an H100 has with the calls that may be it."""
    by_gemm: dict[str, list[CallProblem]] = {}
    for call in calls:
        for problem in sm90_problems(call):
            for gemm in call.gemms:
                by_gemm.setdefault(gemm, []).append(CallProblem(call.gemms, problem))
    return by_gemm


def _bound(row: Row, data: CaseData, emulated, recipe, device_type: str, got, want) -> None:
    """The row's accumulation bound: the GEMM's accumulation as the recipe runs it (fast only where the
    recipe says so) and the roundings of its result."""
    tensor, case = row.tensor, data.case
    fast = tensor != "grad_bias" and recipe.gemm(tensor).fast_accum
    magnitude, inner, value = oracles.magnitude_of(emulated[row.step], data.steps[row.step], tensor)
    accumulates_on = "cuda" if device_type == "cuda" or cpu_gemm.mode() == "hopper" else "cpu"  # the model's sums
    gamma = oracles.accumulation_gamma(inner, device_type=accumulates_on if tensor != "grad_bias" else "cpu",
                                       fast_accum=fast)
    row.bound_ratio, row.n_beyond_bound, row.bound_index = oracles.accumulation_excess(
        got, want, magnitude=magnitude, gamma=gamma, gemm_value=value,
        rounding_chain=oracles.rounding_chain(case, tensor, recipe),
        bias=data.bias if tensor == "output" and case.bias else None)


def compare_executions(data: CaseData, candidate: Execution, reference: Execution, *, device_type: str,
                       policy: Policy | None = None) -> list[Row]:
    """Rows of `candidate` against `reference` for every tensor and step of the case."""
    case = data.case
    comparison = Comparison(candidate.impl, reference.impl, policy or default_policy(candidate.impl, reference.impl))
    contract = expected_contract(case, compute_dtype=candidate.impl.compute_dtype)
    gpu_problems = _gpu_problems(candidate.calls)
    emulated_steps, operand_findings = None, {}
    recipe = reference.impl.recipe
    if reference.impl.exact and not (candidate.error or reference.error):
        host = candidate.steps and candidate.steps[0]["output"].device.type == "cpu"
        data = data.on_host() if host else data  # the emulation is exact: it runs where the results are
        emulated_steps = emulated_steps_of(data, recipe)
        if candidate.impl.recipe is recipe:
            for finding in call_findings(candidate.calls, data.steps, recipe, case):
                operand_findings.setdefault((finding.step, finding.gemm), []).append(finding)
    base = _row_base(case, comparison, device_type)
    rows = []
    for step_index in range(case.steps):
        for tensor in case.tensors:
            findings = tuple(operand_findings.get((step_index, tensor), ()))
            row = Row(**base, tensor=tensor, step=step_index, scaled_mm=tuple(gpu_problems.get(tensor, ())),
                      operands=findings, operand_stages=frozenset(f.stage for f in findings))
            rows.append(row)
            if candidate.error or reference.error or step_index >= len(candidate.steps):
                row.error, row.reference_error = candidate.error, reference.error
                continue
            got = candidate.steps[step_index][tensor]
            want = reference.steps[step_index][tensor]
            problems = contract_problems(candidate.layouts[step_index][tensor], contract[tensor], tensor)
            if step_index == 0 and tensor == "output":
                problems = candidate.problems + problems
            row.contract = tuple(problems)
            row.dtype = None if got is None else str(got.dtype).replace("torch.", "")
            if got is None or want is None or tuple(got.shape) != tuple(want.shape):
                continue
            chain = oracles.rounding_chain(case, tensor, candidate.impl.recipe)
            row.update(compare(got, want, dtype=contract[tensor].dtype,
                               overflow_dtype=min(chain, key=lambda dtype: torch.finfo(dtype).max)))
            if emulated_steps is not None:
                _bound(row, data, emulated_steps, recipe, device_type, got, want)
            if reference.impl.bit_model:
                _exactness(row, data, recipe, device_type)
    return rows


def _exactness(row: Row, data: CaseData, recipe, device_type: str) -> None:
    """Whether the row is judged bit for bit against the Hopper model (the calibration vouches for its GEMM
    call on this GPU), and why or why not (parity.hopper_oracle.exactness_of). The device is the run's: a small
    case's results are compared on the host, but they were computed on the GPU."""
    step = data.steps[row.step]
    K, N = step.input.shape[-1], step.weight.shape[0]
    judged = hopper_oracle.exactness_of(recipe, row.tensor, step.input.numel() // K, K, N, data.case.torch_input_dtype,
                                        torch.device(device_type))
    row.exact, row.exact_why = judged.exact, judged.why


def isolation(comparisons: Sequence[Comparison], device: str, isolate: bool | None = None):
    """A Worker for the code under test of `comparisons`, or a null context where there is none. Code under
    test (Impl.remote: anything but the harness's built-ins) runs in a worker whatever `isolate` says;
    isolate=True gives a worker even to built-ins only (which then still run here: they are the references)."""
    if isolate or any(impl.remote for c in comparisons for impl in (c.impl, c.reference)):
        return worker.Worker(worker.torch_device_type(device))
    return contextlib.nullcontext()


def run_case_isolated(case: Case, comparisons: Sequence[Comparison], *, device: str | torch.device = "cpu",
                      runner: "worker.Worker | None" = None, time_limit: float | None = None) -> list[Row]:
    """run_case, with the code under test in `runner` (parity.worker), each of its executions within
    `time_limit` seconds (default: one that fits the case): a death or a hang there is a finding of this case.
    Everything else (the data, the references, every comparison) runs here. Without a worker (`runner`
    None) there may be no code under test among the comparisons."""
    if runner is None:
        return run_case(case, comparisons, device=device)
    device_type = torch.device(device).type
    limit = time_limit or worker.default_time_limit(case.M, case.K, case.N, device_type)
    printed_before = runner.output_bytes()
    with executing_in(runner, limit):
        rows = run_case(case, comparisons, device=device)
    printed = runner.output_bytes() - printed_before
    if printed > worker.PRINT_LIMIT_BYTES:  # only code under test prints there
        remote = {impl.name for c in comparisons for impl in (c.impl, c.reference) if impl.remote}
        for row in rows:
            if row.impl in remote and row.tensor == "output" and row.step == 0 and not row.skipped:
                row.contract += (ContractProblem(Breach.PRINTS, got=printed, want=worker.PRINT_LIMIT_BYTES),)
    return rows


def _unmodelled(executions: dict[str, Execution]) -> dict[str, str]:
    """The implementations whose run stopped at a call that --cpu-gemm hopper's model does not compute
    (parity.cpu_gemm.HopperModelNotApplicable: a scale_result, a bias on a block-scaled call, scales of
    another shape), with why: what the GPU computes there is unknown here, so the case cannot be judged."""
    return {name: f"{execution.error.message} here: this case cannot be judged on this CPU (run it without "
                  f"--cpu-gemm hopper, or on a GPU)"
            for name, execution in executions.items()
            if isinstance(execution.error, Raised)
            and execution.error.type == cpu_gemm.HopperModelNotApplicable.__name__}


# ---- the code under test, in its worker -----------------------------------------------------------------
#
# The process that judges never imports the code under test (parity.impls loads it in a worker and keeps a
# description, Impl.remote). `execute` of such an implementation sends the case's data to the worker of the
# innermost `executing_in`; the worker builds and runs it there (parity.runner.execute, its side effects and
# state checks included) and sends back the raw execution as plain data (parity.transfer), which is checked
# here field by field before anything reads it. The references, the oracles and every comparison run here.

_ROUTE: list[tuple[worker.Worker, float]] = []  # (worker, time limit) of each open executing_in, innermost last


@contextlib.contextmanager
def executing_in(runner: worker.Worker, time_limit: float):
    """Inside, every execute() of code under test runs in `runner`, each within `time_limit` seconds."""
    _ROUTE.append((runner, time_limit))
    try:
        yield
    finally:
        _ROUTE.pop()


REPLY_BYTES_PER_ELEMENT = 512  # results, recorded calls with their operands, forward outputs: about 60 bytes
# per element of the case's three matrices in the worst recipe; eight times that before a reply is refused


def _execute_remote(impl: Impl, data: CaseData, *, record: bool, keep_data: bool) -> Execution:
    if not _ROUTE:
        raise RuntimeError(f"{impl.name} is code under test: it runs only in a worker (parity.runner.executing_in), "
                           f"never in the process that judges it")
    runner, limit = _ROUTE[-1]
    case = data.case
    elements = (case.M * case.K + case.N * case.K + case.M * case.N) * case.steps
    outcome = runner.call(_execute_here, impl.reload_args, CaseData(case, data.steps, data.bias), record, keep_data,
                          time_limit=limit, reply_limit=(64 << 20) + REPLY_BYTES_PER_ELEMENT * elements)
    if isinstance(outcome, worker.Died):
        return Execution(impl, error=outcome)
    try:
        return Execution(impl, **_checked_execution(outcome, case))
    except transfer.TransferError as err:
        runner.close()  # what else it holds cannot be trusted either
        return Execution(impl, error=worker.Died(f"sent back an execution the harness does not read ({err}): the "
                                                 f"code under test tampered with the worker", impl.name, "", ""))


_EXECUTION_FIELDS = {"steps": list, "calls": list, "layouts": list, "problems": list, "error": (Raised, type(None)),
                     "seconds": float, "forward_outputs": list}
_RESULT_NAMES = {"output", "grad_input", "grad_weight", "grad_bias"}


def _checked_execution(fields, case: Case) -> dict:
    """A worker's execution (parity.transfer's plain data) checked for the types every reader expects."""
    def expect(ok: bool, what: str) -> None:
        if not ok:
            raise transfer.TransferError(what)
    expect(isinstance(fields, dict) and set(fields) == set(_EXECUTION_FIELDS), "not the fields of an execution")
    for name, kind in _EXECUTION_FIELDS.items():
        expect(isinstance(fields[name], kind), f"{name} is a {type(fields[name]).__name__}")
    expect(len(fields["steps"]) <= case.steps and len(fields["layouts"]) == len(fields["steps"]), "steps")
    for results, layouts in zip(fields["steps"], fields["layouts"]):
        expect(isinstance(results, dict) and set(results) == _RESULT_NAMES, "a step's results")
        expect(all(t is None or isinstance(t, torch.Tensor) for t in results.values()), "a result not a tensor")
        expect(isinstance(layouts, dict) and set(layouts) == _RESULT_NAMES, "a step's layouts")
        expect(all(t is None or isinstance(t, TensorContract) for t in layouts.values()), "a layout")
    expect(all(isinstance(call, ScaledMMCall) for call in fields["calls"]), "a recorded call")
    expect(all(isinstance(problem, ContractProblem) for problem in fields["problems"]), "a contract problem")
    expect(all(isinstance(t, torch.Tensor) for t in fields["forward_outputs"]), "a forward output")
    return fields


_LOADED: dict[tuple, tuple] = {}  # in a worker: reload_args -> (implementation or the Raised of its import, problems)


def _execute_here(reload_args: tuple, data: CaseData, record: bool, keep_data: bool) -> dict:
    """In the worker: the implementation (imported on first use) executed on `data`, as plain fields."""
    if reload_args not in _LOADED:
        _LOADED[reload_args] = _import_here(reload_args)
    impl, at_import = _LOADED[reload_args]
    if isinstance(impl, Raised):
        execution = Execution(None, error=impl)
    else:
        execution = execute(impl, data, record=record, keep_data=keep_data)
    return dict(steps=execution.steps, calls=execution.calls, layouts=execution.layouts,
                problems=[*at_import, *execution.problems], error=execution.error, seconds=float(execution.seconds),
                forward_outputs=execution.forward_outputs)


def error_of_call(impl: Impl, features: tuple[int, int], shape: tuple, dtype: torch.dtype,
                  device: str) -> tuple[str, str] | None:
    """(exception type, first line) of what `impl`'s layer with (in, out) `features` raises on zeros of `shape` and
    `dtype`, or None when it raises nothing: in the worker of executing_in for code under test."""
    if not impl.remote:
        module, _, _ = impl.build(nn.Linear(*features, device=device))
        try:
            module(torch.zeros(shape, dtype=dtype, device=device))
        except Exception as err:  # noqa: BLE001 - what it raised is the answer
            return type(err).__name__, _first_line(err)
        return None
    runner, limit = _ROUTE[-1]
    outcome = runner.call(_error_of_call_here, impl.reload_args, features, shape, dtype, device, time_limit=limit)
    if isinstance(outcome, worker.Died):
        return "Died", outcome.message
    ok = outcome is None or (isinstance(outcome, tuple) and len(outcome) == 2
                             and all(isinstance(part, str) for part in outcome))
    return outcome if ok else ("Died", f"the worker sent back {type(outcome).__name__}, not an answer")


def _error_of_call_here(reload_args: tuple, features, shape, dtype, device):
    if reload_args not in _LOADED:
        _LOADED[reload_args] = _import_here(reload_args)
    impl = _LOADED[reload_args][0]
    if isinstance(impl, Raised):
        return impl.type, impl.message
    return error_of_call(impl, features, shape, dtype, device)


def _import_here(reload_args: tuple) -> tuple:
    """The implementation loaded in this worker, and what its import changed of the process's global state
    (taken before the import: a module that patches F.linear or sets the default dtype at import is found, and
    undone, before any case runs)."""
    worker.report_phase(reload_args[0], Phase.IMPORT.value)
    state = sandbox.GlobalState.capture()
    try:
        impl = reload_impl(*reload_args)
    except ImplError as err:
        impl = Raised(Phase.IMPORT, None, "ImplError", _first_line(err))
    changed = state.changes_since()
    return impl, [ContractProblem(Breach.GLOBAL_STATE, detail="at import: " + "; ".join(changed))] if changed else []


def run_case(case: Case, comparisons: Sequence[Comparison], *, device: str | torch.device = "cpu",
             record: bool = True, timings: dict[str, float] | None = None) -> list[Row]:
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
    unmodelled = _unmodelled(executions)
    for comparison in runnable:
        reason = unmodelled.get(comparison.impl.name) or unmodelled.get(comparison.reference.name)
        if reason:  # the CPU could not compute what the GPU would: no finding either way
            rows += skipped_rows(case, comparison, reason, device_type=device.type)
            continue
        rows.extend(compare_executions(data, executions[comparison.impl.name], executions[comparison.reference.name],
                                       device_type=device.type, policy=comparison.policy))
    lap("compare")
    return rows


def run_cases(cases: Iterable[Case], comparisons: Sequence[Comparison], *, device: str | torch.device = "cpu",
              progress: Callable[[int], None] | None = None) -> pd.DataFrame:
    """All cases -> one tidy DataFrame, with the environment in `df.attrs["env"]`."""
    rows = []
    for index, case in enumerate(cases):
        rows.extend(run_case(case, comparisons, device=device))
        if progress is not None:
            progress(index + 1)
    frame = rows_frame(rows)
    frame.attrs["env"] = environment(torch.device(device))
    return frame
