"""pytest configuration: hypothesis profiles, the gpu marker, fixtures and parity options.

Profiles (registered once, here):
    dev       default: quick, random (what you run while editing)
    ci        derandomized, no deadline, no example database, print_blob; chosen when CI=true
    gpu       no deadline, more and larger examples (the H200 runner)
    thorough  >= 1000 examples: nightly or before a release
Choose one with `pytest --hypothesis-profile=NAME` or FP8_PARITY_PROFILE=NAME.

Options: --impl / --against point the property suite at any implementation (default
fp8_impl against torchao:tensorwise); --device picks cpu or cuda; --parity-report DIR
writes the metric rows the tests computed as a report.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, Phase, settings

from parity import sharding, suite
from parity.impls import ImplError

_COMMON = dict(suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                      HealthCheck.function_scoped_fixture])
settings.register_profile("dev", max_examples=20, deadline=None, **_COMMON)
settings.register_profile("ci", max_examples=30, derandomize=True, deadline=None, database=None,
                          print_blob=True, **_COMMON)
settings.register_profile("gpu", max_examples=100, deadline=None, derandomize=True, database=None,
                          print_blob=True, **_COMMON)
settings.register_profile("thorough", max_examples=1000, deadline=None, print_blob=True, **_COMMON)
DEFAULT_PROFILE = os.environ.get("FP8_PARITY_PROFILE") or (
    "ci" if os.environ.get("CI", "").lower() in ("1", "true", "yes") else "dev")
settings.load_profile(DEFAULT_PROFILE)  # --hypothesis-profile, if given, overrides this later


def fp8_gpu_available() -> bool:
    """A CUDA device whose tensor cores take FP8 (compute capability >= 8.9), or ROCm MI300+."""
    if not torch.cuda.is_available():
        return False
    return torch.version.hip is not None or torch.cuda.get_device_capability() >= (8, 9)


GPU_SKIP_REASON = "needs a CUDA device with FP8 support (compute capability >= 8.9)"


def pytest_addoption(parser):
    group = parser.getgroup("fp8-parity")
    group.addoption("--impl", default="fp8_impl", help="implementation under test (default: fp8_impl)")
    group.addoption("--against", default="torchao:tensorwise", help="reference (default: torchao:tensorwise)")
    group.addoption("--device", default="auto", choices=["auto", "cpu", "cuda"],
                    help="device of the property suite (default: cuda if an FP8 GPU is present)")
    group.addoption("--parity-report", default=None, metavar="DIR",
                    help="write the metric rows the property tests computed as a report into DIR")
    group.addoption("--seed", type=int, default=0, help="base seed of the data of non-hypothesis tests")
    group.addoption("--case", default=None, metavar="CASE_ID",
                    help="run the property tests on exactly this case (what a failure's rerun command passes)")


@pytest.hookimpl(trylast=True)  # after hypothesis has loaded --hypothesis-profile
def pytest_configure(config):
    config.addinivalue_line("markers", f"gpu: {GPU_SKIP_REASON}; skipped elsewhere")
    profile = getattr(settings, "_current_profile", None) or DEFAULT_PROFILE
    case_id = config.getoption("--case")
    if case_id:  # exactly one case: no explicit @examples, one generated example (the given case)
        settings.register_profile("rerun", parent=settings.get_profile(profile), max_examples=1,
                                  phases=[Phase.generate])
        settings.load_profile("rerun")
    device = config.getoption("--device")
    if device == "auto":
        device = "cuda" if fp8_gpu_available() else "cpu"
    configured = suite.configure(impl=config.getoption("--impl"), against=config.getoption("--against"),
                                 device=device, case_id=case_id, profile=profile)
    try:
        configured.candidate, configured.reference  # noqa: B018 - load now: a bad name is a usage error
    except ImplError as err:
        raise pytest.UsageError(f"--impl/--against: {err}") from None


def pytest_collection_modifyitems(config, items):
    if fp8_gpu_available():
        return
    skip = pytest.mark.skip(reason=GPU_SKIP_REASON)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def device(pytestconfig) -> str:
    """The device of the property suite: --device, else cuda when an FP8 GPU is present."""
    requested = pytestconfig.getoption("--device")
    if requested == "cuda" and not fp8_gpu_available():
        pytest.skip(GPU_SKIP_REASON)
    if requested == "auto":
        return "cuda" if fp8_gpu_available() else "cpu"
    return requested


xdist_device = pytest.fixture(scope="session", name="xdist_device")(sharding.xdist_device)


@pytest.fixture
def seed(pytestconfig) -> int:
    """Seed for the data of a non-hypothesis test (hypothesis draws its own)."""
    return pytestconfig.getoption("--seed")


@pytest.fixture
def generator(seed) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def pytest_sessionfinish(session, exitstatus):
    """--parity-report DIR: the metric rows the property tests computed, through the one report writer."""
    suite.SUITE.close()  # the worker process of a candidate that is not a built-in
    out = session.config.getoption("--parity-report")
    if not out or not suite.SUITE.rows:
        return
    import pandas as pd

    from parity.env import environment
    from parity.report import verdict, write_report
    frame = pd.DataFrame.from_records(suite.SUITE.rows)
    frame.attrs["env"] = environment(suite.SUITE.device)
    judged = verdict(frame, candidate=suite.SUITE.candidate.name)
    write_report(frame, out, title=f"fp8-parity property suite: {suite.SUITE.candidate.name}",
                 candidate=suite.SUITE.candidate.name, verdict=judged)
    session.config.get_terminal_writer().line(f"parity report: {out}/summary.md ({judged.headline})")

