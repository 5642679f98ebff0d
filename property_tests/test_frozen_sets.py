"""The held-out sets are frozen: every file under evals/heldout/ is the file its set was frozen with
(FROZEN.sha256) or is declared not frozen (NOT-FROZEN.txt), as `python -m evals.scoring.frozen` checks."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from evals.scoring import frozen, sets

REPO = Path(__file__).resolve().parents[1]


def test_the_held_out_sets_are_frozen():
    assert frozen.verify() == []
    done = subprocess.run([sys.executable, "-m", "evals.scoring.frozen"], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"of {len(sets.SETS)} held-out sets match FROZEN.sha256" in done.stdout


def test_a_changed_missing_or_undeclared_file_is_named(tmp_path, capsys):
    root = tmp_path / "heldout"
    shutil.copytree(sets.HELDOUT, root, ignore=shutil.ignore_patterns(*frozen.CACHES))
    with open(root / "set15" / "h15_b01.py", "a") as changed:
        changed.write("# one line more\n")
    (root / "set01" / "tw01.py").unlink()
    (root / "set02" / "stray.py").write_text("")
    (root / "set08" / "LABELS-NOTE.md").unlink()
    (root / "set03" / "__pycache__").mkdir()
    (root / "set03" / "__pycache__" / "tw01.cpython-312.pyc").write_bytes(b"")  # a cache: not a set's file
    assert frozen.main(["--root", str(root)]) == 1
    assert capsys.readouterr().out.splitlines()[1:] == [
        "changed since its set was frozen: set15/h15_b01.py",
        "frozen but missing: set01/tw01.py",
        "neither frozen nor declared in NOT-FROZEN.txt: set02/stray.py",
        "declared in NOT-FROZEN.txt but absent: set08/LABELS-NOTE.md",
    ]
