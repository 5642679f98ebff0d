"""`fp8-parity bisect`: localize a failing FP8 implementation to GEMM, operand, bug class,
trigger and minimal case, with evidence.

From the minimal failing case that `check` finds:

1. Triggers by experiment. Each condition of the minimal case (a non-contiguous layout, K == N,
   N-D input, a dtype, a second call, the data distribution, a bias) is flipped on its own, with
   the same seed: a condition is a trigger when the failure disappears without it (it is there
   with it: the minimal case fails). A crash is tracked apart from wrong numbers, so a condition
   that only turns a crash off is the crash's trigger, and the case without it is where the
   numbers are diagnosed.
2. Diagnosis along the data path (parity.diagnose), on a case that runs: every recorded
   _scaled_mm call is compared with the call the recipe's oracle expects, stage by stage (fp8
   format, scales, fp8 values, flags), and a stage that differs is explained by the hypothesis
   that reproduces the recorded operand exactly; a GEMM whose calls agree but whose result does
   not is explained at the result stage (rescaled, transposed, bias, overflow). GEMMs that make
   no _scaled_mm call are diagnosed by behaviour: the same hypotheses emulated end to end.
3. The class and operand come from the first GEMM (output, grad_input, grad_weight) and the
   first stage that differs; a difference within the accumulation bound is a rounding-level
   (accumulation) finding, never a structural one; "unknown" comes with the stages compared.
4. Evidence: the violations, the stage findings, the recorded calls of the blamed GEMMs and how
   they differ from the reference's, and the metamorphic relations (parity.relations) it breaks.

The bug classes: transpose, layout, scale, fp8_dtype, saturation, accumulation, contract,
stale_state, crash, and precision (a GEMM in another precision than the recipe's).
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
from dataclasses import dataclass, field
from typing import Sequence

import torch

from parity import oracles
from parity.cases import INPUT_DTYPES, WEIGHT_DTYPES, Case, Dist, Layout
from parity.check import CheckPlan, run_check
from parity.contract import ScaledMMCall, contract_violations, expected_contract, sm90_problems
from parity.data import make_data
from parity.diagnose import (ACCUMULATION_DB, MATCH_DB, Finding, Match, call_findings, diagnose_behaviour,
                             explain_result, gemm_inverse_scales, high_precision_closeness, resolve_calls)
from parity.env import environment
from parity.impls import builtin_for_recipe, load_impl, with_reciprocal_scales
from parity.metrics import compare
from parity.mistakes import RECIPROCAL_SCALES, strides_ignored
from parity.policy import CPU_IGNORES, Violation
from parity.recipes import GEMMS, OPERANDS
from parity.relations import (RELATIONS, check_layout_invariance, check_relation, check_weight_update,
                              missing_tensors)
from parity.runner import emulated_steps_of, execute, run_case_isolated
from parity.worker import Died, Worker, WorkerError, default_time_limit, isolation

NUMERIC_METRICS = ("bitwise", "accumulation_bound", "sqnr_db", "paired_sqnr_db", "nonfinite", "operand")
# the classes of the GPU rules (parity.contract) whose rejection of a call names the bug rather than a crash
NAMED_BY_REJECTION = ("layout", "fp8_dtype")
STAGE_ORDER = ("in_place", "calls", "precision", "fp8_dtype", "scale", "bytes", "unit_scales", "fast_accum",
               "out_dtype", "result", "contract", "gpu_rule")


# ---- triggers --------------------------------------------------------------------------------------------

def _dtype_trigger(tensor: str, dtype: str, *, alternative: bool = False) -> str:
    """The trigger a tensor's dtype is: "only with fp32 input", or as a further one "or with fp32 input"."""
    return f"{'or' if alternative else 'only'} with {dtype} {tensor}"


def _conditions(case: Case) -> list[tuple[str, str, Case]]:
    """(trigger label, operand it points at, the case without that condition)."""
    undo = []
    layouts = (("input_layout", "input"), ("weight_layout", "weight"), ("grad_output_layout", "grad_output"))
    for attr, operand in layouts:
        layout = getattr(case, attr)
        if layout is not Layout.CONTIGUOUS:
            undo.append((f"only with non-contiguous {operand} ({layout.name.lower()})", operand,
                         case.replace(**{attr: Layout.CONTIGUOUS})))
    if case.K == case.N:
        step = 128 if case.K % 128 == 0 else 16
        undo.append(("only when K == N", "weight", case.replace(N=case.N + step)))
    if len(case.lead) > 1:
        undo.append(("only with N-D input", "input", case.replace(lead=(case.M,))))
    if case.input_dtype != "bf16":
        undo.append((_dtype_trigger("input", case.input_dtype), "input", case.replace(input_dtype="bf16")))
    if case.weight_dtype != "bf16":
        undo.append((_dtype_trigger("weight", case.weight_dtype), "weight", case.replace(weight_dtype="bf16")))
    if case.steps > 1:
        undo.append(("only from the second call", "weight", case.replace(steps=1)))
    if case.dist is not Dist.NORMAL:
        undo.append((f"only with {case.dist_token} data", "", case.replace(dist=Dist.NORMAL)))
    if case.bias:
        undo.append(("only with a bias", "", case.replace(bias=False)))
    return undo


def _one_condition_more(case: Case, plan: CheckPlan, device: str) -> list[Case]:
    """The case with one trigger condition of _conditions added (a layout, a dtype, N-D input, K == N, a
    bias, a second call, a data distribution), those the plan can run."""
    variants = [case.replace(**{attr: Layout.TRANSPOSED})
                for attr in ("input_layout", "weight_layout", "grad_output_layout")]
    variants += [case.replace(input_dtype=dtype) for dtype in INPUT_DTYPES]
    variants += [case.replace(weight_dtype=dtype) for dtype in WEIGHT_DTYPES]
    variants += [case.replace(N=case.K), case.replace(bias=True), case.replace(steps=2)]
    if len(case.lead) == 1:
        variants.append(case.replace(lead=(2, case.M // 2)))
    variants += [case.replace(dist=dist) for dist in Dist]
    return [v for v in dict.fromkeys(variants) if v != case and plan.unsupported(v, torch.device(device).type) is None]


def _more_distributions(result: Localization, plan: CheckPlan, case: Case, device: str, outcome_of) -> None:
    """A failure that needs its data distribution may need one of several: each other distribution
    is tried on the same case, and those that fail too are named ("or with X data")."""
    if not any(t.endswith(" data") for t in result.trigger):
        return
    for dist in Dist:
        if dist not in (case.dist, Dist.NORMAL) and outcome_of(case.replace(dist=dist), device).fails:
            other = case.replace(dist=dist)
            result.trigger.append(f"or with {other.dist_token} data")
            result.trigger_operands.append("")


def _more_dtypes(result: Localization, plan: CheckPlan, case: Case, device: str, outcome_of) -> None:
    """A failure that needs the input's (or the weight's) dtype may come with another dtype of that tensor
    (fp16 beside fp32) or with the other tensor's: that condition undone and each other dtype given to
    either tensor alone; those that fail too are named ("or with fp16 input")."""
    base = case.replace(input_dtype="bf16", weight_dtype="bf16")
    dtypes = {"input": INPUT_DTYPES, "weight": WEIGHT_DTYPES}
    needed = [t for t in dtypes if _dtype_trigger(t, getattr(case, f"{t}_dtype")) in result.trigger]
    tried = [(_dtype_trigger(tensor, dtype, alternative=True), tensor, base.replace(**{f"{tensor}_dtype": dtype}))
             for tensor in dtypes if needed for dtype in dtypes[tensor]
             if dtype != "bf16" and not (tensor in needed and dtype == getattr(case, f"{tensor}_dtype"))]
    for label, operand, other in tried:
        if plan.unsupported(other, torch.device(device).type) is None and outcome_of(other, device).fails:
            result.trigger.append(label)
            result.trigger_operands.append(operand)


@dataclass
class Outcome:
    """What the plan's comparisons say about one case."""

    violations: list[Violation]

    @property
    def fails(self) -> bool:
        return bool(self.violations)

    @property
    def crashed(self) -> bool:
        return any(v.metric == "crash" for v in self.violations)

    @property
    def numeric(self) -> list[Violation]:
        return [v for v in self.violations if v.metric in NUMERIC_METRICS and not _is_contract_only(v)]


def _outcome(plan: CheckPlan, case: Case, device: str, runner: Worker | None = None,
             time_limit: float | None = None) -> Outcome:
    return Outcome(plan.judge(run_case_isolated(case, plan.comparisons, device=device, runner=runner,
                                                time_limit=time_limit)))


def _is_gpu_lint(violation: Violation) -> bool:
    """A _scaled_mm call that would fail on an H100, or that asks for fast accumulation where the
    recipe does not, seen where it runs with the right numbers (a CPU)."""
    return violation.metric == "scaled_mm_contract" or (violation.metric == "operand"
                                                        and violation.detail == CPU_IGNORES)


def _is_contract_only(violation: Violation) -> bool:
    dtype_only = violation.metric == "bitwise" and str(violation.value).startswith("dtype")
    return violation.metric == "contract" or dtype_only


# ---- the localization ---------------------------------------------------------------------------------

@dataclass
class Localization:
    verdict: str  # "pass" (nothing to localize) | "fail" | "error"
    plan: CheckPlan
    device: str
    minimal_case: Case | None = None
    gemm: list[str] = field(default_factory=list)  # diverging GEMMs (tensors), in GEMM order
    first: str | None = None
    operand: str | None = None
    category: str | None = None
    trigger: list[str] = field(default_factory=list)
    trigger_operands: list[str] = field(default_factory=list)  # the operand each trigger points at
    evidence: list[str] = field(default_factory=list)
    violations: list[Violation] = field(default_factory=list)
    error: str | None = None
    method: str | None = None  # "recorded calls" | "behaviour" | "contract" | "crash"
    diagnosis: list[dict] = field(default_factory=list)  # the stage findings, structured
    crash: dict | None = None  # {message, trigger}: a crash found beside the numbers diagnosed
    diagnosed_case: Case | None = None
    seconds: dict = field(default_factory=dict)  # wall time of each phase (check, triggers, diagnosis, evidence)

    def to_json(self) -> dict:
        return dict(verdict=self.verdict, impl=self.plan.candidate.name, reference=self.plan.reference.name,
                    device=self.device, gemm=self.gemm, first=self.first, operand=self.operand,
                    category=self.category, trigger=self.trigger,
                    minimal_case=None if self.minimal_case is None else self.minimal_case.id,
                    evidence=self.evidence, error=self.error, method=self.method, diagnosis=self.diagnosis,
                    crash=self.crash, recipe=self.plan.candidate.recipe.name,
                    diagnosed_case=None if self.diagnosed_case is None else self.diagnosed_case.id,
                    seconds={phase: round(value, 2) for phase, value in self.seconds.items()},
                    env=environment(self.device))


def _call_differences(candidate: Sequence[ScaledMMCall], reference: Sequence[ScaledMMCall], reference_name: str):
    """Evidence lines: a candidate call whose dtypes, layouts, scales or flags differ from the
    reference's call for the same GEMM, and calls that would fail on an H100."""
    def layout(stride):
        return "row-major" if stride[1] == 1 else "column-major" if stride[0] == 1 else f"strides {stride}"
    lines = []
    theirs = {(call.step, call.gemm): call for call in reference}
    for call in candidate:
        for _, _, problem in sm90_problems(call):
            lines.append(f"_scaled_mm {call.gemm} GEMM: {problem}")
        other = theirs.get((call.step, call.gemm))
        if other is None:
            continue
        for label, mine, ref in (
                ("A dtype", call.a_dtype, other.a_dtype), ("B dtype", call.b_dtype, other.b_dtype),
                ("A layout", layout(call.a_stride), layout(other.a_stride)),
                ("B layout", layout(call.b_stride), layout(other.b_stride)),
                ("scale shapes", (call.scale_a[0], call.scale_b[0]), (other.scale_a[0], other.scale_b[0])),
                ("out_dtype", call.out_dtype, other.out_dtype),
                ("use_fast_accum", call.use_fast_accum, other.use_fast_accum)):
            if mine != ref:
                lines.append(f"_scaled_mm {call.gemm} GEMM: {label} {mine} where {reference_name} uses {ref}")
    return lines


def _gemm_order(name: str) -> int:
    return (*GEMMS, "grad_bias").index(name) if name in (*GEMMS, "grad_bias") else 9


def localize(plan: CheckPlan, *, device: str = "cpu", case: Case | None = None, max_examples: int = 100,
             seed: int = 0, isolate: bool | None = None, time_limit: float | None = None) -> Localization:
    """Find (or take) a minimal failing case and localize its bug. With `isolate` (by default when
    any implementation is not a built-in: parity.worker.isolation) the code under
    test runs in a worker process (parity.worker), each case within `time_limit` seconds (the
    diagnosis, which runs it many times, within four times that): a death or a hang there is
    evidence, never the end of the localization."""
    with isolation(plan.comparisons, device, isolate) as runner:
        # the check's worker and a second, for the minimal case alone in a fresh process, take the processes
        # the command spawned first thing (parity.entry: on a GPU they start side by side, before this
        # process imports torch); taking each spawns its replacement
        spare = None
        if runner is not None:
            runner.start()
            spare = Worker(runner.device_type).start()
        try:
            result = _localize(plan, device, [case] if case else None, max_examples, seed, runner, time_limit, spare)
            if result.verdict != "fail" or plan.candidate.recipe.reciprocal_scales or \
                    not any(RECIPROCAL_SCALES in entry["message"] for entry in result.diagnosis):
                return result
            # Scales one ulp off through a float32 reciprocal differ in every GEMM and on every case: they
            # hide any mistake beside them (its GEMM, its triggers). Localize again, in the same worker,
            # against a recipe that rounds scales that way: a failure there is that mistake (the rounding
            # reported with it); a pass leaves the rounding alone.
            adopted = CheckPlan.make(with_reciprocal_scales(plan.candidate), with_reciprocal_scales(
                load_impl(builtin_for_recipe("emulated", plan.candidate.recipe))))
            def relocalize(on: list[Case] | None) -> Localization:
                nonlocal spare
                if spare is not None:
                    spare.close()
                    spare = Worker(runner.device_type).start()
                return _localize(adopted, device, on, max_examples, seed, runner, time_limit, spare)
            # The minimal case and its variants with one condition more first (a mistake that shows on every
            # case, or needs one layout, dtype, distribution...: no new search, which costs 10-20 s on the
            # H200); a mistake that needs more is searched for.
            again = relocalize([case] if case else [result.minimal_case, *_one_condition_more(result.minimal_case,
                                                                                             adopted, device)])
            if again.verdict != "fail" and case is None:
                variants = again
                again = relocalize(None)
                again.seconds = {**{f"{phase} (variants)": value for phase, value in variants.seconds.items()},
                                 **again.seconds}
        finally:
            if spare is not None:
                spare.close()
    if again.verdict != "fail":
        return result
    again.evidence.insert(0, f"its scales are computed as fp8_max * (1 / amax) in float32, one ulp off the exact "
                             f"quotient in some groups ({result.category} in {result.first} on "
                             f"{result.minimal_case.id}, read alone); localized again against a recipe that "
                             f"rounds its scales so, it still fails: the mistake beside that rounding is this")
    again.seconds = {**{f"{phase} (exact scales)": value for phase, value in result.seconds.items()},
                     **again.seconds}
    return again


def _localize(plan: CheckPlan, device: str, cases: list[Case] | None, max_examples: int, seed: int,
              runner: Worker | None, time_limit: float | None, spare: Worker | None = None) -> Localization:
    """Localize the first failure among `cases` (None: search for one and shrink it)."""
    clock = time.perf_counter()
    # the minimal case alone in a fresh worker is step 1's business (in the spare started beside the check):
    # the check's own rerun would wait for another fresh worker, 10-14 s on the H200
    found = run_check(plan, device=device, max_examples=max_examples, seed=seed, cases=cases, runner=runner,
                      isolate=runner is not None, time_limit=time_limit, rerun_alone=False)
    result = Localization(found.verdict, plan, device, found.minimal_case, error=found.error)

    def lap(phase: str) -> None:  # where a bisect spends its time, in the JSON
        nonlocal clock
        now = time.perf_counter()
        result.seconds[phase] = result.seconds.get(phase, 0.0) + now - clock
        clock = now
    lap("check")
    if found.verdict != "fail":
        return result
    case = found.minimal_case
    base = Outcome(found.violations)
    outcome_of = functools.partial(_outcome, plan, runner=runner, time_limit=time_limit)
    result.violations = base.violations

    # 1. triggers, by flipping one condition at a time (the crash's apart from the numbers')
    crash_triggers, running = [], []
    for label, operand, flipped in _conditions(case):
        outcome = outcome_of(flipped, device)
        if not outcome.fails:
            result.trigger.append(label)
            result.trigger_operands.append(operand)
        elif base.crashed and not outcome.crashed:
            crash_triggers.append(label)
            running.append((flipped, outcome))
    if base.crashed:  # an axis that does not follow a .t() raises unless two dims are equal, and is wrong there
        kn, mk = max(case.K, case.N), max(case.M, case.K)  # the larger: more than one scale block along each
        square = [("only when K != N", case.replace(K=kn, N=kn))] + \
                 ([("only when M != K", case.replace(lead=(mk,), K=mk))] if len(case.lead) == 1 else [])
        for label, flipped in square:
            outcome = outcome_of(flipped, device) if flipped != case else None
            if outcome is not None and outcome.fails and not outcome.crashed:
                crash_triggers.append(label)
                running.append((flipped, outcome))
    _more_distributions(result, plan, case, device, outcome_of)
    _more_dtypes(result, plan, case, device, outcome_of)
    numeric_case, numeric = case, base
    diagnosis_runner = runner
    # State left by earlier calls in the process (a cache keyed by shape, a global): the minimal case
    # alone in a fresh worker. Passing there makes "earlier calls" the trigger; a two-call case in a
    # fresh worker is then where the stale operand can be seen beside the call it came from.
    def alone(c: Case, fresh: Worker | None = None) -> Outcome:
        with fresh or Worker(runner.device_type) as worker:
            return outcome_of(c, device, runner=worker)
    if runner is not None and case.steps == 1 and not base.crashed and not alone(case, spare).fails:
        result.trigger.append("only from the second call (state that earlier calls in the process left)")
        result.trigger_operands.append("")
        # two calls of the case; of a Gaussian one too, where the case's data hides a stale operand
        # (all-zero data: the update between the calls leaves the weight as it was)
        for twice in dict.fromkeys([case.replace(steps=2), case.replace(steps=2, dist=Dist.NORMAL)]):
            twice_outcome = alone(twice)
            if twice_outcome.fails:
                numeric_case, numeric = twice, twice_outcome
                diagnosis_runner = Worker(runner.device_type)
                break
    if base.crashed:
        with_numbers = [(c, o) for c, o in running if o.numeric]
        if with_numbers:
            numeric_case, numeric = with_numbers[0]
            result.crash = dict(message=next(v.message for v in base.violations if v.metric == "crash"),
                                trigger=crash_triggers)
            result.trigger = [t for t in result.trigger if t not in crash_triggers]
    # With M, K, N not all distinct the shapes of a _scaled_mm call cannot say which backward GEMM
    # it is: diagnose a distinct-dims twin of the case when it fails the same way.
    if len({numeric_case.M, numeric_case.K, numeric_case.N}) < 3 and "only when K == N" not in result.trigger:
        unit = plan.alignment  # M spans two blocks, so a bug along M shows on the twin too
        twin = numeric_case.replace(lead=(2 * unit,), K=3 * unit, N=unit)
        twin_outcome = outcome_of(twin, device) if diagnosis_runner is runner else alone(twin)
        if twin_outcome.fails and twin_outcome.crashed == numeric.crashed:
            numeric_case, numeric = twin, twin_outcome
    lap("triggers")
    result.diagnosed_case = numeric_case
    if numeric_case != case:
        result.evidence.append(f"diagnosed on {numeric_case.id}")

    # 2. the diagnosis along the data path (a failure of the diagnosis itself is evidence, never a crash)
    try:
        if runner is None:
            _diagnose(result, plan, numeric_case, numeric, device)
        else:
            limit = 4 * (time_limit or default_time_limit(numeric_case.M, numeric_case.K, numeric_case.N,
                                                          torch.device(device).type))
            try:
                diagnosed = diagnosis_runner.call(_diagnosed, result, plan, numeric_case, numeric, device,
                                                  time_limit=limit)
            finally:
                if diagnosis_runner is not runner:
                    diagnosis_runner.close()
            if isinstance(diagnosed, Died):
                raise RuntimeError(diagnosed.message)
            result = diagnosed
    except (Exception, WorkerError) as err:  # noqa: BLE001 - whatever the implementation did, the localization reports
        result.evidence.append(f"the diagnosis could not finish: {type(err).__name__}: {err}")
        result.gemm = result.gemm or sorted({v.tensor for v in numeric.violations if v.tensor in GEMMS},
                                            key=_gemm_order)
        result.first = result.gemm[0] if result.gemm else None
        result.category, result.operand = result.category or "unknown", result.operand or "unknown"
    lap("diagnosis")
    if device == "cuda":
        on_cpu = outcome_of(case, "cpu")
        if not on_cpu.fails:
            result.trigger.append("only on the GPU")
        elif all(_is_gpu_lint(v) for v in on_cpu.violations) and not all(_is_gpu_lint(v) for v in base.violations):
            # the CPU runs the call with the right numbers; only the contract lint (which knows the H100's
            # rules) or the recorded call's flag shows it there: the numbers differ only on the GPU
            result.trigger.append("only on the GPU (the CPU runs this call; there the contract lint flags it)"
                                  if any(v.metric == "scaled_mm_contract" for v in on_cpu.violations) else
                                  "only on the GPU (the CPU ignores use_fast_accum; its recorded call shows the flag)")
    lap("on the CPU")
    return result


def _diagnosed(result: Localization, plan: CheckPlan, case: Case, outcome: Outcome, device: str) -> Localization:
    """_diagnose in a worker process: the localization comes back with the diagnosis added."""
    _diagnose(result, plan, case, outcome, device)
    return result


# The diagnosis runs hundreds of small float64 GEMMs and reductions on the host, where torch's
# default of one thread per core costs more than it gains: on the H200 machine (16 cores) a
# blockwise bug's diagnosis took 12.8 s with the default 16 threads, alone on the machine, and
# 4.7 s with 2, while eight such processes shared it (heldout9 bug_bw_01).
DIAGNOSIS_THREADS = 2


@contextlib.contextmanager
def _host_threads(count: int):
    before = torch.get_num_threads()
    torch.set_num_threads(min(count, before))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _diagnose(result: Localization, plan: CheckPlan, case: Case, outcome: Outcome, device: str) -> None:
    with _host_threads(DIAGNOSIS_THREADS):
        _diagnose_case(result, plan, case, outcome, device)


def _diagnose_case(result: Localization, plan: CheckPlan, case: Case, outcome: Outcome, device: str) -> None:
    candidate, recipe = plan.candidate, plan.candidate.recipe
    data = make_data(case, device)
    host = data.on_host()
    execution = execute(candidate, data, record=True, keep_data=True)
    fp8 = recipe.is_fp8 and not candidate.exact
    if fp8:  # one GEMM per call, for every stage below (a call whose shapes fit two: the oracle it matches)
        execution.calls = resolve_calls(execution.calls, host.steps, recipe, case)
    numeric = outcome.numeric
    diverging = sorted({v.tensor for v in numeric}, key=_gemm_order)
    crashes = [v for v in outcome.violations if v.metric == "crash"]
    problems = [(call, role, category, message) for call in execution.calls
                for role, category, message in sm90_problems(call)]
    findings: list[Finding] = []
    matches: list[Match] = []
    if fp8 and execution.calls:
        findings = call_findings(execution.calls, host.steps, recipe, case)
        result.method = "recorded calls"
        if case.steps == 1 and any(f.stage == "scale" and not f.category for f in findings):
            findings = _kept_scales(findings, candidate, case, recipe, device)
    # calls an H100 rejects: a finding of their GEMM (a crash there comes first: the GPU never gets further)
    for call, role, category, message in problems:
        gemm = next((g for g in call.gemm.split("|") if g in GEMMS), None)
        if gemm is not None:
            operand = OPERANDS[gemm][0 if role == "a" else 1] if role in ("a", "b") else "result"
            findings.append(Finding(call.step, gemm, operand, "calls" if category == "crash" else "gpu_rule",
                                    f"{gemm} GEMM: {message}", category))
    # unit scales in a call: applied after the GEMM (a rounding-level difference) or never (a scale bug)
    for index, finding in enumerate(findings):
        if finding.stage != "unit_scales" or finding.step >= len(execution.steps):
            continue
        got_result = execution.steps[finding.step][finding.gemm]
        exact = oracles.rounded_like_result(getattr(emulated_steps_of(host, recipe)[finding.step], finding.gemm),
                                            case, finding.gemm, recipe)
        db = -math.inf if got_result is None else compare(got_result.cpu(), exact.reshape(got_result.shape))["sqnr_db"]
        category, what = (("accumulation", "applied to the result after the GEMM: a second rounding")
                          if db >= ACCUMULATION_DB else ("scale", "never applied to the result"))
        findings[index] = Finding(finding.step, finding.gemm, "result", "unit_scales",
                                  f"the call's scales are all ones while its fp8 operands are the recipe's: the "
                                  f"scales are {what} ({db:.1f} dB from the exact result)", category)
    # the results' dtypes, shapes and strides (nn.Linear's contract): a finding of their GEMM
    for violation in outcome.violations:
        if violation.metric == "contract" and violation.tensor in GEMMS:
            gemm, operand = violation.tensor, "result"
            # an operand written in place (reported with the output): blamed on the first GEMM that then
            # computes a wrong result from it (grad_output: a backward GEMM)
            moved = next((op for op in ("grad_output", "input", "weight")
                          if f"{op} was modified in place" in violation.message), None)
            if moved is not None:
                later = [g for g in diverging if g in GEMMS and (moved != "grad_output" or g != "output")]
                gemm, operand = (later[0] if later else "grad_input" if moved == "grad_output" else "output"), moved
            findings.append(Finding(violation.step, gemm, operand, "contract" if moved is None else "in_place",
                                    violation.message, "contract"))
    if crashes and execution.forward_outputs and not any(f.stage == "contract" for f in findings):
        expected = expected_contract(case, compute_dtype=candidate.compute_dtype)["output"]
        for problem in contract_violations(execution.forward_outputs[0], expected, "output"):
            findings.append(Finding(0, "output", "result", "contract", f"output (step 0): {problem} (before the "
                                    f"crash)", "contract"))
    # GEMMs whose calls are the recipe's but whose results are not: the result stage
    bounded = {(v.step, v.tensor) for v in numeric if v.metric in ("accumulation_bound", "nonfinite")}
    # a grad_bias that breaks nn.Linear's contract: the bias is the output GEMM's, whose result is then
    # explained even within the bound (a GPU's is loose enough to hide a dropped bias)
    if host.bias is not None:
        bounded |= {(v.step, "output") for v in outcome.violations if v.tensor == "grad_bias"}
    flagged = {(f.step, f.gemm) for f in findings}
    for step_index, gemm in sorted(bounded, key=lambda k: (k[0], _gemm_order(k[1]))):
        if gemm not in GEMMS or (step_index, gemm) in flagged or step_index >= len(execution.steps) \
                or not any(step_index == c.step and gemm in c.gemm.split("|") for c in execution.calls):
            continue
        got_result = execution.steps[step_index][gemm]
        exact = getattr(emulated_steps_of(host, recipe)[step_index], gemm)
        explained = None if got_result is None else explain_result(
            got_result, exact, case, gemm, recipe, bias=host.bias if gemm == "output" else None,
            scales=gemm_inverse_scales(host.steps[step_index], gemm, recipe))
        if explained is not None:
            findings.append(Finding(step_index, gemm, explained.operand, "result",
                                    f"{explained.description} (every recorded operand is the recipe's)",
                                    explained.category))
    # GEMMs of the case that made no call: by behaviour, where their results diverge and before the first
    # that does (a GEMM within a loose bound, the tensor cores' on a GPU, can still be nearer a mistake)
    called = {g for call in execution.calls for g in call.gemm.split("|")}
    first_diverging = min((_gemm_order(g) for g in diverging if g in GEMMS), default=len(GEMMS))
    uncalled = [g for g in GEMMS if g not in called and (g in diverging or _gemm_order(g) < first_diverging)]
    steps_done = [i for i in range(len(execution.steps))]
    step = min((v.step for v in numeric), default=0)
    got = {}
    if step in steps_done:
        got = {g: execution.steps[step][g].detach().cpu() for g in uncalled if execution.steps[step][g] is not None}
    elif execution.forward_outputs and "output" in uncalled and step < len(execution.forward_outputs):
        got = {"output": execution.forward_outputs[step].detach().cpu()}
    if fp8 and got:
        matches = diagnose_behaviour(got, step, host.steps, case, recipe, list(got), bias=host.bias,
                                     strided=strides_ignored(host.steps[step], case))
        # a GEMM within the bound counts only where it is as far from the correct emulation as operand
        # mistakes leave it, and a mistake is much nearer
        matches = [m for m in matches if m.gemm in diverging or (m.is_mistake and m.correct_db < ACCUMULATION_DB)]
        result.method = result.method or "behaviour"
    if fp8 and not execution.calls and got:
        hp_db, fp8_db = high_precision_closeness(got, host.steps[step], case, recipe)
        result.evidence.append(f"no _scaled_mm call was recorded: its results are {hp_db:.1f} dB from the exact "
                               f"high-precision product and {fp8_db:.1f} dB from the exact {recipe.name} FP8 result")
    # an FP8 GEMM of the recipe that made no call and whose result is the high-precision product
    for gemm_name, value in got.items() if fp8 else ():
        if recipe.gemm(gemm_name).high_precision or not bool(torch.isfinite(value).all()):
            continue
        hp_db, fp8_db = high_precision_closeness({gemm_name: value}, host.steps[step], case, recipe)
        if hp_db >= MATCH_DB and hp_db >= fp8_db + 10:
            findings.append(Finding(step, gemm_name, "result", "calls",
                                    f"no _scaled_mm call for {gemm_name} and its result is the high-precision "
                                    f"product ({hp_db:.1f} dB from it, {fp8_db:.1f} dB from the exact {recipe.name} "
                                    f"FP8 result): this GEMM does not run in FP8", "precision"))
    # a call that writes another dtype than the recipe's, on a GEMM whose result is wrong
    for call in execution.calls:
        gemm_name = next((g for g in call.gemm.split("|") if g in diverging), None)
        if gemm_name is None or call.out_dtype is None or recipe.gemm(gemm_name).high_precision:
            continue
        want = oracles.rounding_chain(case, gemm_name, recipe)[0]
        if call.out_dtype != str(want).replace("torch.", ""):
            findings.append(Finding(call.step, gemm_name, "result", "out_dtype",
                                    f"the {gemm_name} call writes {call.out_dtype} where the {recipe.name} recipe's "
                                    f"GEMM writes {str(want).replace('torch.', '')}: another rounding of the sums "
                                    f"(or their overflow)", "accumulation"))

    # grad_bias is grad_output summed over tokens, whatever the GEMMs do: k times that sum says the
    # bias enters the output k times (twice: added by two layers of the code; none: dropped)
    if "grad_bias" in diverging and host.bias is not None:
        step_index = min(v.step for v in numeric if v.tensor == "grad_bias")
        got_bias = execution.steps[step_index]["grad_bias"] if step_index < len(execution.steps) else None
        want_bias = host.steps[step_index].grad_output.reshape(-1, case.N).to(torch.float64).sum(0)
        if got_bias is not None and want_bias.abs().sum() > 0:
            times = float((got_bias.detach().cpu().to(torch.float64) * want_bias).sum() / (want_bias ** 2).sum())
            if abs(times - round(times)) < 0.02 and round(times) != 1:
                findings.append(Finding(step_index, "output", "result", "result",
                                        f"grad_bias is {round(times)} times grad_output summed over the tokens: the "
                                        f"bias enters the output {round(times)} times instead of once", "contract"))
    # the GEMMs to blame: diverging tensors and GEMMs with an explained finding, in GEMM order
    gemms = sorted(set(diverging) | {f.gemm for f in findings if f.category} | {m.gemm for m in matches},
                   key=_gemm_order) or \
        sorted({f.gemm for f in findings} | {m.gemm for m in matches}, key=_gemm_order)
    if crashes and not numeric:
        gemms = _crash_gemms(crashes[0], execution, recipe)
        result.method = "crash"
    if not gemms:  # grad_bias is the output GEMM's (its bias)
        gemms = sorted({"output" if v.tensor == "grad_bias" else v.tensor for v in outcome.violations} & set(GEMMS),
                       key=_gemm_order)
    if not gemms and problems:
        gemms = sorted({g for call, *_ in problems for g in call.gemm.split("|") if g in GEMMS}, key=_gemm_order)
    result.gemm, result.first = gemms, gemms[0] if gemms else None
    result.category, result.operand = _classify(result, outcome, findings, matches, problems, crashes, case,
                                                recipe, execution, host)
    result.diagnosis = [dict(step=f.step, gemm=f.gemm, operand=f.operand, stage=f.stage, category=f.category,
                             message=f.message) for f in findings] + \
                       [dict(step=step, gemm=m.gemm, operand=m.operand, stage="behaviour", category=m.category,
                             message=f"matches the exact emulation with {m.description} ({m.db:.1f} dB; the correct "
                                     f"emulation: {m.correct_db:.1f} dB)") for m in matches]
    _evidence(result, plan, case, outcome, findings, matches, execution, data)


def _kept_scales(findings: list[Finding], candidate, case: Case, recipe, device: str) -> list[Finding]:
    """A first call's scale that no single mistake reproduces may be one kept from call to call (delayed
    scaling: the first call gets an initial value, each later call the scale of the call before). A
    second call tells: where its scale is the first call's (the stale_state hypothesis of
    parity.diagnose), the unexplained scale of the first call is named so."""
    twice = case.replace(steps=2)
    data = make_data(twice, device)
    host = data.on_host()
    execution = execute(candidate, data, record=True, keep_data=True)
    if not execution.calls:
        return findings
    calls = resolve_calls(execution.calls, host.steps, recipe, twice)
    kept = {(f.gemm, f.operand): f for f in call_findings(calls, host.steps, recipe, twice)
            if f.step == 1 and f.category == "stale_state" and f.stage == "scale"}
    return [Finding(f.step, f.gemm, f.operand, "scale", f"{f.message}. On a second call ({twice.id}) {second.message}",
                    "stale_state")
            if f.stage == "scale" and not f.category and (second := kept.get((f.gemm, f.operand))) else f
            for f in findings]


def _gemms_of(calls) -> set[tuple[int, str]]:
    """(step, GEMM) of each of these recorded calls."""
    return {(call.step, gemm) for call in calls for gemm in call.gemm.split("|") if gemm in GEMMS}


def _rejected(execution, crash: Violation) -> set[tuple[int, str]]:
    """(step, GEMM) of each recorded call the kernel raised on that is the crash: its exception is the one
    that ended the case (a call rejected and caught, as code that falls back to its own GEMM on a CPU
    does, is not)."""
    ended = f"{crash.value} {crash.message}"
    return _gemms_of(call for call in execution.calls if call.raised and call.error in ended)


def _crash_gemms(crash: Violation, execution, recipe) -> list[str]:
    """The GEMM a crash happened in: that of a call the kernel rejected; else the forward's; in the
    backward, the first backward GEMM that made no recorded call (the calls made before the crash
    are the GEMMs that ran)."""
    rejected = sorted(_rejected(execution, crash), key=lambda key: (key[0], _gemm_order(key[1])))
    if rejected:  # the kernel raised on this call
        return [rejected[0][1]]
    where = str(crash.value)
    if ": forward:" in where or "building" in where:
        return ["output"]
    done = {g for call in execution.calls if call.phase == "backward" for g in call.gemm.split("|")}
    pending = [g for g in ("grad_input", "grad_weight") if g not in done and not recipe.gemm(g).high_precision]
    return pending[:1] or ["grad_weight" if recipe.gemm("grad_weight").high_precision else "grad_input"]


def _first_operand(gemms: Sequence[str]) -> str:
    """The operand a pattern of diverging GEMMs shares (one GEMM: its result)."""
    gemms = [g for g in gemms if g in GEMMS]
    if len(gemms) == 1:
        return "result"
    shared = set(OPERANDS[gemms[0]]).intersection(*(OPERANDS[g] for g in gemms[1:])) if gemms else set()
    return shared.pop() if len(shared) == 1 else "unknown"


def _classify(result: Localization, outcome: Outcome, findings: list[Finding], matches: list[Match], problems,
              crashes, case: Case, recipe, execution, host) -> tuple[str, str]:
    """(category, operand) from the evidence, the first GEMM and stage that differ first."""
    triggers = result.trigger
    numeric = outcome.numeric
    stale = "only from the second call" in triggers
    layout_operand = next((op for op, t in zip(result.trigger_operands, triggers)
                           if t.startswith("only with non-contiguous")), None)
    diverging = {v.tensor for v in numeric}

    def by_layout(category: str) -> str:
        """An operand rearranged only when some operand is stored non-contiguously: the result depends on
        the strides of the same logical values (layout), not on a transpose in the code's math."""
        if category == "transpose" and layout_operand:
            result.evidence.append(f"the rearranged operand shows only with a non-contiguous {layout_operand}: "
                                   f"the code reads memory by the wrong strides (layout)")
            return "layout"
        return category

    # a GEMM whose result is right: what the caller sees (the contract) first; so too a result handed back
    # in another dtype than nn.Linear's, which an out_dtype finding of the same GEMM only explains
    dtype_contract = {(f.step, f.gemm) for f in findings if f.stage == "contract" and "dtype is" in f.message}

    def stage_rank(f: Finding) -> int:
        if f.stage == "contract" and (f.gemm not in diverging or (f.step, f.gemm) in dtype_contract):
            return -1
        return STAGE_ORDER.index(f.stage) if f.stage in STAGE_ORDER else 9
    ordered = sorted(findings, key=lambda f: (f.step, _gemm_order(f.gemm), stage_rank(f)))
    explained = [f for f in ordered if f.category]
    # a GEMM diagnosed by behaviour before the first GEMM with an explained finding comes first
    first_match = min(matches, key=lambda m: _gemm_order(m.gemm), default=None)
    match_step = min((v.step for v in numeric), default=0)
    if explained and first_match is not None and not (crashes and not numeric) and \
            (match_step, _gemm_order(first_match.gemm)) < (explained[0].step, _gemm_order(explained[0].gemm)):
        explained = []
    if crashes and not numeric:
        # the GEMMs that ran before the crash were already handed the wrong operands; the call that raised
        # counts only where the kernel rejected it for a rule that names a class (its operands' memory order,
        # their fp8 formats: cuBLASLt's layout and e5m2 x e5m2 rules): then what that call was handed is the
        # bug, and the crash its symptom. A scale tensor the kernel refuses is the crash itself.
        rejected = _rejected(execution, crashes[0]) - _gemms_of(call for call, _, category, _ in problems
                                                    if call.raised and category in NAMED_BY_REJECTION)
        explained = [f for f in explained if (f.step, f.gemm) not in rejected]
        if explained:
            result.crash = dict(message=crashes[0].message, trigger=[t for t in triggers])
            result.gemm = sorted({f.gemm for f in explained}, key=_gemm_order)
            result.first = result.gemm[0]
            return explained[0].category, explained[0].operand
        named = [op for op in result.trigger_operands if op]
        return "crash", named[0] if named else ("input" if result.first == "output" else "grad_output")
    if explained:
        first = explained[0]
        if stale and first.category not in ("stale_state",) and not any(f.category == "stale_state"
                                                                          for f in explained):
            return "stale_state", _first_operand(result.gemm)
        stale_finding = next((f for f in explained if f.category == "stale_state"), None)
        first = stale_finding or first
        return by_layout(first.category), first.operand
    if matches:
        return by_layout(first_match.category), first_match.operand
    if ordered:  # differences no single mistake explains: the stage says where, the triggers what
        first = ordered[0]
        if stale:
            return "stale_state", first.operand
        if layout_operand:
            return "layout", layout_operand
        return ("scale" if first.stage == "scale" else "unknown"), first.operand
    if problems and not numeric:  # a call the CPU runs and the H100 rejects: the rule says what
        call, role, category, _ = problems[0]
        gemm = next((g for g in call.gemm.split("|") if g in GEMMS), "output")
        return category, OPERANDS[gemm][0 if role == "a" else 1] if role in ("a", "b") else "result"
    if not numeric:
        return "contract", "result"
    if stale:
        return "stale_state", _first_operand(result.gemm)
    if layout_operand:
        return "layout", layout_operand
    # every recorded call is the recipe's and no transform of the result explains it: rounding only?
    if not any(v.metric in ("accumulation_bound", "nonfinite") for v in numeric):
        result.evidence.append("every stage of the recorded calls equals the oracle's and the results lie within "
                               "the accumulation bound of the exact result: a rounding-level difference")
        return "accumulation", "result"
    if any(v.metric == "nonfinite" for v in numeric):
        return "saturation", _first_operand(result.gemm)
    result.evidence.append("unexplained: compared and equal: " + (
        "the fp8 formats, scales and values of every recorded call; " if execution.calls else "") +
        "no hypothesis of the space (operand and result mistakes) reproduces the results")
    return "unknown", _first_operand(result.gemm)


def _evidence(result: Localization, plan: CheckPlan, case: Case, outcome: Outcome, findings, matches, execution,
              data) -> None:
    result.evidence += [f"{v.metric}: {v.full_message}" for v in outcome.violations[:6]
                        if v.metric not in ("scaled_mm_contract", "operand")]
    result.evidence += [f"stage {f.stage}: {f}" for f in findings[:8]]
    diverging = {v.tensor for v in outcome.numeric}
    result.evidence += [f"behaviour: {m.gemm}: matches the exact emulation with {m.description} ({m.db:.1f} dB; "
                        f"the correct emulation: {m.correct_db:.1f} dB)" + ("" if m.gemm in diverging else
                        "; its result is within the accumulation bound here, yet nearer this mistake")
                        for m in matches]
    if result.crash:
        result.evidence.append(f"crash: {result.crash['message']} "
                               f"({'; '.join(result.crash['trigger']) or 'on the minimal case'})")
    reference_run = execute(plan.reference, data, record=plan.reference.recipe.is_fp8)
    result.evidence += _call_differences(execution.calls, reference_run.calls, plan.reference.name)
    result.evidence += [f"recorded call: {call.describe()}" for call in execution.calls
                        if set(call.gemm.split("|")) & set(result.gemm)][:6]
    missing = missing_tensors(execution, case)
    if missing:
        result.evidence.append(f"relations not checked: {missing}")
    if execution.error or missing:
        return
    for relation in RELATIONS:
        if relation.applies(case):
            outcome_ = check_relation(relation, plan.candidate, data, base=execution)
            if not outcome_.holds:
                result.evidence.append(f"relation {relation.name} fails ({relation.description}): "
                                       f"{outcome_.error or '; '.join(outcome_.broken[:2])}")
    contiguous = (Layout.CONTIGUOUS,) * 3
    layouts = (case.input_layout, case.weight_layout, case.grad_output_layout)
    other_layouts = contiguous if layouts != contiguous else (Layout.TRANSPOSED,) * 3
    layout_outcome = check_layout_invariance(plan.candidate, data, other_layouts, base=execution)
    if not layout_outcome.holds:
        result.evidence.append(f"relation {layout_outcome.relation} fails: "
                               f"{layout_outcome.error or '; '.join(layout_outcome.broken[:2])}")
    if case.steps > 1:
        update = check_weight_update(plan.candidate, data, base=execution)
        if not update.holds:
            result.evidence.append(f"relation weight_update fails: {update.error or '; '.join(update.broken[:2])}")


def render(result: Localization) -> str:
    plan = result.plan
    if result.verdict == "pass":
        return (f"PASS: {plan.candidate.name} shows no violation against {plan.reference.name} on {result.device}: "
                f"nothing to localize.\n")
    if result.verdict == "error":
        return f"ERROR: {result.error}\n"
    lines = [
        f"FAIL: {plan.candidate.name} ({plan.candidate.recipe.name} recipe) against {plan.reference.name} on "
        f"{result.device}",
        f"  minimal case : {result.minimal_case.id}",
        f"  GEMM         : {', '.join(result.gemm)} (first: {result.first})",
        f"  operand      : {result.operand}",
        f"  bug class    : {result.category}",
        f"  trigger      : {'; '.join(result.trigger) or 'none: shows on the simplest case'}",
        *([f"  also        : a crash ({result.crash['message']}), "
           f"{'; '.join(result.crash['trigger']) or 'on the minimal case'}"] if result.crash else []),
        f"  diagnosed by : {result.method or 'the violations'}",
        "  evidence:",
        *[f"    - {line}" for line in result.evidence],
        "",
        f"Rerun: fp8-parity check --impl {plan.candidate.name} --against {plan.reference.name} --device "
        f"{result.device} --case '{result.minimal_case.id}'",
    ]
    return "\n".join(lines) + "\n"



