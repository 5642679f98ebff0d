"""How the property suite's tests become pytest items, and what they are called.

A property test is a hypothesis test (`@given(case=...)`) marked with PROPERTY_TEST. The plugin
(parity.pytest_plugin) turns each into several pytest items, so that a node id alone says which
implementation failed which case:

    test_properties.py::test_parity_with_reference[fp8_impl-M32K64N48-in:bf16:C-w:bf16:C-go:C-normal-seed0]
    test_properties.py::test_parity_with_reference[fp8_impl-M32K64N48-in:bf16:C-w:bf16:C-go:C-zeros-seed0]
    ...
    test_properties.py::test_parity_with_reference[fp8_impl-generated]

- the first id is the implementation under test (impl_id: `--fp8-impl` without its directory);
- then the test's own parameters (test_equivariance's relation);
- last, the case: each case pinned with @pinned is an item of its own, called directly with
  the pinned arguments (no hypothesis engine: exactly one call, as hypothesis runs an @example);
  `generated` is the hypothesis search over everything else. As hypothesis does with a failing
  @example, the search is not run once a pinned case of the same test has failed in this process
  (it is skipped, saying so): a planted bug that every case shows costs no search and no
  shrinking. With `--fp8-case ID` there is one item per test, the search held to that case,
  named by the case (what a rerun line selects).

A case's id in a node id is Case.id with `|` written `-` (case_param_id): `|` is a shell pipe
(an unquoted node id would end the command) and `-k` cannot match it, while `-` is the separator
pytest itself puts between parameter ids, `-k` reads it, and it appears in no token of a case id
(its tokens are `M..K..N..`, `in:`/`w:`/`go:` layouts, `bias`, a distribution, `seed`, `steps`).
`:` is kept: pytest only splits node ids at `::`.

Failures are shown by parity.pytest_report; the shared state they read is parity.suite.SUITE.
"""

from __future__ import annotations

import inspect
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hypothesis import is_hypothesis_test
from hypothesis.errors import UnsatisfiedAssumption

from parity.cases import Case

IMPL_FIXTURE = "fp8_candidate"  # parametrized first: the implementation's name opens every id
CASE_FIXTURE = "fp8_case"  # parametrized last: a pinned case, or the search
MARKER = "fp8_property"
# The marks of a property test module (`pytestmark = PROPERTY_TEST`): the marker (report lines
# count the items that carry it) and the two fixtures whose parameters make the ids. usefixtures,
# because pytest parametrizes only names a test uses, and the tests themselves need neither.
PROPERTY_TEST = [getattr(pytest.mark, MARKER), pytest.mark.usefixtures(IMPL_FIXTURE, CASE_FIXTURE)]
GENERATED = "generated"  # the id of the hypothesis search
PINNED_ATTRIBUTE = "fp8_pinned"


@dataclass(frozen=True)
class Pinned:
    """One pinned example of a property: the arguments it is called with (`case` and any other
    argument the test draws, such as test_layout_invariance's `stored`)."""

    arguments: dict = field(hash=False)

    @property
    def case(self) -> Case:
        return self.arguments["case"]

    @property
    def id(self) -> str:
        others = [f"{name}:{_token(value)}" for name, value in self.arguments.items() if name != "case"]
        return "-".join([case_param_id(self.case), *others])


@dataclass(frozen=True)
class Generated:
    """The hypothesis search; held to one case when `--fp8-case` names it."""

    case_id: str | None = None

    @property
    def id(self) -> str:
        return GENERATED if self.case_id is None else case_param_id(Case.from_id(self.case_id))


def pinned(**arguments):
    """Decorator: run the property on these arguments as a pytest item of its own (see the module
    docstring). Stacked decorators keep the order they are written in."""
    if "case" not in arguments:
        raise TypeError("pinned(...) needs case=: a pinned example is named by its case")

    def decorate(test):
        setattr(test, PINNED_ATTRIBUTE, [Pinned(arguments), *getattr(test, PINNED_ATTRIBUTE, [])])
        return test
    return decorate


def case_param_id(case: Case) -> str:
    """The case's id as it appears in a node id (the module docstring says why `-`)."""
    return case.id.replace("|", "-")


def impl_id(spec: str) -> str:
    """`--fp8-impl` as it appears in a node id: a file's directory dropped (evals/zoo/mutants.py:
    scale_not_inverted -> mutants.py:scale_not_inverted), a module spec as written, any other
    character than letters, digits and `_.:+-` as `_` (a space in a file name)."""
    where, colon, attr = spec.rpartition(":")
    if not colon or re.search(r"[\\/]", attr):  # no attribute (a drive letter's colon is not one)
        where, colon, attr = spec, "", ""
    if where.endswith(".py") or "/" in where or "\\" in where:
        where = re.split(r"[\\/]", where)[-1]
    return _safe(f"{where}{colon}{attr}")


def _token(value) -> str:
    if isinstance(value, (tuple, list)):
        return ":".join(_token(v) for v in value)
    if hasattr(value, "value") and isinstance(value.value, str):  # an enum such as Layout: its letter
        return _safe(value.value)
    return _safe(f"{value:g}" if isinstance(value, float) else str(value))


def _safe(text: str) -> str:
    return re.sub(r"[^\w.:+-]", "_", text)


# ---- collection -------------------------------------------------------------------------------------

def is_property_test(metafunc) -> bool:
    return IMPL_FIXTURE in metafunc.fixturenames and metafunc.definition.get_closest_marker(MARKER) is not None


def parametrize_implementation(metafunc, spec: str) -> None:
    """Before the test's own parameters: the implementation's name opens the id."""
    if is_property_test(metafunc):
        metafunc.parametrize(IMPL_FIXTURE, [spec], ids=[impl_id(spec)], indirect=True)


def parametrize_cases(metafunc, case_id: str | None) -> None:
    """After the test's own parameters: one item per pinned case and one for the search; with
    --fp8-case one item, the search held to that case (pinned ones are not run, as before)."""
    if not (is_property_test(metafunc) and is_hypothesis_test(metafunc.function)):
        return
    if case_id:
        params = [Generated(case_id)]
    else:
        params = [*getattr(metafunc.function, PINNED_ATTRIBUTE, []), Generated()]
    metafunc.parametrize(CASE_FIXTURE, params, ids=[p.id for p in params], indirect=True)


def case_param(item) -> Pinned | Generated | None:
    callspec = getattr(item, "callspec", None)
    return callspec.params.get(CASE_FIXTURE) if callspec is not None else None


# the tests (node ids without their case) whose pinned cases failed: key -> the first failing case
FAILED_PINNED = pytest.StashKey[dict[str, str]]()


def note_outcome(item, report) -> None:
    """Remember a pinned case's failure, for the search of the same test (call_item)."""
    pinned_case = case_param(item)
    if isinstance(pinned_case, Pinned) and report.when == "call" and report.failed:
        item.session.stash.setdefault(FAILED_PINNED, {}).setdefault(_without_case(item), pinned_case.case.id)


def call_item(item) -> bool | None:
    """Run a pinned item: the test's undecorated body on the pinned arguments (True: done). None
    for any other item, which pytest runs as usual, unless it is a search to skip (skip_search).
    A pinned case that the test's assume() rejects is skipped, where hypothesis would have
    dropped the @example silently."""
    skip_search(item)
    pinned_case = case_param(item)
    if not isinstance(pinned_case, Pinned):
        return None
    body = item.obj.hypothesis.inner_test
    from_pytest = {name: item.funcargs[name] for name in inspect.signature(body).parameters
                   if name not in pinned_case.arguments}
    try:
        body(**from_pytest, **pinned_case.arguments)
    except UnsatisfiedAssumption:
        pytest.skip(f"the test's assume() rejects the pinned case {pinned_case.case.id}")
    return True


def skip_search(item) -> None:
    """Skip the search of a test one of whose pinned cases failed in this process (note_outcome)."""
    own = case_param(item)
    if not (isinstance(own, Generated) and own.case_id is None):
        return
    failed = item.session.stash.get(FAILED_PINNED, {}).get(_without_case(item))
    if failed:  # _use_item_location: reported at the test's line, as a skip marker is, not at this one
        raise pytest.skip.Exception(f"not searched: the pinned case {failed} already fails (as hypothesis stops "
                                    f"at a failing @example); `-k {GENERATED}` searches anyway",
                                    _use_item_location=True)


def suite_module(module_path: Path, parent, shipped: Path | None):
    """The shipped suite's module, named by its absolute path where it lies outside the rootdir.

    `pytest --fp8-impl X` in another repository puts the installed suite on the command line;
    pytest names a file given there and outside its rootdir by its path relative to itself: ""
    (`FAILED ::test_parity_with_reference`). Its absolute path is a node id that pytest, run from
    anywhere, finds again. None (pytest collects as usual) for every other module."""
    if shipped is None or module_path != shipped or module_path.is_relative_to(parent.config.rootpath):
        return None
    return pytest.Module.from_parent(parent, path=module_path, nodeid=module_path.as_posix())


# ---- rerunning -----------------------------------------------------------------------------------

def shown_path(path: Path, start: Path) -> str:
    """The path relative to `start` where it lies below it, else absolute."""
    return os.path.relpath(path, start) if path.is_relative_to(start) else str(path)


def _without_case(item, nodeid: str | None = None) -> str:
    """The node id up to its case parameter's id: `...[impl-relation-` (the whole id if it has none)."""
    nodeid = item.nodeid if nodeid is None else nodeid
    own = case_param(item)
    return nodeid[:-len(own.id) - 1] if own is not None and nodeid.endswith(f"-{own.id}]") else nodeid


def rerun_node_id(item, case: Case) -> str:
    """The node id that reruns exactly `case` under `--fp8-case`: the item's own, its case
    parameter named by `case` (there, the only case parameter), its path valid from where pytest
    was started."""
    within = item.nodeid.split("::", 1)[1] if "::" in item.nodeid else item.name
    if case_param(item) is not None and _without_case(item, within) != within:
        within = f"{_without_case(item, within)}{case_param_id(case)}]"
    return f"{shown_path(item.path, item.config.invocation_params.dir)}::{within}"
