"""`fp8-parity --help` and a usage error are answered without importing torch (issue 28, item 7).

They took 3.4-11 s (a typo in a flag 11-15 s under load) while parity.cli imported torch, torchao
and pandas to build its parser. How long they take now is measured by evals/scoring/cli_latency.py
(under 0.5 s on a 2-core machine); what keeps them fast is tested here without a clock: in a fresh
interpreter (this one has torch already), build the parser, print every help, parse every command,
raise the usage errors, and none of the heavy modules may have been imported.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from parity import entry

ROOT = Path(entry.__file__).resolve().parents[1]  # where `python -m parity` finds this checkout's parity
HEAVY = ("torch", "torchao", "pandas", "numpy", "matplotlib", "hypothesis")

# arguments every command parses (a report and a diff are not read while parsing)
VALID = [["check", "--impl", "fp8_impl"], ["sweep"], ["bisect", "--impl", "fp8_impl"], ["bench"], ["throughput"],
         ["train", "--impl", "fp8_impl"], ["report", "results.csv.gz"], ["diff", "a.csv.gz", "b.csv.gz"],
         ["test", "--impl", "fp8_impl"], ["calibrate"]]
USAGE_ERRORS = [["check", "--bogus"], ["check", "--impl", "fp8_impl", "--max-examples", "-1"], ["bogus"], []]


def _run(code: str, tmp_path: Path) -> dict:
    """Run `code` in a fresh interpreter from the checkout's root; what it wrote to OUT as JSON."""
    out = tmp_path / "out.json"
    done = subprocess.run([sys.executable, "-c", code, str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return json.loads(out.read_text())


def test_the_parser_builds_prints_help_and_parses_without_torch(tmp_path):
    code = f"""
import contextlib, io, json, sys
from parity.cli import build_parser
parser = build_parser()
helps = [parser.format_help()]
subparsers = next(action for action in parser._actions if action.dest == "command")
helps += [sub.format_help() for sub in subparsers.choices.values()]
parsed = [parser.parse_args(argv).command for argv in {VALID!r}]
codes = []
for argv in {USAGE_ERRORS!r}:
    with contextlib.redirect_stderr(io.StringIO()):
        try:
            parser.parse_args(argv)
        except SystemExit as exit:
            codes.append(exit.code)
heavy = [name for name in {HEAVY!r} if name in sys.modules]
json.dump(dict(helps=len(helps), parsed=parsed, codes=codes, heavy=heavy), open(sys.argv[1], "w"))
"""
    result = _run(code, tmp_path)
    assert result["heavy"] == [], f"building the parser imported {result['heavy']}"
    assert result["helps"] == 11 and result["parsed"] == [argv[0] for argv in VALID]
    assert result["codes"] == [2] * len(USAGE_ERRORS)


def test_python_m_parity_answers_help_and_usage_errors_without_torch(tmp_path):
    # the whole path a user's command takes: parity.__main__, parity.entry, parity.cli.main
    code = f"""
import contextlib, io, json, runpy, sys
out, answers = sys.argv[1], []
for argv in {[["--help"], ["check", "--help"], *USAGE_ERRORS]!r}:
    sys.argv = ["fp8-parity", *argv]
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            runpy.run_module("parity", run_name="__main__", alter_sys=True)
            code = None
        except SystemExit as exit:
            code = exit.code
    answers.append(dict(argv=argv, code=code, stdout=stdout.getvalue(), stderr=stderr.getvalue(),
                        heavy=[name for name in {HEAVY!r} if name in sys.modules]))
json.dump(answers, open(out, "w"))
"""
    for answer in _run(code, tmp_path):
        assert answer["heavy"] == [], (answer["argv"], f"imported {answer['heavy']}")
        if "--help" in answer["argv"]:
            assert answer["code"] == 0 and answer["stdout"].startswith("usage: fp8-parity"), answer
        else:  # one line, exit 2
            assert answer["code"] == 2 and answer["stdout"] == "", answer
            assert answer["stderr"].count("\n") == 1 and "(see fp8-parity" in answer["stderr"], answer
