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

The steps live in their own modules: parity.triggers (1), parity.case_findings (2),
parity.classification (3), parity.evidence (4); parity.localization holds the result type.

The bug classes: transpose, layout, scale, fp8_dtype, saturation, accumulation, contract,
stale_state, crash, and precision (a GEMM in another precision than the recipe's).
"""

from __future__ import annotations

import contextlib
import functools
import time
from dataclasses import dataclass
from typing import Callable

import torch

from parity.case_findings import examine, run_again
from parity.cases import Case, Dist, SavedCase
from parity.check import CheckPlan, check_command, rerun_command, run_check
from parity.classification import blame, classify
from parity.evidence import add_evidence
from parity.findings import Finding, Headline, Trigger, labels
from parity.headline import flag_triggers
from parity.impls import builtin_for_recipe, load_impl, recipe_flag, with_reciprocal_scales
from parity.localization import CrashNote, Localization, Outcome, gemm_order, is_gpu_lint
from parity.mistakes import RECIPROCAL_SCALES_HYPOTHESIS
from parity.names import CHECK_SEARCH
from parity.recipes import GEMMS
from parity.runner import executing_in, isolation, run_case_isolated
from parity.triggers import flip_conditions, more_distributions, more_dtypes, one_condition_more
from parity.vocabulary import BugClass, Condition, Kind, Operand, Verdict
from parity.worker import Worker, WorkerError, default_time_limit

__all__ = ["Localization", "localize", "render"]


def _outcome(plan: CheckPlan, case: Case, device: str, runner: Worker | None = None,
             time_limit: float | None = None) -> Outcome:
    return Outcome(plan.judge(run_case_isolated(case, plan.comparisons, device=device, runner=runner,
                                                time_limit=time_limit)))


def _rounds_scales_through_a_reciprocal(finding: Finding) -> bool:
    """A finding explained by scales computed as fp8_max * (1 / amax) in float32 (the record
    parity.mistakes.RECIPROCAL_SCALES_HYPOTHESIS; equal, not identical, after a worker sent it back)."""
    return getattr(finding, "hypothesis", None) == RECIPROCAL_SCALES_HYPOTHESIS


def localize(plan: CheckPlan, *, device: str = "cpu", case: Case | None = None, max_examples: int = 100,
             seed: int = 0, isolate: bool | None = None, time_limit: float | None = None) -> Localization:
    """Find (or take) a minimal failing case and localize its bug. With `isolate` (by default when
    any implementation is not a built-in: parity.runner.isolation) the code under
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
            if result.verdict is not Verdict.FAIL or plan.candidate.recipe.reciprocal_scales or \
                    not any(_rounds_scales_through_a_reciprocal(finding) for finding in result.findings):
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
            again = relocalize([case] if case else [result.minimal_case, *one_condition_more(result.minimal_case,
                                                                                             adopted, device)])
            if again.verdict is not Verdict.FAIL and case is None:
                variants = again
                again = relocalize(None)
                again.seconds = {**{f"{phase} (variants)": value for phase, value in variants.seconds.items()},
                                 **again.seconds}
        finally:
            if spare is not None:
                spare.close()
    if again.verdict is not Verdict.FAIL:
        return result
    again.evidence.insert(0, f"its scales are computed as fp8_max * (1 / amax) in float32, one ulp off the exact "
                             f"quotient in some groups ({result.category} in {result.first} on "
                             f"{result.minimal_case.id}, read alone); localized again against a recipe that "
                             f"rounds its scales so, it still fails: the mistake beside that rounding is this")
    again.seconds = {**{f"{phase} (exact scales)": value for phase, value in result.seconds.items()},
                     **again.seconds}
    return again


@dataclass
class _Search:
    """Where a localization runs its cases: the plan, the device, the check's worker (None: this
    process), the spare worker for a case alone in a fresh process, and each case's time limit."""

    plan: CheckPlan
    device: str
    runner: Worker | None
    spare: Worker | None
    time_limit: float | None

    def __post_init__(self):
        self.outcome_of = functools.partial(_outcome, self.plan, runner=self.runner, time_limit=self.time_limit)

    def alone(self, case: Case, fresh: Worker | None = None) -> Outcome:
        """The case alone in a fresh worker (`fresh`, closed after)."""
        with fresh or Worker(self.runner.device_type) as worker:
            return self.outcome_of(case, self.device, runner=worker)


class _Clock:
    """Where a bisect spends its time, in the JSON (`seconds`)."""

    def __init__(self):
        self.clock = time.perf_counter()

    def lap(self, result: Localization, phase: str) -> None:
        now = time.perf_counter()
        result.seconds[phase] = result.seconds.get(phase, 0.0) + now - self.clock
        self.clock = now


def _localize(plan: CheckPlan, device: str, cases: list[Case] | None, max_examples: int, seed: int,
              runner: Worker | None, time_limit: float | None, spare: Worker | None = None) -> Localization:
    """Localize the first failure among `cases` (None: search for one and shrink it)."""
    clock = _Clock()
    # the minimal case alone in a fresh worker is step 1's business (in the spare started beside the check):
    # the check's own rerun would wait for another fresh worker, 10-14 s on the H200
    found = run_check(plan, device=device, max_examples=max_examples, seed=seed, cases=cases, runner=runner,
                      isolate=runner is not None, time_limit=time_limit, rerun_alone=False, name_failure=False)
    result = Localization(found.verdict, plan, device, found.minimal_case, error=found.error,
                          cases_run=found.cases_run, search_budget=max_examples if cases is None else None)
    clock.lap(result, "check")
    if found.verdict is not Verdict.FAIL:
        return result
    case, base = found.minimal_case, Outcome(found.violations)
    search = _Search(plan, device, runner, spare, time_limit)
    result.violations = base.violations

    # 1. triggers, by flipping one condition at a time (the crash's apart from the numbers')
    crash_triggers, running = flip_conditions(result, case, base, device, search.outcome_of, plan.alignment)
    more_distributions(result, case, device, search.outcome_of)
    more_dtypes(result, plan, case, device, search.outcome_of)
    numeric_case, numeric, diagnosis_runner = _case_to_diagnose(result, search, case, base, crash_triggers, running)
    clock.lap(result, "triggers")
    result.diagnosed_case = numeric_case
    if numeric_case != case:
        result.evidence.append(f"diagnosed on {numeric_case.id}")

    # 2.-4. the diagnosis along the data path (a failure of the diagnosis itself is evidence, never a crash)
    result = _run_diagnosis(result, search, numeric_case, numeric, diagnosis_runner)
    clock.lap(result, "diagnosis")
    if device == "cuda":
        _gpu_triggers(result, search, case, base)
    else:  # the CPU's numbers are right and only the recorded calls show the bug: it shows only on the GPU
        result.triggers += [t for t in flag_triggers(base.violations) if t not in result.triggers]
    clock.lap(result, "on the CPU")
    return result


# Cases a layer that crashed on the minimal case runs next, to find wrong numbers: a mistake that raises on some
# shapes only (a scale tensor of another size, which the kernel refuses) and fits others, where it computes
# silently wrong results (held-out set 16: blocks of 64 fit a contraction of 128; unswizzled scales fit 128x128).
# A silent wrong result is the finding a user most needs; the crash stays in the report beside it.
SILENT_PROBE_SIZES = (128, 256)


def _silently_wrong(search: _Search, case: Case) -> list[tuple[Case, Outcome]]:
    """The first of the probe cases (the minimal case at M = K = N = 128, then 256) whose numbers are wrong
    without a crash; [] where none is."""
    for size in SILENT_PROBE_SIZES:
        probe = case.replace(lead=(size,), K=size, N=size)
        if probe == case:
            continue
        outcome = search.outcome_of(probe, search.device)
        if outcome.numeric and not outcome.crashed:
            return [(probe, outcome)]
    return []


def _case_to_diagnose(result: Localization, search: _Search, case: Case, base: Outcome,
                      crash_triggers: list[Trigger], running: list) -> tuple[Case, Outcome, Worker | None]:
    """The case the diagnosis runs on, its outcome, and the worker it runs in."""
    numeric_case, numeric, diagnosis_runner = case, base, search.runner
    # State left by earlier calls in the process (a cache keyed by shape, a global): the minimal case
    # alone in a fresh worker. Passing there makes "earlier calls" the trigger; a two-call case in a
    # fresh worker is then where the stale operand can be seen beside the call it came from.
    if search.runner is not None and case.steps == 1 and not base.crashed and \
            not search.alone(case, search.spare).fails:
        result.triggers.append(Trigger(Condition.EARLIER_CALLS))
        # two calls of the case; of a Gaussian one too, where the case's data hides a stale operand
        # (all-zero data: the update between the calls leaves the weight as it was)
        for twice in dict.fromkeys([case.replace(steps=2), case.replace(steps=2, dist=Dist.NORMAL)]):
            twice_outcome = search.alone(twice)
            if twice_outcome.fails:
                numeric_case, numeric = twice, twice_outcome
                diagnosis_runner = Worker(search.runner.device_type)
                break
    if base.crashed:
        with_numbers = [(c, o) for c, o in running if o.numeric] or _silently_wrong(search, case)
        if with_numbers:
            numeric_case, numeric = with_numbers[0]
            result.crash = CrashNote(base.crashes[0].message, tuple(crash_triggers))
            result.triggers = [t for t in result.triggers if t not in crash_triggers]
    # With M, K, N not all distinct the shapes of a _scaled_mm call cannot say which backward GEMM
    # it is: diagnose a distinct-dims twin of the case when it fails the same way. Not a case file's:
    # its tensors are what training diverged on (a twin would crop them), and the oracle each call
    # matches tells its GEMM (parity.call_diagnosis.assign_calls)
    if not isinstance(numeric_case, SavedCase) and len({numeric_case.M, numeric_case.K, numeric_case.N}) < 3 and \
            not any(t.condition is Condition.K_EQUALS_N for t in result.triggers):
        unit = search.plan.alignment  # M spans two blocks, so a bug along M shows on the twin too
        twin = numeric_case.replace(lead=(2 * unit,), K=3 * unit, N=unit)
        twin_outcome = search.outcome_of(twin, search.device) if diagnosis_runner is search.runner \
            else search.alone(twin)
        if twin_outcome.fails and twin_outcome.crashed == numeric.crashed:
            numeric_case, numeric = twin, twin_outcome
    return numeric_case, numeric, diagnosis_runner


def _run_diagnosis(result: Localization, search: _Search, case: Case, outcome: Outcome,
                   diagnosis_runner: Worker | None) -> Localization:
    """_diagnose, here, with every run of the code under test in `diagnosis_runner` when there is one (each
    within a case's time limit): the localization with the diagnosis added, or with what stopped it."""
    plan, device = search.plan, search.device
    try:
        if search.runner is None:
            _diagnose(result, plan, case, outcome, device)
        else:
            limit = search.time_limit or default_time_limit(case.M, case.K, case.N, torch.device(device).type)
            try:
                with executing_in(diagnosis_runner, limit):
                    _diagnose(result, plan, case, outcome, device)
            finally:
                if diagnosis_runner is not search.runner:
                    diagnosis_runner.close()
    except (Exception, WorkerError) as err:  # noqa: BLE001 - whatever the implementation did, the localization reports
        result.evidence.append(f"the diagnosis could not finish: {type(err).__name__}: {err}")
        result.gemm = result.gemm or sorted({v.tensor for v in outcome.violations if v.tensor in GEMMS},
                                            key=gemm_order)
        result.first = result.gemm[0] if result.gemm else None
        result.category, result.operand = result.category or BugClass.UNKNOWN, result.operand or Operand.UNKNOWN
    return result


def _gpu_triggers(result: Localization, search: _Search, case: Case, base: Outcome) -> None:
    """On a GPU: whether the CPU shows the failure too."""
    on_cpu = search.outcome_of(case, "cpu")
    if not on_cpu.fails:
        result.triggers.append(Trigger(Condition.GPU))
    elif all(is_gpu_lint(v) for v in on_cpu.violations) and not all(is_gpu_lint(v) for v in base.violations):
        # the CPU runs the call with the right numbers; only the contract lint (which knows the H100's
        # rules) or the recorded call's flag shows it there: the numbers differ only on the GPU
        linted = any(v.kind is Kind.SCALED_MM_CONTRACT for v in on_cpu.violations)
        result.triggers.append(Trigger(Condition.GPU_LINTED if linted else Condition.GPU_FAST_ACCUM))


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


def _diagnose(result: Localization, plan: CheckPlan, case: Case, outcome: Outcome, device: str, *,
              evidence: bool = True) -> None:
    with _host_threads(DIAGNOSIS_THREADS):
        diagnosis = run_again(plan, case, outcome, device)
        examine(result, diagnosis, device)
        blame(result, diagnosis)
        result.category, result.operand = classify(result, diagnosis)
        result.findings = [*diagnosis.findings, *diagnosis.matches]
        if evidence:
            add_evidence(result, diagnosis)


def _named(result: Localization, plan: CheckPlan, case: Case, outcome: Outcome, device: str) -> Localization:
    """_diagnose without the evidence (the relations rerun the case many times)."""
    _diagnose(result, plan, case, outcome, device, evidence=False)
    return result


def name_failure(plan: CheckPlan, case: Case, violations: list, device: str, runner: Worker | None = None,
                 time_limit: float | None = None) -> Headline | None:
    """What bisect's diagnosis (steps 2 and 3, without the triggers' experiments) names on one failing case,
    as its headline: check, the pytest plugin and train say it where the recorded calls' operands do not
    name the failure (a result mishandled after its GEMM, a GEMM without a call), so that each tells the
    finding bisect tells. None where the diagnosis names nothing or cannot finish (the violations then
    speak for themselves). The diagnosis runs here; each rerun of code under test in `runner` when given (the
    code under test's worker), within four times a case's time limit."""
    result = Localization(Verdict.FAIL, plan, device, case, violations=list(violations))
    outcome = Outcome(list(violations))
    try:
        if runner is None:  # (the caller's executing_in routes any code under test)
            _named(result, plan, case, outcome, device)
        else:
            limit = 4 * (time_limit or default_time_limit(case.M, case.K, case.N, torch.device(device).type))
            with executing_in(runner, limit):
                _named(result, plan, case, outcome, device)
    except (Exception, WorkerError):  # noqa: BLE001 - the diagnosis of code under test may fail any way
        return None
    return result.headline


def render(result: Localization) -> str:
    plan = result.plan
    if result.verdict is Verdict.PASS:
        return _render_pass(result)
    if result.verdict is Verdict.ERROR:
        return f"ERROR: {result.error}\n"
    crash = result.crash
    lines = [
        f"FAIL: {plan.candidate.name} ({plan.candidate.recipe.name} recipe) against {plan.reference.name} on "
        f"{result.device}",
        *([f"  finding      : {result.headline}"] if result.headline is not None else []),
        f"  minimal case : {result.minimal_case.id}",
        f"  GEMM         : {', '.join(result.gemm)} (first: {result.first})" if result.gemm else
        "  GEMM         : none (the three GEMMs' results are right; grad_bias is not)",
        f"  operand      : {result.operand}",
        f"  bug class    : {result.category}",
        f"  trigger      : {'; '.join(result.trigger) or 'none: shows on the simplest case'}",
        *([f"  also        : a crash ({crash.message}), {'; '.join(labels(crash.triggers)) or 'on the minimal case'}"]
          if crash else []),
        f"  diagnosed by : {result.method or 'the violations'}",
        "  evidence:",
        *[f"    - {line}" for line in result.evidence],
        "",
        "Rerun: " + _check_command(result)(result.minimal_case),
    ]
    return "\n".join(lines) + "\n"


def _check_command(result: Localization) -> Callable[[Case], str]:
    """check's command line for a case of this localization (its Rerun line): the layer judged as bisect judged it."""
    plan = result.plan
    return rerun_command(plan.candidate.name, plan.reference.name, result.device,
                         recipe_flag(plan.candidate.name, plan.candidate.recipe.name))


def _render_pass(result: Localization) -> str:
    """No failure to localize: on the cases given, or among the cases the search ran, with check's command
    for a wider search."""
    plan = result.plan
    head = f"PASS: {plan.candidate.name} shows no violation against {plan.reference.name} on {result.device}"
    if result.search_budget is None:
        return f"{head} on the case given: nothing to localize.\n"
    wider = check_command(plan.candidate.name, plan.reference.name, result.device,
                          [*recipe_flag(plan.candidate.name, plan.candidate.recipe.name), "--max-examples",
                           str(CHECK_SEARCH)])
    return (f"{head} in {result.cases_run} cases (the edge cases, and a search of up to {result.search_budget} "
            f"generated ones): nothing to localize.\nA wider search: {wider}\n(a failing case it finds can be "
            f"localized with bisect --case)\n")
