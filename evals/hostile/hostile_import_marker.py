"""Where a hostile module was imported: `note(name)` appends "PID NAME" to MARKER (in the temporary
directory). property_tests/test_hostile.py reads it to assert that the process that judges never
imported the code under test (the workers did)."""
import os
import tempfile
from pathlib import Path

MARKER = Path(tempfile.gettempdir()) / "fp8-parity-hostile-imports.log"


def note(name: str) -> None:
    with open(MARKER, "a") as marker:
        marker.write(f"{os.getpid()} {name}\n")


def importers(name: str, since: int = 0) -> list[int]:
    """The process ids that imported `name`, among the marker's lines from line `since` on."""
    lines = MARKER.read_text().splitlines()[since:] if MARKER.is_file() else []
    return [int(pid) for pid, _, noted in (line.partition(" ") for line in lines) if noted == name]


def line_count() -> int:
    return len(MARKER.read_text().splitlines()) if MARKER.is_file() else 0
