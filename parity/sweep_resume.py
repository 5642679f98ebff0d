"""The resume state of an interrupted sweep: the rows of the cases done so far and the arguments
that produced them, kept in the report directory where `fp8-parity report` and `fp8-parity sweep
--resume` read them."""

from __future__ import annotations

import json
from pathlib import Path

from parity.exits import UsageError
from parity.folder_manifest import write_files
from parity.report import read_results
from parity.results_file import encoded

PARTIAL_TABLE, PARTIAL_INFO = "partial.csv.gz", "partial.json"


def sweep_arguments(args, impl_names: list[str]) -> dict:
    """What decides a sweep's cases and rows: a resumed sweep must be the same sweep."""
    return dict(preset=args.preset, impls=impl_names, samples=args.samples, seed=args.seed,
                accuracy_only=args.accuracy_only)


def save_partial(frame, out: Path, arguments: dict, reason: str) -> None:
    """The rows of the cases done so far, where `report` and `sweep --resume` read them."""
    info = json.dumps(dict(arguments=arguments, done=frame.attrs["done"], planned=frame.attrs["planned"],
                           reason=reason, env=frame.attrs.get("env", {})), indent=2, default=str)
    write_files(out, {PARTIAL_TABLE: encoded(frame), PARTIAL_INFO: info.encode()})


def _info(out: Path) -> dict:
    """partial.json of `out` as written by save_partial, or ValueError saying what it is instead."""
    try:
        info = json.loads((out / PARTIAL_INFO).read_text())
    except UnicodeDecodeError as err:
        raise ValueError(f"not text ({err.reason})") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"not valid JSON ({err.msg} at line {err.lineno})") from None
    if not isinstance(info, dict):
        raise ValueError(f"a JSON {type(info).__name__}, not the object an interrupted sweep writes")
    for key in ("done", "planned"):
        if not isinstance(info.get(key), int) or isinstance(info.get(key), bool) or info[key] < 0:
            raise ValueError(f"its {key!r} is {info.get(key)!r}, not a count of cases")
    return info


def partial_progress(out: Path) -> tuple[int, int] | None:
    """(cases done, cases planned) of the interrupted sweep in `out`, None without its partial.json;
    ValueError when that is not the one save_partial writes."""
    if not (out / PARTIAL_INFO).is_file():
        return None
    info = _info(out)
    return info["done"], info["planned"]


def load_partial(out: Path, arguments: dict):
    """The rows an interrupted sweep in `out` saved, or UsageError when there are none, they came
    from other arguments, or its files are not the ones it wrote."""
    info_path = out / PARTIAL_INFO
    if not info_path.is_file() or not (out / PARTIAL_TABLE).is_file():
        raise UsageError(f"--resume: {out} holds no interrupted sweep ({PARTIAL_TABLE} and {PARTIAL_INFO}); run "
                         f"without --resume to start one")
    try:
        info = _info(out)
    except ValueError as err:
        raise UsageError(f"--resume: {info_path} is {err}; start the sweep again (--force)") from None
    if info.get("arguments") != arguments:
        raise UsageError(f"--resume: the sweep in {out} ran with {info.get('arguments')}, this one asks for "
                         f"{arguments}: resume with the same --preset, --impl, --samples, --seed and --accuracy-only")
    try:
        frame = read_results(out / PARTIAL_TABLE)
    except (ValueError, OSError) as err:
        raise UsageError(f"--resume: cannot read {out / PARTIAL_TABLE}: {err}; start the sweep again "
                         f"(--force)") from None
    if frame.attrs["seal"] is None:
        raise UsageError(f"--resume: {out / PARTIAL_TABLE} carries no seal (row count and checksum): it is not the "
                         f"table the sweep wrote; start the sweep again (--force)")
    return frame


def discard_partial(out: Path) -> None:
    """Remove the resume state once the complete table is written."""
    for name in (PARTIAL_TABLE, PARTIAL_INFO):
        (out / name).unlink(missing_ok=True)
