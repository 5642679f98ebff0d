"""The resume state of an interrupted sweep: the rows of the cases done so far and the arguments
that produced them, kept in the report directory where `fp8-parity report` and `fp8-parity sweep
--resume` read them."""

from __future__ import annotations

import json
from pathlib import Path

from parity.exits import UsageError
from parity.outputs import atomic_write_bytes, atomic_write_text
from parity.report import read_results
from parity.results_file import encoded

PARTIAL_TABLE, PARTIAL_INFO = "partial.csv.gz", "partial.json"


def sweep_arguments(args, impl_names: list[str]) -> dict:
    """What decides a sweep's cases and rows: a resumed sweep must be the same sweep."""
    return dict(preset=args.preset, impls=impl_names, samples=args.samples, seed=args.seed,
                accuracy_only=args.accuracy_only)


def save_partial(frame, out: Path, arguments: dict, reason: str) -> None:
    """The rows of the cases done so far, where `report` and `sweep --resume` read them."""
    atomic_write_bytes(out / PARTIAL_TABLE, encoded(frame))
    atomic_write_text(out / PARTIAL_INFO, json.dumps(dict(arguments=arguments, done=frame.attrs["done"],
                                                          planned=frame.attrs["planned"], reason=reason,
                                                          env=frame.attrs.get("env", {})), indent=2, default=str))


def load_partial(out: Path, arguments: dict):
    """The rows an interrupted sweep in `out` saved, or UsageError when there are none or they came
    from other arguments."""
    info_path = out / PARTIAL_INFO
    if not info_path.is_file() or not (out / PARTIAL_TABLE).is_file():
        raise UsageError(f"--resume: {out} holds no interrupted sweep ({PARTIAL_TABLE} and {PARTIAL_INFO}); run "
                         f"without --resume to start one")
    info = json.loads(info_path.read_text())
    if info.get("arguments") != arguments:
        raise UsageError(f"--resume: the sweep in {out} ran with {info.get('arguments')}, this one asks for "
                         f"{arguments}: resume with the same --preset, --impl, --samples, --seed and --accuracy-only")
    try:
        return read_results(out / PARTIAL_TABLE)
    except (ValueError, OSError) as err:
        raise UsageError(f"--resume: cannot read {out / PARTIAL_TABLE}: {err}; start the sweep again") from None


def discard_partial(out: Path) -> None:
    """Remove the resume state once the complete table is written."""
    for name in (PARTIAL_TABLE, PARTIAL_INFO):
        (out / name).unlink(missing_ok=True)
