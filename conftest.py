"""This repository's tests use fp8-parity's pytest plugin (parity/pytest_plugin.py), installed with
the package like any user's (`pip install -e .` registers it through the `pytest11` entry point):
its options (--fp8-impl, --fp8-against, --fp8-device, --fp8-case, --fp8-report, --fp8-seed), its
hypothesis profiles (fp8-dev, fp8-ci, fp8-gpu, fp8-thorough), the fp8_gpu marker and the fixtures
device, seed, generator, xdist_device and fp8_suite. Nothing is defined twice here; a checkout
used through PYTHONPATH without `pip install` (the GPU machine's) loads the plugin below. There the
shipped suite is run by its path (property_tests/suite/test_properties.py, as .ci/gpu does): its
package, parity.property_suite, exists only once pip has installed the checkout.
"""

import sys

if "parity.pytest_plugin" not in sys.modules:  # a checkout on PYTHONPATH, not pip-installed: load it here
    pytest_plugins = ["parity.pytest_plugin"]
