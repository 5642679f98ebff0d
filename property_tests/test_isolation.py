"""The code under test never runs where the verdict is made (issue 29).

The second hostile corpus (evals/hostile/at_import/, evals/hostile/worker_state.py) holds code that attacks
the process that judges it: exits 0 at import or at exit, patches the harness's `evaluate` or
`compare_executions`, doubles torch's matmuls so that a reference computed beside it doubles too, changes global
state before any snapshot, sleeps at import, raises what is not an Exception. Each must end in a finding (exit 1)
with one line and no traceback, and the process that gave the verdict must never have imported it.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from parity import sweep, transfer
from parity.worker import Worker

from property_tests.test_hostile import TINY, Expect, assert_outcome, run_cli

HOSTILE = Path(__file__).resolve().parents[1] / "evals" / "hostile"
AT_IMPORT = HOSTILE / "at_import"
CASE = "M16K32N16"
FAIL = r"^FAIL: "
NUMBERS = r"\[sqnr_db\] output \(step 0\)"  # twice the right output, against fp64
AT_IMPORT_STATE = r"\[contract\] output: the implementation changed global state: at import: "

# One expectation per file of evals/hostile/at_import/ (test_every_file_has_an_expectation keeps them in step).
AT_IMPORT_CASES: dict[str, Expect] = {
    "posix_exit": Expect(1, r"^FAIL: .*posix_exit.py:fp8_linear: the implementation exited the process with code 0 "
                            r"while importing the implementation$"),
    "atexit_exit": Expect(1, FAIL, NUMBERS),
    "thread_exit": Expect(1, FAIL, NUMBERS + r"|exited the process with code 0"),
    "patches_evaluate": Expect(1, FAIL, NUMBERS),
    "patches_comparison": Expect(1, FAIL, NUMBERS),
    "exits_at_exit_of_forward": Expect(1, FAIL, NUMBERS),
    "doubles_torch": Expect(1, FAIL, AT_IMPORT_STATE + r"torch.matmul replaced; torch.mm replaced; torch.addmm "
                                                       r"replaced; torch.nn.functional.linear replaced \(restored\)"),
    "state_at_import": Expect(1, FAIL, AT_IMPORT_STATE + r"default dtype torch.float32 -> torch.float64; flush "
                                                         r"denormals False -> True; the global random generator "
                                                         r"reseeded \(seed \d+ -> 1234\) \(restored\)"),
    "sleeps": Expect(1, r"^FAIL: .*sleeps.py:fp8_linear: the implementation ran past its time limit of 3 s while "
                        r"importing the implementation$", timeout=3),
}
STATE = r"\[contract\] output: the implementation changed global state: "
CRASH = r"\[crash\] the implementation raised: step 0: forward: "
WORKER_STATE_CASES: dict[str, Expect] = {
    "raises_base_exception": Expect(1, FAIL, CRASH + r"NotAnException: derived from BaseException"),
    "raises_unprintable": Expect(1, FAIL, CRASH + r"UnprintableError: <its message could not be read: str\(\) raised "
                                                  r"RuntimeError>"),
    "raises_50_mib_message": Expect(1, FAIL, CRASH + r"ValueError: x{500}\.\.\. \(52428800 characters in all\)"),
    "sets_default_device_meta": Expect(1, FAIL, STATE + r"default device cpu -> meta \(restored\)"),
    "sets_threads": Expect(1, FAIL, STATE + r"torch's host threads \d+ -> \d+ \(restored\)"),
    "sets_deterministic": Expect(1, FAIL, STATE + r"deterministic algorithms \(enabled, warn only\) \(False, False\) "
                                                  r"-> \(True, False\)"),
    "sets_anomaly": Expect(1, FAIL, STATE + r"anomaly detection off -> on"),
}


def _modules_from(folder: Path) -> set[str]:
    return {name for name, module in list(sys.modules.items())
            if str(getattr(module, "__file__", "") or "").startswith(str(folder))}


def test_every_file_has_an_expectation():
    assert sorted(p.stem for p in AT_IMPORT.glob("*.py") if p.stem != "__init__") == sorted(AT_IMPORT_CASES)


@pytest.mark.parametrize("name", list(AT_IMPORT_CASES))
def test_code_that_attacks_the_judging_process_is_a_finding_and_never_imported_here(name):
    expect = AT_IMPORT_CASES[name]
    before = _modules_from(AT_IMPORT)
    assert_outcome(["check", "--impl", f"{AT_IMPORT / name}.py:fp8_linear", "--recipe", "bf16", "--case", CASE,
                    "--timeout", f"{expect.timeout:g}", "--quiet"], expect)
    assert _modules_from(AT_IMPORT) == before, f"{name} was imported by the process that judged it"


@pytest.mark.parametrize("name", list(WORKER_STATE_CASES))
def test_odd_exceptions_and_state_changes_are_findings(name):
    assert_outcome(["check", "--impl", f"{HOSTILE / 'worker_state.py'}:{name}", "--recipe", "bf16", "--case", CASE,
                    "--quiet"], WORKER_STATE_CASES[name])


def test_nan_from_the_37th_call_is_a_finding_not_an_internal_error():
    """Hypothesis replays a failing case and finds it passing (the failure needs the calls before it): once
    FlakyFailure, exit 3; now the first failing case is the finding, run alone to say it needs earlier calls."""
    code, text = run_cli(["check", "--impl", f"{HOSTILE / 'worker_state.py'}:nan_from_37th_call", "--recipe", "bf16",
                          "--max-examples", "40", "--quiet"])
    assert code == 1 and "Traceback" not in text and "internal error" not in text, text
    assert text.startswith("FAIL: ") and "[nonfinite]" in text, text


def test_an_atexit_exit_0_cannot_turn_a_failure_into_exit_0():
    """In a fresh process, as a shell or `git bisect run` sees it: the hook was never registered there."""
    done = subprocess.run([sys.executable, "-m", "parity", "check", "--impl", f"{AT_IMPORT / 'atexit_exit.py'}:"
                           "fp8_linear", "--recipe", "bf16", "--case", CASE, "--quiet"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 1 and done.stdout.startswith("FAIL: "), (done.returncode, done.stdout, done.stderr)


def test_the_other_commands_judge_outside_the_code_too(tmp_path, monkeypatch):
    """sweep and bisect: twice the right output behind a patched `evaluate` fails in each (on main: sweep PASS)."""
    monkeypatch.setitem(sweep.PRESETS, "quick", TINY)
    impl = f"{AT_IMPORT / 'patches_evaluate.py'}:fp8_linear"
    before = _modules_from(AT_IMPORT)
    code, text = run_cli(["sweep", "--impl", impl, "--quiet", "--out", str(tmp_path / "sweep")])
    assert code == 1 and text.startswith("FAIL"), text
    code, text = run_cli(["bisect", "--impl", impl, "--recipe", "bf16", "--case", CASE])
    assert code == 1 and text.startswith("FAIL"), text
    assert _modules_from(AT_IMPORT) == before


def test_a_checkout_on_the_impl_path_never_shadows_the_judges_modules(tmp_path, monkeypatch):
    """FP8_PARITY_IMPL_PATH (bisect --git) applies where the code under test runs: a folder on it whose torchao
    exits 0 at import cannot end the judging process (once: exit 0, nothing printed)."""
    (tmp_path / "torchao").mkdir()
    (tmp_path / "torchao" / "__init__.py").write_text("raise SystemExit(0)\n")
    monkeypatch.setenv("FP8_PARITY_IMPL_PATH", str(tmp_path))
    code, text = run_cli(["check", "--impl", "fp8_impl", "--case", CASE, "--quiet"])
    assert code == 0 and text.startswith("PASS: fp8_impl (tensorwise recipe) against torchao:tensorwise"), text


def _tampered_reply():
    import os

    class Exits:
        def __reduce__(self):
            return os._exit, (0,)
    return Exits()


def test_a_reply_that_would_run_code_when_read_is_refused():
    """A worker's reply is read without unpickling: one naming a callable (here os._exit) is a finding."""
    with Worker("cpu") as runner:
        outcome = runner.call(_send_raw_pickle)
    assert "sent back a reply the harness does not read" in outcome.message, outcome
    import pickle
    for protocol in (2, pickle.HIGHEST_PROTOCOL):
        with pytest.raises(transfer.TransferError, match=r"not plain data \(UnpicklingError: "):
            transfer.decode(pickle.dumps(_tampered_reply(), protocol=protocol))


def _send_raw_pickle():
    """In a worker: what code that replaced the worker's own sending would send."""
    import pickle

    from parity import worker
    worker._CONN.send_bytes(pickle.dumps(("ok", _tampered_reply())))
    return None
