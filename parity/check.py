"""`fp8-parity check`: search the case space for a parity violation and shrink it.

The pinned edge cases run first (zeros, amax at the fp8 max, outliers, 3-D input, K == N,
transposed layouts, two steps); then hypothesis generates cases, and when one violates
the policy it shrinks it to a minimal failing case. The result carries everything the
command prints and the JSON it writes.
"""

from __future__ import annotations

import random
import shlex
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Sequence

import pandas as pd
import torch
from hypothesis import HealthCheck, Phase, find
from hypothesis import settings as hypothesis_settings
from hypothesis.errors import Flaky, NoSuchExample

from parity import cpu_gemm
from parity.cases import Case, edge_cases, layer_case, shrink
from parity.coverage import covered
from parity.env import environment
from parity.exits import raise_if_stopped
from parity.findings import Headline
from parity.headline import of_violations
from parity.impls import Impl, ImplError, builtin_for_recipe, default_reference, hopper_reference, load_impl
from parity.metrics import describe_mismatch
from parity.policy import Policy, Violation, default_policy, evaluate
from parity.rows import Row, row_key
from parity.rows import frame as rows_frame
from parity.runner import Comparison, isolation, run_case_isolated
from parity.strategies import cases as case_strategy
from parity.recipes import GEMMS
from parity.vocabulary import Kind, Tensor, Verdict
from parity.worker import Died, Worker


@dataclass
class CheckPlan:
    """Which implementations run against which references, judged by which policies."""

    candidate: Impl
    reference: Impl
    policy: Policy
    comparisons: list[Comparison]

    @classmethod
    def make(cls, candidate: Impl, reference: Impl | None = None, *, policy: Policy | str | None = None,
             oracle: bool = True, device: str = "cpu") -> "CheckPlan":
        """The candidate against `reference` (default: default_reference); with `oracle`, also
        against its recipe's exact emulation (which separates accumulation from real bugs and
        compares the fp8 operands and scales of every recorded GEMM call)."""
        reference = reference or default_reference(candidate, torch.device(device).type)
        if reference.bit_model and hopper_reference(reference, torch.device(device).type, as_reference=True) is None:
            raise ImplError(f"--against {reference.name} judges Hopper's bits, and results on {device} are not: run "
                            f"on a GPU, or on a CPU add --cpu-gemm hopper (not for block-scaled recipes)")
        policy = Policy(policy) if policy else default_policy(candidate, reference)
        comparisons = [Comparison(candidate, reference, policy)]
        if policy is Policy.PAIRED:  # both measured against fp64 on the same inputs
            fp64 = load_impl("fp64")
            comparisons += [Comparison(candidate, fp64, Policy.NONE), Comparison(reference, fp64, Policy.NONE)]
        emulation = builtin_for_recipe("emulated", candidate.recipe)
        if oracle and candidate.recipe.is_fp8 and not candidate.exact and emulation and not (
                reference.exact and reference.recipe is candidate.recipe):
            comparisons.append(Comparison(candidate, load_impl(emulation), Policy.ACCUMULATION))
        model = hopper_reference(candidate, torch.device(device).type) if oracle else None
        if model is not None and reference.name != model.name:
            comparisons.append(Comparison(candidate, model, Policy.EXACT))  # bit for bit where calibrated
        return cls(candidate, reference, policy, comparisons)

    @property
    def alignment(self) -> int:
        return max(self.candidate.recipe.alignment, self.reference.recipe.alignment, 16)

    def unsupported(self, case: Case, device_type: str) -> str | None:
        return self.candidate.unsupported(case, device_type) or self.reference.unsupported(case, device_type)

    def judge(self, rows: Sequence[Row]) -> list[Violation]:
        return evaluate(rows, impls=[self.candidate.name])

    def reference_errors(self, rows: Sequence[Row]) -> list[str]:
        return sorted({f"{r.reference}: {r.reference_error}" for r in rows if r.reference_error is not None})


@dataclass
class CheckResult:
    verdict: Verdict
    plan: CheckPlan
    device: str
    cases_run: int
    seconds: float
    rows: list[Row] = field(default_factory=list)
    violations: list[Violation] = field(default_factory=list)
    minimal_case: Case | None = None
    error: str | None = None
    rerun: str | None = None
    skipped: dict = field(default_factory=dict)  # case id -> why an implementation could not take it
    note: str | None = None  # e.g. a failure that needs the cases before it (state kept across calls)
    named: Headline | None = None  # what bisect's diagnosis names, where the calls' operands name nothing

    @property
    def headline(self) -> Headline | None:
        """The finding that names the failure, as every command heads it (parity.headline): of the recorded
        calls' operands, else bisect's diagnosis of the minimal case; None where neither names one."""
        return of_violations(self.violations) or self.named

    def to_json(self) -> dict:
        return dict(
            verdict=self.verdict, impl=self.plan.candidate.name, reference=self.plan.reference.name,
            policy=self.plan.policy.value, device=self.device, cases_run=self.cases_run,
            seconds=round(self.seconds, 3),
            minimal_case=None if self.minimal_case is None else self.minimal_case.id,
            finding=None if self.headline is None else str(self.headline),
            failures=[dict(case_id=v.case_id, tensor=v.tensor, step=v.step, metric=v.metric,
                           value=_jsonable(v.value), allowed=_jsonable(v.allowed), message=v.full_message)
                      for v in self.violations],
            error=self.error, rerun=self.rerun, note=self.note, recipe=self.plan.candidate.recipe.name,
            skipped=[dict(case_id=case_id, reason=reason) for case_id, reason in self.skipped.items()],
            env=environment(self.device),
        )


def _jsonable(value):
    if isinstance(value, float) and (value != value or value in (float("inf"), float("-inf"))):
        return str(value)
    return value if isinstance(value, (int, float, str, bool, type(None))) else str(value)


@dataclass
class CheckOptions:
    """How run_check searches, beside its device, budget and cases (see run_check)."""

    max_dim: int = 256
    max_tokens: int = 256
    seed: int = 0
    derandomize: bool = True
    rerun_command: Callable[[Case], str] | None = None
    progress: Callable[[int, int], None] | None = None
    isolate: bool | None = None
    time_limit: float | None = None
    runner: Worker | None = None
    rerun_alone: bool = True
    layer_case: bool = False  # after a search that found nothing, also one case of a layer's size (cases.layer_case)
    name_failure: bool = True  # where the calls' operands name no failure, bisect's diagnosis names it


def run_check(plan: CheckPlan, *, device: str = "cpu", max_examples: int = 100, cases: Sequence[Case] | None = None,
              **options) -> CheckResult:
    """Explicit `cases` run as given; otherwise edge cases, then a hypothesis search of
    `max_examples` cases with shrinking of the first failure. Cases an implementation cannot take
    are skipped with the reason; a check in which no case could run is an error, not a pass.

    `options` (CheckOptions): max_dim, max_tokens, seed and derandomize shape the search; with
    `isolate` (default: when any implementation is not a built-in; parity.runner.isolation) every
    case runs in a worker process, within `time_limit` seconds (default: one that fits the case's
    size), in `runner` if given (kept open). A failure found after other cases ran in the worker is
    run again alone in a fresh one (`rerun_alone`), to say whether it needs what ran before.
    `rerun_command(case)` gives the result's rerun line; `progress(done, planned)` follows each case.
    With `name_failure`, a failure whose recorded calls' operands name nothing is named by bisect's
    diagnosis of the minimal case (parity.bisect.name_failure: once, at the end), so the headline is
    bisect's."""
    settings = CheckOptions(**options)
    if settings.runner is not None:
        return _Check(plan, device, max_examples, settings, settings.runner).run(cases)
    with isolation(plan.comparisons, device, settings.isolate) as runner:
        return _Check(plan, device, max_examples, settings, runner).run(cases)


class _Check:
    """One run of run_check: the cases run so far, their rows and judgements."""

    def __init__(self, plan: CheckPlan, device: str, max_examples: int, settings: CheckOptions,
                 runner: Worker | None):
        self.plan, self.device, self.max_examples = plan, device, max_examples
        self.settings, self.runner = settings, runner
        self.start = time.perf_counter()
        self.device_type = torch.device(device).type
        self.rows: list[Row] = []
        self.cases_run, self.skipped = 0, {}
        self.outcomes: dict[str, tuple[list[Row], list[Violation], list[str]]] = {}
        self.ran: list[Case] = []
        self.judged_cases: dict[str, Case] = {}  # every case judged (the search's, edge and layer-size cases), by id
        self.hung_on: Case | None = None  # the case the candidate ran past its time limit on
        self.first_failure: Case | None = None  # the first case that violated (what a flaky search falls back on)

    def rows_of(self, case: Case) -> list[Row]:
        raise_if_stopped()  # a Ctrl-C or SIGTERM whose exception was lost stops the check here (parity.exits)
        return run_case_isolated(case, self.plan.comparisons, device=self.device, runner=self.runner,
                                 time_limit=self.settings.time_limit)

    def judged(self, case: Case) -> tuple[list[Row], list[Violation], list[str]]:
        rows = self.rows_of(case)
        self.cases_run += 1
        reason = self.plan.unsupported(case, self.device_type)
        if reason:
            self.skipped[case.id] = reason
        self.rows.extend(rows)
        if self.settings.progress is not None:
            self.settings.progress(self.cases_run, self.max_examples)
        self.outcomes[case.id] = (rows, self.plan.judge(rows), self.plan.reference_errors(rows))
        self.judged_cases[case.id] = case
        return self.outcomes[case.id]

    def finish(self, verdict: Verdict, violations=(), minimal=None, error=None) -> CheckResult:
        if verdict is Verdict.PASS and self.skipped and len(self.skipped) == self.cases_run:
            verdict, error = Verdict.ERROR, (f"no case could run here: {next(iter(self.skipped.values()))} "
                                             f"({self.cases_run} cases skipped)")
        command = self.settings.rerun_command
        return CheckResult(verdict, self.plan, self.device, self.cases_run, time.perf_counter() - self.start,
                           self.rows, list(violations), minimal, error,
                           command(minimal) if (minimal is not None and command) else None, skipped=dict(self.skipped))

    def violates(self, case: Case) -> bool:
        if self.hung_on is not None:  # the verdict is known, and each further case would wait out its own limit:
            return False  # the search and the shrinker end on the case that hung
        self.ran.append(case)
        _, violations, ref_errors = self.judged(case)
        if self.hung(case):
            self.hung_on = case
        if (violations or ref_errors) and self.first_failure is None:
            self.first_failure = case
        return bool(violations or ref_errors)

    def hung(self, case: Case) -> bool:
        """Whether the candidate ran past its time limit on `case` (a worker killed for it)."""
        return any(isinstance(v.error, Died) and v.error.timed_out for v in self.outcomes[case.id][1])

    def conclude(self, case: Case) -> CheckResult:
        _, violations, ref_errors = self.outcomes.get(case.id) or self.judged(case)
        if ref_errors:
            return self.finish(Verdict.ERROR, error=f"a reference failed on {case.id}: {'; '.join(ref_errors)}",
                               minimal=case)
        note = None
        if self.hung(case):
            note = (f"{case.id} ran past its time limit: the check stopped there, not shrunk and not run again "
                    f"(each further case would wait out its own limit); --timeout sets the limit")
        # does it need what ran before?
        elif self.settings.rerun_alone and self.runner is not None and self.cases_run > 1:
            self.runner.close()
            if not self.plan.judge(self.rows_of(case)):
                note = (f"{case.id} fails after the cases before it ran in the same process, and passes alone: the "
                        f"implementation keeps state across calls (stale state); the rerun command below runs the "
                        f"case alone and passes")
        result = self.finish(Verdict.FAIL, violations, case)
        result.note = note
        if self.settings.name_failure and result.headline is None and wrong_numbers(violations):
            from parity.bisect import name_failure  # noqa: PLC0415 - bisect is built on check
            result.named = name_failure(self.plan, case, violations, self.device, self.runner,
                                        self.settings.time_limit)
        return result

    def repeated(self) -> CheckResult:
        """A pass needs the same results twice: the first case that ran runs again, in the same
        process; any metric of the candidate that moved is a finding (randomness, or state kept
        from the calls before)."""
        first = next((case_id for case_id in self.outcomes if case_id not in self.skipped), None)
        if first is None:
            return self.finish(Verdict.PASS)
        rows, case = self.outcomes[first][0], self.judged_cases[first]
        again = {row.key: row for row in self.rows_of(case)}
        moved = [_moved(row, again.get(row.key)) for row in rows
                 if row.impl == self.plan.candidate.name and not row.skipped
                 and _Repeat.of(row) != _Repeat.of(again.get(row.key))]
        return self.finish(Verdict.FAIL, moved[:6], case) if moved else self.finish(Verdict.PASS)

    def at_layer_size(self, shrunk: Callable[[Case], Case]) -> CheckResult | None:
        """With CheckOptions.layer_case, once the small cases all passed: the failure of the layer-size case
        (parity.cases.layer_case), shrunk; None when it passes, is not asked for, or cannot run here."""
        case = layer_case(seed=self.settings.seed)
        if not self.settings.layer_case or self.plan.unsupported(case, self.device_type):
            return None
        if self.violates(case):
            return self.conclude(self.hung_on or shrunk(case))
        return None

    def run(self, cases: Sequence[Case] | None) -> CheckResult:
        plan, settings = self.plan, self.settings
        explicit = cases is not None
        shrunk = lambda case: shrink(case, self.violates, alignment=plan.alignment)  # noqa: E731
        plainest = Case(lead=(plan.alignment,), K=plan.alignment, N=plan.alignment)  # bf16, contiguous, no bias
        unable = plan.reference.unsupported(plainest, self.device_type)
        if unable and not explicit:  # before any work: a reference that takes not even this case takes none here
            return self.finish(Verdict.ERROR, error=f"the reference cannot run here: {unable}")
        edges = edge_cases(seed=settings.seed, alignment=plan.alignment,
                           nan_case=plan.candidate.recipe.nan_stays_in_its_block)
        for case in (cases if explicit else edges):
            if self.violates(case):
                return self.conclude(case if explicit else shrunk(case))
        if explicit:
            return self.repeated()
        if self.skipped and len(self.skipped) == self.cases_run:  # the edge cases cover every dtype and layout:
            return self.finish(Verdict.PASS)  # none runs, so no generated case will (finish: "no case could run")
        search_settings = hypothesis_settings(
            max_examples=max(1, self.max_examples), database=None, deadline=None, derandomize=settings.derandomize,
            suppress_health_check=list(HealthCheck), phases=[Phase.generate, Phase.shrink],
        )
        strategy = case_strategy(max_dim=max(settings.max_dim, plan.alignment),
                                 max_tokens=max(settings.max_tokens, plan.alignment), alignment=plan.alignment
                                 ).filter(lambda case: plan.unsupported(case, self.device_type) is None)
        try:
            minimal = find(strategy, self.violates, settings=search_settings, random=random.Random(settings.seed))
        except NoSuchExample:
            return self.at_layer_size(shrunk) or self.repeated()
        except Flaky:  # a case failed once and passed when hypothesis replayed it: the failure needs earlier calls
            if self.first_failure is None:
                raise
            return self.conclude(self.first_failure)  # (conclude runs it alone in a fresh worker and says so)
        if self.hung_on is not None:
            return self.conclude(self.hung_on)
        return self.conclude(shrunk(minimal))  # hypothesis shrinks; a greedy pass takes the last steps


# the kinds of violation that say a number is wrong (a crash, a death, a contract say what they are themselves)
NUMBER_KINDS = (Kind.BITWISE, Kind.EXACT, Kind.ACCUMULATION_BOUND, Kind.SQNR_DB, Kind.PAIRED_SQNR_DB, Kind.NONFINITE,
                Kind.OPERAND)


def wrong_numbers(violations: Sequence[Violation]) -> bool:
    """Wrong numbers and no crash: what bisect's diagnosis can name (parity.bisect.name_failure), where a
    crash, a hang or a worker's death would only happen again."""
    return any(v.kind in NUMBER_KINDS for v in violations) and not any(v.kind is Kind.CRASH for v in violations)


@dataclass(frozen=True)
class _Repeat:
    """What a repeated run must reproduce exactly: the error, or the differences from the reference (the
    numbers as shown, to 6 significant digits)."""

    error: str | None = None
    differences: str | None = None
    missing: bool = False

    @classmethod
    def of(cls, row: Row | None) -> "_Repeat":
        if row is None:
            return cls(missing=True)
        if row.error is not None:
            return cls(error=str(row.error))
        return cls(differences=f"{row.n_diff} elements differ, SQNR {row.sqnr_db:.6g} dB, "
                               f"max abs err {row.max_abs_err:.6g}, {row.nan} NaN")

    def __str__(self) -> str:
        if self.missing:
            return "no result"
        return f"error {self.error!r}" if self.error is not None else self.differences


def _moved(row: Row, again: Row | None) -> Violation:
    first, second = _Repeat.of(row), _Repeat.of(again)
    return Violation(kind=Kind.DETERMINISM, case_id=row.case_id, impl=row.impl, reference=row.reference,
                     tensor=Tensor(row.tensor), step=row.step, value=str(second), allowed=str(first),
                     message=f"{row.tensor} (step {row.step}): a second run of the same case gave other results "
                             f"({first} the first time, {second} the second, against {row.reference}): the "
                             f"implementation is not deterministic or keeps state across calls")


# ---- presentation -------------------------------------------------------------------------------------

def summary_table(rows: Sequence[Row], plan: CheckPlan) -> pd.DataFrame:
    """Per reference and tensor: cases, bitwise rate, worst SQNR and ULP distance."""
    frame = rows_frame([r for r in rows if r.impl == plan.candidate.name and not r.skipped])
    if frame.empty:
        return frame
    grouped = frame.groupby(["reference", "tensor"], sort=False)
    table = pd.DataFrame({
        "cases": grouped["case_id"].nunique(),
        "bitwise %": grouped["bitwise"].mean().mul(100).round(1),
        "min SQNR dB": grouped["sqnr_db"].min().round(2),
        "max ulp": grouped["ulp_max"].max(),
        "crashes": grouped["error"].apply(lambda s: int(s.notna().sum())),
    })
    return table.reset_index()


def render(result: CheckResult) -> str:
    """What `fp8-parity check` prints."""
    plan = result.plan
    head = result.verdict.value.upper()
    lines = [f"{head}: {plan.candidate.name} ({plan.candidate.recipe.name} recipe) against {plan.reference.name} "
             f"({plan.policy.value} policy) on {result.device}: {result.cases_run} cases in {result.seconds:.1f} s", ""]
    lines[0] += covered(result.rows, plan.candidate.name) if result.verdict is Verdict.PASS else ""
    if result.skipped:
        first = next(iter(result.skipped.items()))
        lines += [f"{len(result.skipped)} of {result.cases_run} cases skipped (not failed): {first[1]} "
                  f"(first: {first[0]})", ""]
    table = summary_table(result.rows, plan)
    if not table.empty:
        lines += [table.to_string(index=False), ""]
    exact = exact_line(result.rows, plan)
    if exact:
        lines += [exact, ""]
    if result.error:
        lines += [f"error: {result.error}", ""]
    if result.violations:
        lines.append(f"Minimal failing case: {result.minimal_case.id}")
        if result.headline is not None:
            lines.append(f"Finding: {result.headline}")
        lines += violation_lines(result.violations[:12], result.rows, indent="  ")
        if len(result.violations) > 12:
            lines.append(f"  ... and {len(result.violations) - 12} more (see --json)")
        lines.append("")
    if result.note:
        lines += [f"note: {result.note}", ""]
    if result.rerun:
        lines += ["Rerun exactly this case:", f"  {result.rerun}"]
    return "\n".join(lines).rstrip() + "\n"


def exact_line(rows: Sequence[Row], plan: CheckPlan) -> str:
    """How the candidate's FP8 GEMMs were judged against the Hopper model (policy exact), or "" where it was not
    among the references: how many bit for bit, how many of those equal, why the rest fell to the bound."""
    recipe = plan.candidate.recipe
    judged = [row for row in rows if row.policy == Policy.EXACT.value and row.impl == plan.candidate.name
              and not row.skipped and row.error is None and row.exact is not None and row.tensor in GEMMS
              and not recipe.gemm(row.tensor).high_precision]
    if not judged:
        return ""
    exact = [row for row in judged if row.exact]
    equal = sum(bool(row.bitwise) for row in exact)
    model = judged[0].reference
    line = (f"exact: judged bit for bit against {model} (the GPU's own bits) in {len(exact)} of {len(judged)} "
            f"FP8-GEMM comparisons ({equal} equal)")
    reasons = Counter(row.exact_why for row in judged if not row.exact)
    if reasons:
        line += "; by the accumulation bound in the rest: " + "; ".join(
            f"{why} ({count})" for why, count in reasons.most_common(3))
        if len(reasons) > 3:
            line += f"; {len(reasons) - 3} more reasons"
    return line


MISMATCH_KINDS = (Kind.BITWISE, Kind.EXACT, Kind.ACCUMULATION_BOUND, Kind.SQNR_DB)  # shown with their row's metrics


def violation_lines(violations: Sequence[Violation], rows: Sequence[Row], *, indent: str = "",
                    full: bool = False) -> list[str]:
    """Each violation's line ("[metric] message"; `full`: with its detail), and under a numeric one the
    assert_close-style table of its row (parity.metrics.describe_mismatch), indented two more."""
    by_key = {row.key: row for row in rows}
    lines, deeper = [], indent + "  "
    for violation in violations:
        lines.append(f"{indent}[{violation.metric}] {violation.full_message if full else violation.message}")
        row = by_key.get(row_key(violation.case_id, violation.impl, violation.reference, violation.tensor,
                                 violation.step))
        if row is not None and violation.kind in MISMATCH_KINDS:
            table = describe_mismatch(row.record(), allowed=str(violation.allowed))
            lines.append(deeper + table.replace("\n", "\n" + deeper))
    return lines


def check_command(impl: str, against: str, device: str, extra: Sequence[str] = ()) -> str:
    """The `fp8-parity check` command line that judges `impl` against `against` on `device` (`extra`: its
    other flags), shell-quoted."""
    parts = ["fp8-parity", "check", "--impl", impl, "--against", against, "--device", device, *kernel_flags(device),
             *extra]
    return " ".join(shlex.quote(p) for p in parts)


def kernel_flags(device: str, flag: str = "--cpu-gemm") -> list[str]:
    """`--cpu-gemm MODE` where this process computes CPU scaled GEMMs otherwise than by default (parity.cpu_gemm):
    under --cpu-gemm hopper a fast-accumulation bug shows in the numbers, and a printed command must run
    the kernel that found it."""
    mode = cpu_gemm.mode()
    return [flag, mode] if device == "cpu" and mode != cpu_gemm.MODES[0] else []


def rerun_command(impl: str, against: str, device: str, extra: Sequence[str] = ()) -> Callable[[Case], str]:
    """check_command for one case (--case): the command that reruns exactly it."""
    def command(case: Case) -> str:
        return check_command(impl, against, device, [*extra, "--case", case.id])
    return command


def resolve_device(requested: str | None) -> tuple[str | None, str | None]:
    """(device, reason it cannot run). cuda needs a GPU with FP8 support (compute capability >= 8.9)."""
    if requested in (None, "auto"):
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda":
        if not torch.cuda.is_available():
            return None, "no CUDA device is available (use --device cpu)"
        if torch.version.hip is None and torch.cuda.get_device_capability() < (8, 9):
            cap = ".".join(map(str, torch.cuda.get_device_capability()))
            return None, f"the GPU has compute capability {cap}; FP8 GEMMs need >= 8.9 (Ada, Hopper or newer)"
    elif requested != "cpu":
        return None, f"unknown device {requested!r} (use cpu or cuda)"
    return requested, None
