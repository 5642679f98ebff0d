"""The frozen held-out sets under evals/heldout/: their names, folders and implementation paths.

A set is named setNN (set01 .. set19). Each was written and frozen as property_tests/heldoutN/
(property_tests/heldout for the first), and its frozen manifest still names its implementations
by that path (`property_tests/heldout15/h15_b01.py:fp8_linear`); the sets may not be edited, so
the scorers map those paths here instead. The old folder names are accepted wherever a set is
named (`--set heldout15`, `--set heldout` for set01), so commands written before the move still run.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

HELDOUT = Path(__file__).resolve().parents[1] / "heldout"
SET_COUNT = 19
SETS = [f"set{number:02d}" for number in range(1, SET_COUNT + 1)]
# Sets 1-15 were written as property_tests/heldout*/; sets 16 (MXFP8), 17 (NVFP4), 18 and 19 (both) were written in
# place, as evals/heldout/setNN/, and their manifests name their files so.
WRITTEN_IN_PLACE = ("set16", "set17", "set18", "set19")
OLD_FOLDER = {name: "heldout" if number == 1 else f"heldout{number}" for number, name in enumerate(SETS, start=1)
              if name not in WRITTEN_IN_PLACE}
_OLD_TO_NEW = {old: new for new, old in OLD_FOLDER.items()}
_OLD_IMPL = re.compile(r"^property_tests/(heldout\d*)/(.+)$")
_NEW_IMPL = re.compile(r"^evals/heldout/(set\d\d)/(.+)$")


class SetError(ValueError):
    """A set name or an implementation path that names no held-out set."""


def set_name(name: str) -> str:
    """The setNN name of a set given as setNN, its old folder name (heldout, heldout2, ...) or a bare number."""
    if name in SETS:
        return name
    if name in _OLD_TO_NEW:
        return _OLD_TO_NEW[name]
    if name.isdigit() and f"set{int(name):02d}" in SETS:
        return f"set{int(name):02d}"
    raise SetError(f"no held-out set named {name!r}: the sets are set01 .. set{SET_COUNT:02d} (or their old "
                   f"names heldout, heldout2 .. heldout{SET_COUNT}), e.g. set15")


def set_dir(name: str) -> Path:
    """The folder of a set under evals/heldout/."""
    return HELDOUT / set_name(name)


def manifest(name: str) -> list[dict]:
    """A set's frozen manifest: one entry per implementation, its expected category, GEMM, operand, triggers."""
    return json.loads((set_dir(name) / "manifest.json").read_text())


def impl_path(impl: str) -> str:
    """A manifest's `property_tests/heldoutN/FILE:ATTR` as the absolute `evals/heldout/setNN/FILE:ATTR`."""
    in_place = _NEW_IMPL.match(impl)
    if in_place is not None and in_place.group(1) in SETS:
        return str(set_dir(in_place.group(1)) / in_place.group(2))
    matched = _OLD_IMPL.match(impl)
    if matched is None or matched.group(1) not in _OLD_TO_NEW:
        raise SetError(f"implementation {impl!r} is not in a held-out set: a manifest names its files "
                       f"property_tests/heldoutN/FILE.py:ATTR (the set's folder when it was frozen)")
    return str(set_dir(matched.group(1)) / matched.group(2))
