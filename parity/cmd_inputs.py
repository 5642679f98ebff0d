"""The checks of arguments that several commands share, each a UsageError or CannotRun with one
clear line: the device to run on, output paths that must be writable, the cases named with --case
or --case-file, and the default report directory."""

from __future__ import annotations

import datetime
import os
from pathlib import Path

from parity import hopper
from parity.cases import check_fits, parse_case_id
from parity.check import resolve_device
from parity.cpu_gemm import ENV as CPU_GEMM_ENV
from parity.data import saved_case
from parity.exits import CannotRun, UsageError
from parity.folder_manifest import check_folder
from parity.outputs import OutputError, check_writable_dir, check_writable_file


def writable_file(path: Path | None, flag: str) -> None:
    """UsageError unless `path` (given with `flag`; None: not given) can be written: a new path or a regular
    file (never a device, a pipe or a link) in a writable directory."""
    if path is not None:
        try:
            check_writable_file(path, option=flag)
        except OutputError as err:
            raise UsageError(str(err)) from None


def writable_dir(path: Path, flag: str) -> None:
    """UsageError unless `path` (given with `flag`) is, or can be made, a writable directory."""
    try:
        check_writable_dir(path, option=flag)
    except OutputError as err:
        raise UsageError(str(err)) from None


def report_folder(path: Path, flag: str, *, force: bool | None, protected: dict | None = None,
                  fix: str | None = None) -> None:
    """UsageError unless `path` (given with `flag`) can be written and fp8-parity may write its report files
    there: a new or empty folder, or one holding only files fp8-parity wrote, unchanged, and none of
    `protected` (parity.folder_manifest.check_folder); `force` (--force) allows any writable folder,
    None: the command has no --force."""
    writable_dir(path, flag)
    try:
        check_folder(path, option=flag, force=force, protected=protected, fix=fix)
    except OutputError as err:
        raise UsageError(str(err)) from None


def named_cases(ids: list[str], device: str):
    """The cases of --case CASE_ID, each checked to fit on `device`."""
    return [check_fits(parse_case_id(case_id), device) for case_id in ids]


def case_file(path: Path | None, case_ids, device: str):
    """The case of --case-file PATH (None without one); --case and --case-file exclude each other."""
    if path is None:
        return None
    if case_ids:
        raise UsageError("--case-file runs the file's tensors: leave out --case")
    return check_fits(saved_case(path), device)


def device(requested: str, cpu_gemm: str | None = None) -> str:
    """The device to run on (cuda if present for "auto"), or CannotRun with the reason; `cpu_gemm`
    (--cpu-gemm) chooses the CPU's kernel of scaled GEMM calls for this process and its workers."""
    resolved, reason = resolve_device(requested)
    if resolved is None:
        raise CannotRun(reason)
    if cpu_gemm is not None:
        if cpu_gemm == "hopper" and not hopper.available():
            raise CannotRun("--cpu-gemm hopper needs mmaemu (pip install mmaemu==0.1.0)")
        os.environ[CPU_GEMM_ENV] = cpu_gemm
    return resolved


def default_report_dir() -> Path:
    """reports/<timestamp>/, where a command writes its report without --out."""
    return Path("reports") / datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
