"""Hostile files and folders for fp8-parity's readers and writers (issue 29, items 8, 9, 10, 11, 14).

Each builder below makes, under `root`, the files one entry of `files.json` (next to this file)
runs a command on: a results table cut short and compressed again, a table with text in a number
column, two gzip members, an env.json or partial.json that is not what fp8-parity writes, an output
path that is a pipe or a link to /dev/null, a folder of the user's own files where a report would
land; or names the layers of large_only.py, wrong only past a size a small search draws. A builder
gets two report folders fp8-parity wrote (parity.report.write_report): `passing` (every judged row
within its policy) and `failing` (the same rows but for its last case's, which fail), copies what it
needs, and returns the paths the command's text names ({name} in files.json).

Every command must end with its exit code and first line, no traceback, and every file that
existed before it and that fp8-parity did not write (no fp8-parity-manifest.json lists it) the
same after it: property_tests/test_hostile.py runs them.
"""

from __future__ import annotations

import csv
import gzip
import io
import json
import os
import shutil
from pathlib import Path

from parity.folder_manifest import MANIFEST_FILE
from parity.table_seal import PREFIX

TABLE = "results.csv.gz"


def _lines(report: Path) -> list[bytes]:
    return gzip.decompress((report / TABLE).read_bytes()).splitlines(keepends=True)


def half_of_a_failing_table_compressed_again(root: Path, passing: Path, failing: Path) -> dict:
    """The first half of a FAIL table's CSV lines (its failing rows are in the second half), gzipped again:
    a valid gzip of a valid table of fewer rows, which read PASS."""
    lines = _lines(failing)
    folder = root / "half"
    folder.mkdir()
    (folder / TABLE).write_bytes(gzip.compress(b"".join(lines[: len(lines) // 2])))
    return {"dir": folder}


def failing_table_as_csv_cut_at_30_kb(root: Path, passing: Path, failing: Path) -> dict:
    """A FAIL table's CSV, plain, cut at 30 KB (at a line break, so no row is visibly torn)."""
    text = b"".join(_lines(failing))
    cut = text[: text.rindex(b"\n", 0, 30_000) + 1]
    (root / "cut.csv").write_bytes(cut)
    return {"table": root / "cut.csv"}


def sealed_table_with_a_row_edited(root: Path, passing: Path, failing: Path) -> dict:
    """A sealed FAIL table whose failing SQNR values (its last case's three rows) were edited to pass,
    compressed again with its seal (the header comment) kept: the checksum no longer matches."""
    data = (failing / TABLE).read_bytes()
    comment = data[10:data.index(b"\0", 10)]
    assert comment.decode().startswith(PREFIX)
    lines = _lines(failing)
    edited = b"".join(lines[:-3] + [_with_cell(lines[0], line, "sqnr_db", "99.0") for line in lines[-3:]])
    folder = root / "edited"
    folder.mkdir()
    regzipped = gzip.compress(edited, mtime=0)
    (folder / TABLE).write_bytes(regzipped[:3] + bytes([0x10]) + regzipped[4:10] + comment + b"\0" + regzipped[10:])
    return {"dir": folder}


def _with_cell(header: bytes, line: bytes, column: str, value: str) -> bytes:
    """The CSV line with the cell of `column` replaced."""
    names = next(csv.reader([header.decode()]))
    cells = next(csv.reader([line.decode()]))
    cells[names.index(column)] = value
    text = io.StringIO()
    csv.writer(text, lineterminator="\n").writerow(cells)
    return text.getvalue().encode()


def text_in_a_number_column(root: Path, passing: Path, failing: Path) -> dict:
    """A table (plain CSV, so no seal) whose sqnr_db column holds text in one row."""
    lines = _lines(passing)
    (root / "text.csv").write_bytes(lines[0] + _with_cell(lines[0], lines[1], "sqnr_db", "not a number")
                                    + b"".join(lines[2:]))
    return {"table": root / "text.csv"}


def two_gzip_members(root: Path, passing: Path, failing: Path) -> dict:
    """Two sealed tables concatenated (`cat a.csv.gz b.csv.gz`): gzip readers read both, and the second
    header becomes a row of text."""
    folder = root / "concatenated"
    folder.mkdir()
    (folder / TABLE).write_bytes((passing / TABLE).read_bytes() + (failing / TABLE).read_bytes())
    return {"dir": folder}


def env_json_that_is_a_list(root: Path, passing: Path, failing: Path) -> dict:
    """A sealed table whose env.json holds a JSON list."""
    folder = root / "env_list"
    folder.mkdir()
    shutil.copy(passing / TABLE, folder / TABLE)
    (folder / "env.json").write_text("[1, 2, 3]\n")
    return {"dir": folder}


def _partial(root: Path, name: str, passing: Path, info: str) -> Path:
    folder = root / name
    folder.mkdir()
    shutil.copy(passing / TABLE, folder / "partial.csv.gz")
    (folder / "partial.json").write_text(info)
    return folder


def malformed_partial_json(root: Path, passing: Path, failing: Path) -> dict:
    """An interrupted sweep's folder whose partial.json is cut short."""
    return {"dir": _partial(root, "partial_malformed", passing, '{"done": 2, "planned":')}


def partial_json_that_is_a_list(root: Path, passing: Path, failing: Path) -> dict:
    """An interrupted sweep's folder whose partial.json holds a JSON list."""
    return {"dir": _partial(root, "partial_list", passing, "[2, 5]\n")}


def output_that_is_a_named_pipe(root: Path, passing: Path, failing: Path) -> dict:
    """An output path (--json, --csv) that is a named pipe: writing it would block or replace it."""
    os.mkfifo(root / "pipe")
    return {"path": root / "pipe", "passing": passing}


def output_that_links_to_dev_null(root: Path, passing: Path, failing: Path) -> dict:
    """An output path that is a symbolic link to /dev/null: renaming a file over it replaces the link."""
    (root / "null_link").symlink_to("/dev/null")
    return {"path": root / "null_link", "passing": passing}


def _users_folder(folder: Path) -> Path:
    folder.mkdir(parents=True)
    for name, text in {"index.html": "<p>my page</p>\n", "summary.md": "# my notes\n", "env.json": '{"mine": 1}\n',
                       "notes.txt": "keep me\n"}.items():
        (folder / name).write_text(text)
    return folder


def report_folder_inside_a_users_folder(root: Path, passing: Path, failing: Path) -> dict:
    """A report folder `rep` inside a folder of the user's own summary.md, index.html and env.json:
    `report DIR/rep` wrote its summary into DIR."""
    folder = _users_folder(root / "users")
    shutil.copytree(failing, folder / "rep")
    return {"dir": folder}


def report_over_another_report(root: Path, passing: Path, failing: Path) -> dict:
    """Two report folders: `report A --out B` replaced B's results table without a word."""
    shutil.copytree(passing, root / "a")
    shutil.copytree(failing, root / "b")
    return {"a": root / "a", "b": root / "b"}


def sweep_into_a_users_folder(root: Path, passing: Path, failing: Path) -> dict:
    """A folder of the user's own index.html, summary.md and env.json given to `sweep --out`."""
    return {"dir": _users_folder(root / "mine")}


def table_in_a_users_folder(root: Path, passing: Path, failing: Path) -> dict:
    """A sealed table copied into a folder of the user's files: `report TABLE` writes beside it by default."""
    folder = _users_folder(root / "downloads")
    shutil.copy(passing / TABLE, folder / TABLE)
    return {"table": folder / TABLE}


def report_folder_edited_by_hand(root: Path, passing: Path, failing: Path) -> dict:
    """A report folder fp8-parity wrote whose summary.md the user then edited: re-rendering would lose it."""
    shutil.copytree(passing, root / "edited_report")
    with (root / "edited_report" / "summary.md").open("a") as summary:
        summary.write("\nMy conclusions, written by hand.\n")
    assert (root / "edited_report" / MANIFEST_FILE).is_file()
    return {"dir": root / "edited_report"}


def layers_wrong_past_a_size(root: Path, passing: Path, failing: Path) -> dict:
    """No file: the layers of large_only.py (next to this file), right at every size a small search draws."""
    return {"layers": Path(__file__).with_name("large_only.py")}


def nothing(root: Path, passing: Path, failing: Path) -> dict:
    """No file: the command alone is hostile."""
    return {"new": root / "new"}


def manifest() -> list[dict]:
    return json.loads((Path(__file__).with_name("files.json")).read_text())
