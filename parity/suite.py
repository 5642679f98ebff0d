"""The property suite's shared state: which implementation runs against which reference where,
how failures are reported, and the metric rows kept for `--fp8-report`.

The pytest plugin (parity.pytest_plugin) fills SUITE from the command line (`--fp8-impl`,
`--fp8-against`, `--fp8-device`, `--fp8-case`);
the tests draw cases from `SUITE.cases()` and report through `SUITE.fail`, so every failure
reads the same way: its first line the finding (the first violation: which tensor, which metric,
the value and what is allowed), then the one-line command that reruns exactly that case, then the
property, the case id and the evidence (assert_close-style metrics tables). Your own suite can use
it the same way. (How pytest shows it, without a traceback of this module: parity.pytest_report.)
"""

from __future__ import annotations

import functools
import importlib.util
import os
import shlex
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from hypothesis import strategies as st

from parity.cases import Case, parse_case_id
from parity.check import CheckPlan, kernel_flags, violation_lines, wrong_numbers
from parity.data import CaseData, make_data
from parity.headline import of_violations
from parity.impls import Impl, ImplError, default_reference, load_impl
from parity.policy import Violation
from parity.rows import Row
from parity.runner import executing_in, isolation, run_case_isolated
from parity.strategies import cases as case_strategy
from parity.worker import default_time_limit, torch_device_type

# Largest K, N and M the strategies draw, per hypothesis profile (the GPU affords larger shapes).
MAX_DIM = {"dev": 128, "ci": 128, "gpu": 1024, "thorough": 512}


SUITE_PACKAGE = "parity.property_suite"  # pyproject.toml's package-dir maps it to property_tests/suite/


class SuiteNotInstalled(ImplError):
    """The shipped suite cannot be imported (parity runs from a checkout that was not pip-installed). An
    ImplError, like an implementation that does not load: every command reports it in one line."""


def shipped_suite() -> Path:
    """The shipped suite's test file, wherever pip put the package parity.property_suite (an editable
    install maps it to the checkout's property_tests/suite/). Looked up when used (fp8-parity test, a
    failure's rerun line), not at import: the plugin loads in every pytest run, also where the suite
    is not importable and nobody asked for it."""
    spec = importlib.util.find_spec(SUITE_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise SuiteNotInstalled(
            f"the shipped property suite (package {SUITE_PACKAGE}) is not importable: parity runs from "
            f"{Path(__file__).resolve().parent} without `pip install`; run `pip install -e .` in that checkout, "
            f"or name the suite's file: pytest property_tests/suite/test_properties.py --fp8-impl ...")
    return Path(next(iter(spec.submodule_search_locations))) / "test_properties.py"


class PropertyFailure(AssertionError):
    """A property does not hold: the message's first line is the finding, then the rerun command,
    the case and the evidence."""

    @property
    def finding(self) -> str:
        return str(self).split("\n", 1)[0]


@dataclass
class Suite:
    impl_spec: str = "fp8_impl"
    recipe: str | None = None  # the recipe the candidate implements (None: its own, or tensorwise)
    against_spec: str | None = None  # None: the candidate's recipe's reference (parity.impls.default_reference)
    device: str = "cpu"
    case_id: str | None = None  # rerun exactly this case
    max_dim: int = 128
    rows: list[Row] = field(default_factory=list)  # every metric row computed, for --fp8-report
    # the node id that reruns the running test on a case (the plugin sets it per test:
    # parity.property_items.rerun_node_id); None: read from PYTEST_CURRENT_TEST
    rerun_node: Callable[[Case], str] | None = None

    @functools.cached_property
    def candidate(self) -> Impl:
        return load_impl(self.impl_spec, recipe=self.recipe)

    @functools.cached_property
    def reference(self) -> Impl:
        if self.against_spec:
            return load_impl(self.against_spec)
        return default_reference(self.candidate, torch_device_type(self.device))

    @functools.cached_property
    def plan(self) -> CheckPlan:
        return CheckPlan.make(self.candidate, self.reference, device=self.device)

    def cases(self, **constraints) -> st.SearchStrategy[Case]:
        """Cases for a property: the one given with --case, else generated within `constraints`."""
        if self.case_id:
            return st.just(parse_case_id(self.case_id))
        constraints.setdefault("max_dim", self.max_dim)
        constraints.setdefault("max_tokens", self.max_dim)
        return case_strategy(**constraints)

    def data(self, case: Case) -> CaseData:
        return make_data(case, self.device)

    @functools.cached_property
    def runner(self):
        """The worker process that runs the candidate when it is not a built-in (parity.worker): an
        implementation that exits, hangs or segfaults fails its test instead of ending the session."""
        return isolation(self.plan.comparisons, self.device).__enter__()

    def close(self) -> None:
        runner = self.__dict__.pop("runner", None)
        if runner is not None:
            runner.__exit__(None, None, None)

    def run(self, case: Case, plan: CheckPlan | None = None) -> tuple[list[Row], list[Violation]]:
        """Rows and violations of the candidate against the plan's references on `case`."""
        plan = plan or self.plan
        rows = run_case_isolated(case, plan.comparisons, device=self.device, runner=self.runner)
        self.rows.extend(rows)
        return rows, plan.judge(rows)

    def call(self, case: Case, fn, *args):
        """fn(*args) here, with every execution of the candidate (parity.runner.execute) in the worker when it is
        code under test, each within the case's time limit: a death or a hang is that execution's error."""
        if self.runner is None:
            return fn(*args)
        with executing_in(self.runner, default_time_limit(case.M, case.K, case.N, torch_device_type(self.device))):
            return fn(*args)

    def rerun_command(self, case: Case) -> str:
        if self.rerun_node is not None:
            current = self.rerun_node(case)
        else:
            current = os.environ.get("PYTEST_CURRENT_TEST", "property_tests/suite/test_properties.py").split(" ")[0]
            if current.startswith("::"):  # a file outside the rootdir: its node id has no path
                current = f"{shipped_suite()}{current}"
        parts = ["python", "-m", "pytest", current, "--fp8-impl", self.impl_spec,
                 *(["--fp8-recipe", self.recipe] if self.recipe else []), "--fp8-against", self.reference.name,
                 "--fp8-device", self.device, *kernel_flags(self.device, "--fp8-cpu-gemm"), "--fp8-case", case.id]
        return " ".join(shlex.quote(p) for p in parts)

    def fail(self, title: str, case: Case, evidence: list[str], *, finding: str | None = None) -> None:
        """Raise PropertyFailure: `finding` first (default: the title and the first line of evidence,
        such as which tensor differs by how much), the rerun command, then the title, the case and
        the evidence."""
        __tracebackhide__ = True  # pytest: the failure is the test's line, not this one
        evidence = [str(line) for line in evidence if str(line).strip()]
        if finding is None:
            finding = f"{title}: {evidence[0].splitlines()[0]}" if evidence else title
        lines = [finding, "Rerun exactly this case:", f"  {self.rerun_command(case)}", "", title, f"case: {case.id}",
                 *evidence]
        raise PropertyFailure("\n".join(lines))

    def assert_no_violations(self, title: str, case: Case, rows: list[Row], violations: list[Violation], *,
                             diagnose: bool = False) -> None:
        """Fail with the violations (their assert_close-style tables); the finding first: the headline of
        the diagnosed calls (parity.headline: check's and bisect's words for the same bug), else the first
        violation. `diagnose`: where the violations' plan did not compare the recorded calls with the
        recipe's oracle (a plan without it), the case runs once more under check's plan, which does. Where
        the calls name nothing, bisect's diagnosis names it, as check does (parity.bisect.name_failure)."""
        __tracebackhide__ = True
        if violations:
            lines = violation_lines(violations, rows, full=True)
            headline, judged = of_violations(violations), violations
            if headline is None and diagnose and wrong_numbers(violations):  # check's plan compares the calls
                judged = self.plan.judge(run_case_isolated(case, self.plan.comparisons, device=self.device,
                                                           runner=self.runner))
                headline = of_violations(judged)
            if headline is None and wrong_numbers(judged):  # what bisect's diagnosis names, as check does
                from parity.bisect import name_failure  # noqa: PLC0415 - bisect is built on the suite's check
                headline = name_failure(self.plan, case, judged, self.device, self.runner)
            self.fail(title, case, lines, finding=lines[0] if headline is None else str(headline))


SUITE = Suite()


def configure(*, impl: str, against: str | None, device: str, case_id: str | None, profile: str,
              recipe: str | None = None) -> Suite:
    """Point SUITE at an implementation (called by the pytest plugin once options are parsed)."""
    SUITE.impl_spec, SUITE.against_spec, SUITE.device, SUITE.case_id = impl, against, device, case_id
    SUITE.recipe = recipe
    SUITE.max_dim = MAX_DIM.get(profile, 128)
    SUITE.close()
    for cached in ("candidate", "reference", "plan"):
        SUITE.__dict__.pop(cached, None)
    return SUITE
