"""The folders fp8-parity writes: a manifest of the files it wrote in each, and whether a folder may be written.

Why: a report folder is written by name (summary.md, index.html, env.json, results.csv.gz, the
plots), and a user's folder may hold files of those names (issue 29: `sweep --out FOLDER` replaced
a user's own index.html, summary.md and env.json; `report DIR/rep` wrote over DIR's). So every file
fp8-parity writes into a folder is listed, with its SHA-256, in that folder's

    fp8-parity-manifest.json   {"format": ..., "files": {"summary.md": {"sha256": ..., "bytes": ...}, ...}}

and a command writes into an existing folder only when every file there is one fp8-parity wrote and
nobody changed since (`check_folder`), unless the user passes --force. A file fp8-parity is about to
replace is listed with both checksums while it is written (`previous`), so a run killed between the
file and the manifest leaves a folder it can still prove its own.

    write_files(dir, {name: bytes})   each file atomically (parity.outputs), recorded in the manifest
    check_folder(dir, ...)            OutputError unless fp8-parity may write into `dir`
    survey(dir)                       what in `dir` fp8-parity did not write, or changed since
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from parity.outputs import LOCK_FILE, OutputError, atomic_write_bytes, atomic_write_text

MANIFEST_FILE = "fp8-parity-manifest.json"
FORMAT = "fp8-parity folder manifest 1"
ABOUT = ("the files fp8-parity wrote in this folder, with their SHA-256: fp8-parity writes into a folder only when "
         "every file in it is listed here and unchanged (or with --force)")
NAMES_SHOWN = 4


@dataclass(frozen=True)
class Entry:
    """A file fp8-parity wrote: its checksum and size; `previous` the checksum of the content it replaces
    while the write is under way (None once it is done)."""

    sha256: str
    bytes: int
    previous: str | None = None

    def matches(self, digest: str) -> bool:
        return digest in (self.sha256, self.previous)


@dataclass(frozen=True)
class Survey:
    """What a folder holds that fp8-parity may not write over: files it did not write (`unknown`), files it
    wrote that were changed since (`changed`); `manifest` whether the folder has a readable manifest."""

    unknown: list[str] = field(default_factory=list)
    changed: list[str] = field(default_factory=list)
    manifest: bool = False

    @property
    def clean(self) -> bool:
        return not self.unknown and not self.changed


def _digest(path: Path) -> str:
    sha = hashlib.sha256()
    with path.open("rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            sha.update(block)
    return sha.hexdigest()


def read_manifest(directory: Path) -> dict[str, Entry] | None:
    """The files the manifest of `directory` lists; None when it has none or it cannot be read."""
    try:
        data = json.loads((Path(directory) / MANIFEST_FILE).read_text())
        if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("files"), dict):
            return None
        return {name: Entry(**entry) for name, entry in data["files"].items()}
    except (OSError, ValueError, TypeError):
        return None


def _write_manifest(directory: Path, entries: Mapping[str, Entry]) -> None:
    files = {name: {k: v for k, v in vars(entry).items() if v is not None} for name, entry in sorted(entries.items())}
    atomic_write_text(directory / MANIFEST_FILE, json.dumps(dict(format=FORMAT, about=ABOUT, files=files), indent=1)
                      + "\n")


def write_files(directory: str | Path, files: Mapping[str, bytes]) -> list[Path]:
    """Write each of `files` (name -> content, in order) into `directory` (created) whole or not at all, and
    list it in the folder's manifest; the paths written. Checks nothing: a command calls check_folder
    before its work."""
    directory = Path(directory)
    if any(Path(name).name != name or name in (MANIFEST_FILE, LOCK_FILE) for name in files):
        raise ValueError(f"write_files writes plain file names of its own, not {sorted(files)}")
    directory.mkdir(parents=True, exist_ok=True)
    entries = read_manifest(directory) or {}
    new = {name: Entry(hashlib.sha256(data).hexdigest(), len(data), _existing_digest(directory / name))
           for name, data in files.items()}
    _write_manifest(directory, {**entries, **new})  # first: while the files change, old and new content are ours
    written = [atomic_write_bytes(directory / name, data) for name, data in files.items()]
    _write_manifest(directory, {**entries, **{name: Entry(e.sha256, e.bytes) for name, e in new.items()}})
    return written


def _existing_digest(path: Path) -> str | None:
    return _digest(path) if path.is_file() and not path.is_symlink() else None


def _ours_by_name(name: str, listed: Mapping[str, Entry]) -> bool:
    """The manifest, the folder lock, and the temporary file of an atomic write of a listed file (a run
    killed mid-write leaves `.NAME.xxxxxxxx`)."""
    if name in (MANIFEST_FILE, LOCK_FILE) or name.startswith(f".{MANIFEST_FILE}."):
        return True
    return name.startswith(".") and any(name.startswith(f".{listed_name}.") for listed_name in listed)


def survey(directory: str | Path) -> Survey:
    """What `directory` (an existing folder) holds that fp8-parity did not write, or that changed since it
    wrote it, by the folder's manifest."""
    directory = Path(directory)
    listed = read_manifest(directory)
    unknown, changed = [], []
    for entry in sorted(os.scandir(directory), key=lambda e: e.name):
        if _ours_by_name(entry.name, listed or {}):
            continue
        known = (listed or {}).get(entry.name)
        if known is None or not entry.is_file(follow_symlinks=False):
            unknown.append(entry.name + ("/" if entry.is_dir(follow_symlinks=False) else ""))
        elif not known.matches(_digest(Path(entry.path))):
            changed.append(entry.name)
    return Survey(unknown, changed, listed is not None)


def _shown(names: list[str]) -> str:
    head = ", ".join(names[:NAMES_SHOWN])
    return head + (f" and {len(names) - NAMES_SHOWN} more" if len(names) > NAMES_SHOWN else "")


def check_folder(directory: str | Path, *, option: str = "--out", force: bool | None = False,
                 protected: Mapping[str, str] | None = None, fix: str | None = None) -> None:
    """OutputError unless fp8-parity may write its files into `directory`: it does not exist, is empty, or
    holds only files fp8-parity wrote and nobody changed since, none of them one of `protected` (name ->
    what it is: an earlier run's results table, an interrupted sweep's rows) that the command would
    replace. `force` True allows anything; None: the command has no --force (the message offers none).
    `fix` replaces the message's "give a new or empty folder"."""
    directory = Path(directory)
    if force or not directory.is_dir():
        return
    how = (fix or "give a new or empty folder") + (", or --force to write into it anyway" if force is not None else "")
    found = survey(directory)
    if found.unknown:
        why = ("" if found.manifest else f" (it has no {MANIFEST_FILE}: a folder of your own, or a report written "
                                         f"before fp8-parity kept one)")
        raise OutputError(f"{option} {directory}: it holds {_shown(found.unknown)}, which fp8-parity did not "
                          f"write{why}: {how}")
    if found.changed:
        raise OutputError(f"{option} {directory}: {_shown(found.changed)} changed since fp8-parity wrote "
                          f"{'it' if len(found.changed) == 1 else 'them'}: {how}")
    for name, what in (protected or {}).items():
        if (directory / name).exists():
            raise OutputError(f"{option} {directory}: its {name} holds {what}, which this run would replace: {how}")
