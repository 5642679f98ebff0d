"""Did a refactoring change what the harness says? Every held-out entry's verdict and localization before
and after, compared field by field.

    python -m evals.scoring.golden BEFORE_DIR AFTER_DIR

BEFORE_DIR holds the per-set JSON of `heldout_rates --json` as it was named before evals/ existed
(heldout.json, heldout2.json ... heldout15.json); AFTER_DIR a results folder of evals.scoring.scores
(set01.json ... set15.json, rows under "rows"). Compared: check's verdict, what bisect said, GEMM,
class, operand and trigger scores, and the method. Timings are not compared. Exit 1 when any differ.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

FIELDS = ["check", "said", "gemm_ok", "class_ok", "operand_ok", "triggers_ok", "correct", "method"]
OLD_NAMES = ["heldout"] + [f"heldout{number}" for number in range(2, 16)]


def differences(before: Path, after: Path) -> tuple[int, list[str]]:
    compared, found = 0, []
    for number, old in enumerate(OLD_NAMES, start=1):
        old_file, new_file = before / f"{old}.json", after / f"set{number:02d}.json"
        if not (old_file.exists() and new_file.exists()):
            found.append(f"set{number:02d}: no results {'before' if not old_file.exists() else 'after'}")
            continue
        old_rows = {row["name"]: row for row in json.loads(old_file.read_text())}
        new_rows = {row["name"]: row for row in json.loads(new_file.read_text())["rows"]}
        if set(old_rows) != set(new_rows):
            found.append(f"set{number:02d}: entries differ: {sorted(set(old_rows) ^ set(new_rows))}")
        for name in sorted(set(old_rows) & set(new_rows)):
            compared += 1
            changed = [f"{key}: {old_rows[name].get(key)!r} -> {new_rows[name].get(key)!r}" for key in FIELDS
                       if old_rows[name].get(key) != new_rows[name].get(key)]
            if changed:
                found.append(f"set{number:02d} {name}: " + "; ".join(changed))
    return compared, found


def main(argv: list[str] | None = None) -> int:
    before, after = (Path(arg) for arg in (argv or sys.argv[1:]))
    compared, found = differences(before, after)
    print("\n".join(found))
    print(f"{compared} entries compared, {len(found)} differ")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
