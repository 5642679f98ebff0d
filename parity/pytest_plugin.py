"""fp8-parity's pytest plugin: installed with the package (entry point `pytest11`), active in any
repository.

    pytest --fp8-impl mypkg.fp8:Float8Linear            the shipped property suite against your code
    pytest tests/ --fp8-impl mypkg.fp8:Float8Linear     your own tests, with the fixtures below
    fp8-parity test --impl mypkg.fp8:Float8Linear       the same as the first line

Options (all prefixed, so they never collide with yours):
    --fp8-impl X        the implementation under test (default fp8_impl); with no test paths on the
                        command line, pytest runs the shipped suite (the installed package
                        parity.property_suite: property_tests/suite/ in a checkout)
    --fp8-recipe R      the recipe it implements (default tensorwise for your own code)
    --fp8-against REF   its reference (default: its recipe's, torchao's tensorwise for fp8_impl)
    --fp8-device D      auto (default: cuda with an FP8 GPU, else cpu), cpu or cuda
    --fp8-cpu-gemm K    on a CPU, how FP8 GEMM calls are computed: fast (default), hopper (as an H200
                        does, bit for bit, and judged against the H200's bits) or torch
    --fp8-case ID       run the property tests on exactly this case (what a failure's rerun line passes)
    --fp8-report DIR    write the metric rows the property tests computed as a report
    --fp8-seed N        the seed of non-hypothesis test data

Fixtures: `fp8_suite` (the implementation, reference, cases and failure reports: parity.suite),
`device`, `seed`, `generator`, `xdist_device`; `fp8_candidate` and `fp8_case` on property tests.
Marker: `fp8_gpu` (needs a CUDA device with FP8 support; skipped elsewhere). Hypothesis profiles
`fp8-dev`, `fp8-ci` (derandomized, no deadline, no database), `fp8-gpu` and `fp8-thorough` are
registered; one is loaded only when you have not chosen a profile yourself: FP8_PARITY_PROFILE,
else fp8-ci when CI is set, else fp8-dev. Strategies for your own tests: parity.strategies.

How tests read: a module marked `pytestmark = parity.property_items.PROPERTY_TEST` (the shipped
suite) has node ids that name the implementation and the case, one test per case pinned with
parity.property_items.pinned (parity.property_items); any PropertyFailure, in your tests too, is
shown finding first, without a traceback of the harness (parity.pytest_report). This module holds
the options, hooks and fixtures; that work lives in those two.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch
from hypothesis import HealthCheck, Phase, settings

from parity import cpu_gemm, hopper, property_items, pytest_report, sharding, suite
from parity.cases import CaseError, SavedCase, check_fits, parse_case_id
from parity.data import read_case_file
from parity.env import environment
from parity.exits import one_line
from parity.folder_manifest import check_folder
from parity.outputs import OutputError, check_writable_dir
from parity.results_file import EARLIER_REPORT
from parity.impls import ImplError
from parity.recipes import RecipeError
from parity.rows import frame as rows_frame
from parity.suite import SuiteNotInstalled, shipped_suite

_COMMON = dict(suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                      HealthCheck.function_scoped_fixture])
PROFILES = {
    "fp8-dev": dict(max_examples=20, deadline=None),
    "fp8-ci": dict(max_examples=30, derandomize=True, deadline=None, database=None, print_blob=True),
    "fp8-gpu": dict(max_examples=100, deadline=None, derandomize=True, database=None, print_blob=True),
    "fp8-thorough": dict(max_examples=1000, deadline=None, print_blob=True),
}
for _name, _options in PROFILES.items():
    settings.register_profile(_name, **_options, **_COMMON)

GPU_SKIP_REASON = "needs a CUDA device with FP8 support (compute capability >= 8.9)"


def fp8_gpu_available() -> bool:
    """A CUDA device whose tensor cores take FP8 (compute capability >= 8.9), or ROCm MI300+."""
    if not torch.cuda.is_available():
        return False
    return torch.version.hip is not None or torch.cuda.get_device_capability() >= (8, 9)


def default_profile() -> str:
    return os.environ.get("FP8_PARITY_PROFILE") or (
        "fp8-ci" if os.environ.get("CI", "").lower() in ("1", "true", "yes") else "fp8-dev")


def pytest_addoption(parser):
    group = parser.getgroup("fp8-parity")
    group.addoption("--fp8-impl", default=None, metavar="IMPL",
                    help="implementation under test (default fp8_impl); alone, runs the shipped property suite")
    group.addoption("--fp8-recipe", default=None, metavar="RECIPE",
                    help="the recipe --fp8-impl implements (default tensorwise for your own code)")
    group.addoption("--fp8-against", default=None, metavar="REF",
                    help="reference (default: the implementation's recipe's, torchao:tensorwise for fp8_impl)")
    group.addoption("--fp8-device", default="auto", choices=["auto", "cpu", "cuda"],
                    help="device of the property suite (default: cuda if an FP8 GPU is present)")
    group.addoption("--fp8-cpu-gemm", default=None, choices=list(cpu_gemm.MODES),
                    help="on a CPU, how FP8 GEMM calls are computed: fast (default), hopper (as an H200 does, bit for "
                         "bit) or torch")
    group.addoption("--fp8-report", default=None, metavar="DIR",
                    help="write the metric rows the property tests computed as a report into DIR")
    group.addoption("--fp8-seed", type=int, default=0, help="base seed of the data of non-hypothesis tests")
    group.addoption("--fp8-case", default=None, metavar="CASE_ID",
                    help="run the property tests on exactly this case (what a failure's rerun command passes)")


@pytest.hookimpl(trylast=True)  # after hypothesis has read --hypothesis-profile
def pytest_configure(config):
    config.addinivalue_line("markers", f"fp8_gpu: {GPU_SKIP_REASON}; skipped elsewhere")
    config.addinivalue_line("markers", f"{property_items.MARKER}: a property test of --fp8-impl "
                                       f"(parity.property_items)")
    if sharding.xdist_processes() > 1:  # `pytest -n N`: N workers share the host's cores
        sharding.share_host_threads(sharding.xdist_processes())
    chosen = config.getoption("--hypothesis-profile", None)
    current = getattr(settings, "_current_profile", None)
    if not chosen and current in (None, "default"):
        settings.load_profile(default_profile())
    profile = getattr(settings, "_current_profile", None) or default_profile()
    case_id = config.getoption("--fp8-case")
    if case_id:  # exactly one case: no pinned cases, one generated example (the given case)
        _check_case(case_id, config.getoption("--fp8-device"))
        settings.register_profile("fp8-rerun", parent=settings.get_profile(profile), max_examples=1,
                                  phases=[Phase.generate])
        settings.load_profile("fp8-rerun")
    report = config.getoption("--fp8-report")
    if report:  # refused now, not after the suite ran: a folder of the user's own files, or an earlier report
        try:
            check_writable_dir(report, option="--fp8-report")
            check_folder(report, option="--fp8-report", force=None, protected=EARLIER_REPORT)
        except OutputError as err:
            raise pytest.UsageError(str(err)) from None
    impl = config.getoption("--fp8-impl")
    if impl and not config.option.file_or_dir:  # `pytest --fp8-impl X`: the shipped suite
        try:
            config.args[:] = [str(shipped_suite())]
        except SuiteNotInstalled as err:
            raise pytest.UsageError(str(err)) from None
    kernel = config.getoption("--fp8-cpu-gemm")
    if kernel is not None:  # read by every execution, here and in the workers (parity.worker passes it on)
        if kernel == "hopper" and not hopper.available():
            raise pytest.UsageError("--fp8-cpu-gemm hopper needs mmaemu (pip install mmaemu==0.1.0)")
        os.environ[cpu_gemm.ENV] = kernel
    device = config.getoption("--fp8-device")
    if device == "auto":
        device = "cuda" if fp8_gpu_available() else "cpu"
    configured = suite.configure(impl=impl or "fp8_impl", against=config.getoption("--fp8-against"),
                                 recipe=config.getoption("--fp8-recipe"), device=device, case_id=case_id,
                                 profile=profile.removeprefix("fp8-"))
    try:
        configured.candidate, configured.reference  # noqa: B018 - load now: a bad name is a usage error
    except (ImplError, RecipeError) as err:
        raise pytest.UsageError(f"--fp8-impl/--fp8-recipe/--fp8-against: {err}") from None


def _check_case(case_id: str, device: str) -> None:
    """pytest.UsageError when --fp8-case cannot run: an id that does not parse, a case file that does not
    read, operands larger than the memory. Said once now, not as a failure of every property test."""
    try:
        case = parse_case_id(case_id)
        if isinstance(case, SavedCase):
            read_case_file(case.path)
        check_fits(case, "cuda" if device == "cuda" else "cpu")
    except CaseError as err:
        raise pytest.UsageError(f"--fp8-case: {one_line(err)}") from None


def pytest_report_header(config):
    if config.getoption("--fp8-impl"):
        return pytest_report.header_line(suite.SUITE)
    return None


def pytest_pycollect_makemodule(module_path, parent):
    """The shipped suite outside the rootdir gets its absolute path as node id, not ""."""
    if module_path.is_relative_to(parent.config.rootpath):
        return None  # the common case, without looking the suite up
    try:
        shipped = shipped_suite()
    except SuiteNotInstalled:
        shipped = None
    return property_items.suite_module(module_path, parent, shipped)


@pytest.hookimpl(wrapper=True)
def pytest_generate_tests(metafunc):
    """A property test's ids: the implementation before the test's own parameters (which the
    hooks inside this wrapper add), the case after them (parity.property_items)."""
    property_items.parametrize_implementation(metafunc, suite.SUITE.impl_spec)
    result = yield
    property_items.parametrize_cases(metafunc, suite.SUITE.case_id)
    return result


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    return property_items.call_item(pyfuncitem)  # None: pytest calls it as usual


def pytest_runtest_setup(item):
    suite.SUITE.rerun_node = functools.partial(property_items.rerun_node_id, item)


def pytest_runtest_teardown(item):
    suite.SUITE.rerun_node = None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    property_items.note_outcome(item, report)
    if report.failed and call.excinfo is not None:
        report.longrepr = pytest_report.finding_first(item, call.excinfo) or report.longrepr
    return report


def pytest_terminal_summary(terminalreporter):
    line = pytest_report.summary_line(terminalreporter, suite.SUITE)
    if line:
        terminalreporter.write_line(line)


def pytest_collection_modifyitems(config, items):
    if fp8_gpu_available():
        return
    skip = pytest.mark.skip(reason=GPU_SKIP_REASON)
    for item in items:
        if "fp8_gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def fp8_suite() -> suite.Suite:
    """The implementation under test, its reference, case strategies and failure reports."""
    return suite.SUITE


@pytest.fixture
def fp8_candidate(request):
    """The implementation under test (parity.impls.Impl). Parametrized by the plugin on a property
    test, with its name as the id: the id of every such test opens with the implementation."""
    return suite.SUITE.candidate


@pytest.fixture
def fp8_case(request):
    """On a property test: the case it runs (parity.property_items.Pinned), or
    parity.property_items.Generated for the hypothesis search; None elsewhere."""
    return getattr(request, "param", None)


@pytest.fixture(scope="session")
def device(pytestconfig) -> str:
    """The device of the property suite: --fp8-device, else cuda when an FP8 GPU is present."""
    requested = pytestconfig.getoption("--fp8-device")
    if requested == "cuda" and not fp8_gpu_available():
        pytest.skip(GPU_SKIP_REASON)
    if requested == "auto":
        return "cuda" if fp8_gpu_available() else "cpu"
    return requested


xdist_device = pytest.fixture(scope="session", name="xdist_device")(sharding.xdist_device)


@pytest.fixture
def seed(pytestconfig) -> int:
    """Seed for the data of a non-hypothesis test (hypothesis draws its own)."""
    return pytestconfig.getoption("--fp8-seed")


@pytest.fixture
def generator(seed) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def pytest_sessionfinish(session, exitstatus):
    """--fp8-report DIR: the metric rows the property tests computed, through the one report writer."""
    suite.SUITE.close()  # the worker process of a candidate that is not a built-in
    out = session.config.getoption("--fp8-report")
    if not out or not suite.SUITE.rows:
        return
    # imported only when a report is asked for: parity.report brings matplotlib, 0.39-0.62 s of
    # `python -X importtime -c "import parity.pytest_plugin, parity.report"` (3 runs, 2-core machine,
    # 2026-12-02) in every pytest session of any repository where fp8-parity is installed
    from parity.report import verdict, write_report
    frame = rows_frame(suite.SUITE.rows)
    frame.attrs["env"] = environment(suite.SUITE.device)
    judged = verdict(frame, candidate=suite.SUITE.candidate.name)
    write_report(frame, out, title=f"fp8-parity property suite: {suite.SUITE.candidate.name}",
                 candidate=suite.SUITE.candidate.name, verdict=judged)
    session.config.get_terminal_writer().line(f"parity report: {out}/summary.md ({judged.headline})")
