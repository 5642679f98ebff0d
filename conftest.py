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
from hypothesis import HealthCheck, settings

_COMMON = dict(suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                      HealthCheck.function_scoped_fixture])
settings.register_profile("dev", max_examples=20, deadline=None, **_COMMON)
settings.register_profile("ci", max_examples=30, derandomize=True, deadline=None, database=None,
                          print_blob=True, **_COMMON)
settings.register_profile("gpu", max_examples=150, deadline=None, derandomize=True, database=None,
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


def pytest_configure(config):
    config.addinivalue_line("markers", f"gpu: {GPU_SKIP_REASON}; skipped elsewhere")


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


@pytest.fixture
def seed(pytestconfig) -> int:
    """Seed for the data of a non-hypothesis test (hypothesis draws its own)."""
    return pytestconfig.getoption("--seed")


@pytest.fixture
def generator(seed) -> torch.Generator:
    return torch.Generator().manual_seed(seed)
