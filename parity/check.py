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
from dataclasses import dataclass, field
from typing import Callable, Sequence

import pandas as pd
import torch
from hypothesis import HealthCheck, Phase, find, settings
from hypothesis.errors import NoSuchExample

from parity.cases import Case, edge_cases, shrink
from parity.env import environment
from parity.impls import Impl, builtin_for_recipe, default_reference, load_impl
from parity.metrics import describe_mismatch
from parity.policy import Policy, Violation, default_policy, evaluate
from parity.runner import Comparison, run_case_isolated
from parity.worker import Worker, isolation
from parity.strategies import cases as case_strategy


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
        policy = Policy(policy) if policy else default_policy(candidate, reference)
        comparisons = [Comparison(candidate, reference, policy)]
        if policy is Policy.PAIRED:  # both measured against fp64 on the same inputs
            fp64 = load_impl("fp64")
            comparisons += [Comparison(candidate, fp64, Policy.NONE), Comparison(reference, fp64, Policy.NONE)]
        emulation = builtin_for_recipe("emulated", candidate.recipe)
        if oracle and candidate.recipe.is_fp8 and not candidate.exact and emulation and not (
                reference.exact and reference.recipe is candidate.recipe):
            comparisons.append(Comparison(candidate, load_impl(emulation), Policy.ACCUMULATION))
        return cls(candidate, reference, policy, comparisons)

    @property
    def alignment(self) -> int:
        return max(self.candidate.recipe.alignment, self.reference.recipe.alignment, 16)

    def unsupported(self, case: Case, device_type: str) -> str | None:
        return self.candidate.unsupported(case, device_type) or self.reference.unsupported(case, device_type)

    def judge(self, rows: Sequence[dict]) -> list[Violation]:
        return evaluate(rows, impls=[self.candidate.name])

    def reference_errors(self, rows: Sequence[dict]) -> list[str]:
        return sorted({f"{r['reference']}: {r['reference_error']}" for r in rows if r.get("reference_error")})


@dataclass
class CheckResult:
    verdict: str  # "pass" | "fail" | "error"
    plan: CheckPlan
    device: str
    cases_run: int
    seconds: float
    rows: list[dict] = field(default_factory=list)
    violations: list[Violation] = field(default_factory=list)
    minimal_case: Case | None = None
    error: str | None = None
    rerun: str | None = None
    skipped: dict = field(default_factory=dict)  # case id -> why an implementation could not take it
    note: str | None = None  # e.g. a failure that needs the cases before it (state kept across calls)

    def to_json(self) -> dict:
        return dict(
            verdict=self.verdict, impl=self.plan.candidate.name, reference=self.plan.reference.name,
            policy=self.plan.policy.value, device=self.device, cases_run=self.cases_run,
            seconds=round(self.seconds, 3),
            minimal_case=None if self.minimal_case is None else self.minimal_case.id,
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


def run_check(plan: CheckPlan, *, device: str = "cpu", max_examples: int = 100, cases: Sequence[Case] | None = None,
              max_dim: int = 256, max_tokens: int = 256, seed: int = 0, derandomize: bool = True,
              rerun_command: Callable[[Case], str] | None = None,
              progress: Callable[[int, int], None] | None = None, isolate: bool | None = None,
              time_limit: float | None = None, runner: Worker | None = None, rerun_alone: bool = True) -> CheckResult:
    """Explicit `cases` run as given; otherwise edge cases, then a hypothesis search of
    `max_examples` cases with shrinking of the first failure. Cases an implementation cannot take
    are skipped with the reason; a check in which no case could run is an error, not a pass.
    With `isolate` (default: when any implementation is not a built-in; parity.worker.isolation)
    every case runs in a worker process, within `time_limit`
    seconds (default: one that fits the case's size), in `runner` if given (kept open). A failure found
    after other cases ran in the worker is run again alone in a fresh one (`rerun_alone`), to say
    whether it needs what ran before."""
    if runner is not None:
        return _run_check(plan, device, max_examples, cases, max_dim, max_tokens, seed, derandomize,
                          rerun_command, progress, runner, time_limit, rerun_alone)
    with isolation(plan.comparisons, device, isolate) as runner:
        return _run_check(plan, device, max_examples, cases, max_dim, max_tokens, seed, derandomize,
                          rerun_command, progress, runner, time_limit, rerun_alone)


def _run_check(plan, device, max_examples, cases, max_dim, max_tokens, seed, derandomize, rerun_command, progress,
               runner, time_limit, rerun_alone) -> CheckResult:
    start = time.perf_counter()
    all_rows: list[dict] = []
    counter = {"cases": 0, "skipped": {}}
    device_type = torch.device(device).type

    outcomes: dict[str, tuple[list[dict], list[Violation], list[str]]] = {}

    def run(case: Case) -> tuple[list[dict], list[Violation], list[str]]:
        rows = run_case_isolated(case, plan.comparisons, device=device, runner=runner, time_limit=time_limit)
        counter["cases"] += 1
        reason = plan.unsupported(case, device_type)
        if reason:
            counter["skipped"][case.id] = reason
        all_rows.extend(rows)
        if progress is not None:
            progress(counter["cases"], max_examples)
        outcomes[case.id] = (rows, plan.judge(rows), plan.reference_errors(rows))
        return outcomes[case.id]

    def finish(verdict: str, violations=(), minimal=None, error=None) -> CheckResult:
        if verdict == "pass" and counter["skipped"] and len(counter["skipped"]) == counter["cases"]:
            verdict, error = "error", (f"no case could run here: {next(iter(counter['skipped'].values()))} "
                                       f"({counter['cases']} cases skipped)")
        return CheckResult(verdict, plan, device, counter["cases"], time.perf_counter() - start, all_rows,
                           list(violations), minimal, error,
                           rerun_command(minimal) if (minimal is not None and rerun_command) else None,
                           skipped=dict(counter["skipped"]))

    def violates(case: Case) -> bool:
        ran.append(case)
        _, violations, ref_errors = run(case)
        return bool(violations or ref_errors)

    def conclude(case: Case) -> CheckResult:
        _, violations, ref_errors = outcomes.get(case.id) or run(case)
        if ref_errors:
            return finish("error", error=f"a reference failed on {case.id}: {'; '.join(ref_errors)}", minimal=case)
        note = None
        if rerun_alone and runner is not None and counter["cases"] > 1:  # does it need what ran before it?
            runner.close()
            if not plan.judge(run_case_isolated(case, plan.comparisons, device=device, runner=runner,
                                                time_limit=time_limit)):
                note = (f"{case.id} fails after the cases before it ran in the same process, and passes alone: the "
                        f"implementation keeps state across calls (stale state); the rerun command below runs the "
                        f"case alone and passes")
        result = finish("fail", violations, case)
        result.note = note
        return result

    def repeated() -> CheckResult:
        """A pass needs the same results twice: the first case that ran runs again, in the same
        process; any metric of the candidate that moved is a finding (randomness, or state kept
        from the calls before)."""
        first = next((outcomes[c] for c in outcomes if c not in counter["skipped"]), None)
        if first is None:
            return finish("pass")
        rows = first[0]
        case = next(case for case in ran if case.id == rows[0]["case_id"])
        again = {_row_key(r): r for r in run_case_isolated(case, plan.comparisons, device=device, runner=runner,
                                                            time_limit=time_limit)}
        moved = [Violation(case.id, row["impl"], row["reference"], row["tensor"], row["step"], "determinism",
                           _repeat_value(again.get(_row_key(row))), _repeat_value(row),
                           f"{row['tensor']} (step {row['step']}): a second run of the same case gave other "
                           f"results ({_repeat_value(row)} the first time, {_repeat_value(again.get(_row_key(row)))} "
                           f"the second, against {row['reference']}): the implementation is not deterministic or "
                           f"keeps state across calls")
                 for row in rows if row["impl"] == plan.candidate.name and not row.get("skipped")
                 and _repeat_value(row) != _repeat_value(again.get(_row_key(row)))]
        return finish("fail", moved[:6], case) if moved else finish("pass")

    explicit = cases is not None
    ran: list[Case] = []
    shrunk = lambda case: shrink(case, violates, alignment=plan.alignment)  # noqa: E731
    for case in (cases if explicit else edge_cases(seed=seed, alignment=plan.alignment)):
        if violates(case):
            return conclude(case if explicit else shrunk(case))
    if explicit:
        return repeated()

    search_settings = settings(
        max_examples=max(1, max_examples), database=None, deadline=None, derandomize=derandomize,
        suppress_health_check=list(HealthCheck), phases=[Phase.generate, Phase.shrink],
    )
    strategy = case_strategy(max_dim=max(max_dim, plan.alignment), max_tokens=max(max_tokens, plan.alignment),
                             alignment=plan.alignment).filter(lambda case: plan.unsupported(case, device_type) is None)
    try:
        minimal = find(strategy, violates, settings=search_settings, random=random.Random(seed))
    except NoSuchExample:
        return repeated()
    return conclude(shrunk(minimal))  # hypothesis shrinks; a greedy pass takes the last steps


def _row_key(row: dict) -> tuple:
    return row["impl"], row["reference"], row["tensor"], row["step"]


def _repeat_value(row: dict | None) -> str:
    """What a repeated run must reproduce exactly: the error, or the differences from the reference."""
    if row is None:
        return "no result"
    if isinstance(row.get("error"), str):
        return f"error {row['error']!r}"
    return (f"{row['n_diff']} elements differ, SQNR {row['sqnr_db']:.6g} dB, "
            f"max abs err {row['max_abs_err']:.6g}, {row['nan']} NaN")


# ---- presentation -------------------------------------------------------------------------------------

def summary_table(rows: Sequence[dict], plan: CheckPlan) -> pd.DataFrame:
    """Per reference and tensor: cases, bitwise rate, worst SQNR and ULP distance."""
    frame = pd.DataFrame.from_records([r for r in rows if r["impl"] == plan.candidate.name and not r.get("skipped")])
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
    head = {"pass": "PASS", "fail": "FAIL", "error": "ERROR"}[result.verdict]
    lines = [f"{head}: {plan.candidate.name} ({plan.candidate.recipe.name} recipe) against {plan.reference.name} "
             f"({plan.policy.value} policy) on {result.device}: {result.cases_run} cases in {result.seconds:.1f} s", ""]
    if result.skipped:
        first = next(iter(result.skipped.items()))
        lines += [f"{len(result.skipped)} of {result.cases_run} cases skipped (not failed): {first[1]} "
                  f"(first: {first[0]})", ""]
    table = summary_table(result.rows, plan)
    if not table.empty:
        lines += [table.to_string(index=False), ""]
    if result.error:
        lines += [f"error: {result.error}", ""]
    if result.violations:
        lines.append(f"Minimal failing case: {result.minimal_case.id}")
        rows = {(r["case_id"], r["reference"], r["tensor"], r["step"]): r for r in result.rows}
        for violation in result.violations[:12]:
            lines.append(f"  [{violation.metric}] {violation.message}")
            row = rows.get((violation.case_id, violation.reference, violation.tensor, violation.step))
            if row is not None and violation.metric in ("bitwise", "accumulation_bound", "sqnr_db"):
                lines.append("    " + describe_mismatch(row, allowed=str(violation.allowed)).replace("\n", "\n    "))
        if len(result.violations) > 12:
            lines.append(f"  ... and {len(result.violations) - 12} more (see --json)")
        lines.append("")
    if result.note:
        lines += [f"note: {result.note}", ""]
    if result.rerun:
        lines += ["Rerun exactly this case:", f"  {result.rerun}"]
    return "\n".join(lines).rstrip() + "\n"


def rerun_command(impl: str, against: str, device: str, extra: Sequence[str] = ()) -> Callable[[Case], str]:
    def command(case: Case) -> str:
        parts = ["fp8-parity", "check", "--impl", impl, "--against", against, "--device", device, *extra,
                 "--case", case.id]
        return " ".join(shlex.quote(p) for p in parts)
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
