"""This repository's tests use fp8-parity's pytest plugin (parity/pytest_plugin.py), installed with
the package like any user's (`pip install -e .` registers it through the `pytest11` entry point):
its options (--fp8-impl, --fp8-against, --fp8-device, --fp8-case, --fp8-report, --fp8-seed), its
hypothesis profiles (fp8-dev, fp8-ci, fp8-gpu, fp8-thorough), the fp8_gpu marker and the fixtures
device, seed, generator, xdist_device and fp8_suite. Nothing of the plugin is defined again here; a checkout
used through PYTHONPATH without `pip install` (the GPU machine's) loads the plugin below. There the
shipped suite is run by its path (property_tests/suite/test_properties.py, as .ci/gpu does): its
package, parity.property_suite, exists only once pip has installed the checkout. This repository's
own tests add one fixture, code_under_test_in_a_worker.
"""

import sys

if "parity.pytest_plugin" not in sys.modules:  # a checkout on PYTHONPATH, not pip-installed: load it here
    pytest_plugins = ["parity.pytest_plugin"]


import pytest  # noqa: E402


@pytest.fixture
def code_under_test_in_a_worker():
    """For tests that call parity.runner.execute / run_case directly on code under test (anything but a
    built-in): each execution runs in one CPU worker, as the commands run it, never in the test's process
    (which raises without a route). 600 s per execution: a time limit the tests never meet."""
    from parity.runner import executing_in
    from parity.worker import Worker
    runner = Worker("cpu")
    try:
        with executing_in(runner, 600.0):
            yield runner
    finally:
        runner.close()
