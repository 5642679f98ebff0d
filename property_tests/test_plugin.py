"""The installed pytest plugin, as a user meets it in another repository: `pytest --fp8-impl X`
runs the shipped suite, a user's own test gets the fixtures and strategies, and `fp8-parity test`
wraps it with fp8-parity's exit codes. Each runs pytest in a fresh process in an empty folder."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ZOO = Path(__file__).parent / "mutants.py"
USER_TEST = textwrap.dedent('''
    from hypothesis import given

    from parity.strategies import cases


    @given(case=cases(max_dim=64))
    def test_my_layer_matches_its_reference(fp8_suite, case):
        rows, violations = fp8_suite.run(case)
        fp8_suite.assert_no_violations("my layer differs from its reference", case, rows, violations)
''')


def run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *argv], cwd=cwd, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "CI": "true"})


def test_fp8_impl_alone_runs_the_shipped_suite_in_any_repository(tmp_path):
    done = run(["-m", "pytest", "-v", "-p", "no:randomly", "-p", "no:cacheprovider", "--fp8-impl", "fp8_impl",
                "-k", "contracts"], tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "::test_contracts PASSED" in done.stdout and "16 deselected" in done.stdout, done.stdout[-2000:]


def test_a_users_own_test_gets_the_fixtures_and_strategies(tmp_path):
    (tmp_path / "test_mine.py").write_text(USER_TEST)
    done = run(["-m", "pytest", "-q", "-p", "no:cacheprovider", "test_mine.py", "--fp8-impl",
                f"{ZOO}:weight_scale_bf16"], tmp_path)
    assert done.returncode == 1, done.stdout[-2000:]
    assert "my layer differs from its reference" in done.stdout and "Rerun exactly this case:" in done.stdout


@pytest.mark.parametrize(("impl", "code"), [(f"{ZOO}:weight_scale_bf16", 1), ("fp8_imp", 2)])
def test_fp8_parity_test_gives_fp8_paritys_exit_codes(tmp_path, impl, code):
    done = run(["-m", "parity", "test", "--impl", impl, "--", "-q", "-x", "-k", "parity_with_reference"], tmp_path)
    assert done.returncode == code, done.stdout[-2000:] + done.stderr[-2000:]
