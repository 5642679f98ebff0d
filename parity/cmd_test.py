"""`fp8-parity test`: the shipped hypothesis property suite run by pytest against an
implementation (the same as `pytest --fp8-impl X`), pytest's exit code mapped to fp8-parity's."""

from __future__ import annotations

import signal

import pytest

from parity import cmd_inputs
from parity.exits import EXIT_CANNOT_RUN, EXIT_FAIL, EXIT_INTERNAL, EXIT_PASS, EXIT_SIGNAL, EXIT_USAGE
from parity.impls import load_impl
from parity.results_file import EARLIER_REPORT
from parity.suite import shipped_suite
from parity.recipes import get_recipe

# pytest: 0 passed, 1 tests failed, 2 interrupted, 3 internal error, 4 usage error, 5 no tests collected
EXIT_OF_PYTEST = {0: EXIT_PASS, 1: EXIT_FAIL, 2: EXIT_SIGNAL[signal.SIGINT], 3: EXIT_INTERNAL, 4: EXIT_USAGE,
                  5: EXIT_CANNOT_RUN}


def cmd_test(args) -> int:
    if args.recipe:
        get_recipe(args.recipe)  # a typo is a usage error here, with its "did you mean"
    if args.report is not None:
        cmd_inputs.report_folder(args.report, "--report", force=None, protected=EARLIER_REPORT)
    # a name that does not load is a usage error now, with its message, not after pytest has started
    load_impl(args.impl, recipe=args.recipe)
    if args.against:
        load_impl(args.against)
    extra = [a for a in args.pytest_args if a != "--"]
    argv = [str(shipped_suite()), "--fp8-impl", args.impl, "--fp8-device", args.device, "-p", "no:cacheprovider",
            *(["--fp8-against", args.against] if args.against else []),
            *(["--fp8-recipe", args.recipe] if args.recipe else []),
            *(["--fp8-case", args.case] if args.case else []),
            *(["--fp8-cpu-gemm", args.cpu_gemm] if args.cpu_gemm else []),
            *(["--fp8-report", str(args.report)] if args.report else []), *extra]
    return EXIT_OF_PYTEST.get(int(pytest.main(argv)), EXIT_INTERNAL)
