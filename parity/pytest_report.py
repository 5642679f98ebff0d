"""How a property failure reads in pytest's output: the finding first.

parity.suite.Suite.fail raises PropertyFailure with a message whose first line is the finding
(the first violation: which tensor, which metric, the value and what is allowed) and whose next
lines are the rerun command, the property, the case id and the evidence. pytest would show it
under a traceback of the harness (`raise PropertyFailure(...)` in parity/suite.py, nothing the
user wrote), prefixed `parity.suite.PropertyFailure: `, and, for a case hypothesis found, followed
by hypothesis's "Falsifying example: test_...(case=Case(lead=(32,), K=64, ...))", the dataclass
written out field by field: all three repeat what the message already says, in longer form.

finding_first replaces that report with the message alone, as `E ` lines, and the test's line:

    E   [bitwise] grad_input (step 0): not bitwise equal to torchao:tensorwise: 2048 of 2048 ...
    E   Rerun exactly this case:
    E     python -m pytest '.../test_properties.py::test_parity_with_reference[...]' ... --fp8-case '...'
    E
    E   mutants.py:scale_not_inverted is not at parity with torchao:tensorwise
    E   case: M32K64N48|in:bf16:C|w:bf16:C|go:C|tiny|seed0
    ...
    property_tests/suite/test_properties.py:57: PropertyFailure

and the short test summary (`FAILED <node id> - <message>`) shows the finding. The report is
built from pytest's own report classes, so pytest-xdist and --junitxml carry it as they carry any
other. `pytest --fulltrace` keeps pytest's report (for debugging the harness itself).

The run's header names the implementation, its reference and the device, and the terminal summary
says how many property tests of that implementation failed (summary_line).
"""

from __future__ import annotations

import os
from pathlib import Path

# pytest exports no constructor of a failure's report; these are the classes it builds one from,
# stable since pytest 6, and the ones pytest-xdist serializes between processes.
from _pytest._code.code import ExceptionChainRepr, ReprEntry, ReprFileLocation, ReprTraceback

from parity.property_items import MARKER
from parity.suite import PropertyFailure


def property_failures(excinfo) -> list[PropertyFailure]:
    """The PropertyFailures an exception is (hypothesis raises a group when it found several
    distinct failures), or [] where anything else is among them: a harness error keeps pytest's
    full report."""
    leaves = [excinfo.value]
    while any(_is_group(e) for e in leaves):  # a group's .exceptions (BaseExceptionGroup: Python 3.11)
        leaves = [leaf for e in leaves for leaf in (e.exceptions if _is_group(e) else [e])]
    return leaves if all(isinstance(e, PropertyFailure) for e in leaves) else []


def _is_group(error: BaseException) -> bool:
    return isinstance(getattr(error, "exceptions", None), tuple)


def finding_first(item, excinfo) -> ExceptionChainRepr | None:
    """The report of a property failure, finding first (module docstring); None: keep pytest's."""
    failures = property_failures(excinfo)
    if not failures or item.config.getoption("fulltrace"):
        return None
    lines = []
    for index, failure in enumerate(failures):
        lines += [*([""] if index else []), *str(failure).splitlines()]
    path, lineno = failing_line(item, excinfo)
    shown = _shorter_path(path, item.config.invocation_params.dir)
    entry = ReprEntry(lines=[f"E   {line}".rstrip() for line in lines], reprfuncargs=None, reprlocals=None,
                      reprfileloc=ReprFileLocation(shown, lineno, "PropertyFailure"), style="long")
    crash = ReprFileLocation(str(path), lineno, failures[0].finding)
    return ExceptionChainRepr([(ReprTraceback([entry], None, "long"), crash, None)])


def failing_line(item, excinfo) -> tuple[Path, int]:
    """The test's own line the failure came from (the innermost frame in the test's file), else
    where the test is defined."""
    for entry in reversed(excinfo.traceback):
        if Path(entry.path) == item.path:
            return item.path, entry.lineno + 1
    return item.path, (item.location[1] or 0) + 1


def _shorter_path(path: Path, start: Path) -> str:
    """As pytest writes a traceback's file: relative to where it was started, unless that is longer."""
    relative = os.path.relpath(path, start)
    return relative if len(relative) < len(str(path)) else str(path)


def header_line(suite) -> str:
    recipe = f" ({suite.candidate.recipe.name} recipe)"
    return f"fp8-parity: {suite.candidate.name}{recipe} against {suite.reference.name} on {suite.device}"


def summary_line(terminalreporter, suite) -> str | None:
    """'fp8-parity: IMPL failed N of M property tests against REF on DEVICE (K skipped)' (or
    'passed all M'); None where no property test ran."""
    outcomes = {outcome: {report.nodeid for report in terminalreporter.stats.get(outcome, [])
                          if MARKER in getattr(report, "keywords", {})}
                for outcome in ("passed", "failed", "error", "skipped", "xfailed", "xpassed")}
    failed = outcomes["failed"] | outcomes["error"]
    ran = failed | outcomes["passed"] | outcomes["xfailed"] | outcomes["xpassed"]
    skipped = outcomes["skipped"] - ran
    if not ran and not skipped:
        return None
    verdict = f"failed {len(failed)} of {len(ran)}" if failed else f"passed all {len(ran)}"
    return (f"fp8-parity: {suite.candidate.name} {verdict} property tests against {suite.reference.name} on "
            f"{suite.device}" + (f" ({len(skipped)} skipped)" if skipped else ""))
