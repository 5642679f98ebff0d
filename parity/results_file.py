"""The results file: the columns a parity sweep's table must have, and reading one back.

`read_results(path)` gives the table of a report directory or a .csv / .csv.gz / .parquet file, or a
ResultsError that says what the file is instead (truncated, empty, another table, a benchmark's, an
older schema). Rows of such a table are read as parity.rows.Row by parity.rows.rows_from_frame.
"""

from __future__ import annotations

import gzip
import json
import zlib
from pathlib import Path

import pandas as pd

from parity.rows import KEY_COLUMNS

RESULTS_FILE, ENV_FILE = "results.csv.gz", "env.json"
KEY = list(KEY_COLUMNS)
REQUIRED_COLUMNS = [*KEY, "K", "dist", "input_dtype", "weight_dtype", "input_layout", "weight_layout",
                    "grad_output_layout", "bitwise", "n_diff", "numel", "sqnr_db", "max_rel_err", "max_abs_err",
                    "max_abs_index", "nan", "inf", "error", "reference_error", "contract", "scaled_mm", "recipe",
                    "policy", "skipped", "operands"]
# Columns added after the first tables were written (recipes as data). Not upgraded with
# defaults: recipe and policy decide how every row is judged, and an empty `operands` would claim
# an operand check that never ran; such a table is refused with "re-run the sweep".
ADDED_LATER = ["recipe", "policy", "skipped", "operands"]
BENCH_COLUMNS = ["median_ms", "gpu_ms", "tflops"]  # parity.bench's timings: a benchmark's table, not a sweep's
TEXT_COLUMNS = ["case_id", "lead", "error", "reference_error", "contract", "scaled_mm", "dtype", "max_abs_index",
                "bound_index", "recipe", "reference_recipe", "policy", "skipped", "operands"]


class ResultsError(ValueError):
    """A results file that cannot be read as a parity sweep's table: the message names the file,
    what it is instead (truncated, empty, another table, a benchmark's, an older schema) and the fix."""


def _missing(columns) -> list[str]:
    return [column for column in REQUIRED_COLUMNS if column not in set(columns)]


def validated(frame: pd.DataFrame) -> pd.DataFrame:
    """The frame itself, or a ValueError that says what is wrong with it."""
    if frame.empty:
        raise ValueError("the results table is empty: there is nothing to report (did the run select no cases?)")
    missing = _missing(frame.columns)
    if missing:
        hint = (" (a table written before recipes were data: rerun the sweep that made it)"
                if set(missing) <= set(ADDED_LATER) else ": is it a table of parity.runner.run_cases?")
        raise ValueError(f"the results table lacks the columns {missing}{hint}")
    return frame


def not_a_sweep(columns) -> str | None:
    """What a table with these columns is, when it is not a parity sweep's results table."""
    missing = _missing(columns)
    if not missing:
        return None
    if "sqnr_db" in missing and any(column in set(columns) for column in BENCH_COLUMNS):
        timings = ", ".join(column for column in BENCH_COLUMNS if column in set(columns))
        return (f"is a benchmark report, not a parity sweep: it has timings ({timings}) and no sqnr_db "
                f"(give the results of `fp8-parity sweep`)")
    if set(missing) <= set(ADDED_LATER):
        return f"was written by an older fp8-parity (missing columns {', '.join(missing)}): re-run the sweep"
    shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
    return (f"is not an fp8-parity results table: it lacks columns {shown} "
            f"(give the results.csv.gz of `fp8-parity sweep` or its directory)")



def encoded(frame: pd.DataFrame) -> bytes:
    """A results table as its file holds it (results.csv.gz): CSV, gzipped without a timestamp, so the same
    rows give the same bytes (read_results reads it back)."""
    return gzip.compress(frame.to_csv(index=False).encode(), mtime=0)


def read_results(path: str | Path) -> pd.DataFrame:
    """The results table from a report directory, or a .csv / .csv.gz / .parquet file (parquet
    needs pyarrow), with attrs["env"] from the env.json beside it. Text stays text (case ids,
    leading dims like "16"), empty contract/scaled_mm cells are "", index tuples stay strings.

    FileNotFoundError when there is no such file; ResultsError (a ValueError) when it is
    truncated or corrupt, holds no rows, is another table, a benchmark's, or lacks the columns
    added since it was written."""
    path = Path(path)
    if path.is_dir():
        path = path / RESULTS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no results file at {path}: give a report directory or a .csv/.csv.gz/.parquet file")
    try:
        if path.suffix == ".parquet":
            frame = pd.read_parquet(path)
        else:  # round_trip parsing reads back exactly the floats that to_csv wrote
            frame = pd.read_csv(path, dtype={c: "str" for c in TEXT_COLUMNS}, float_precision="round_trip")
    except pd.errors.EmptyDataError:
        raise ResultsError(f"{path} holds no results (the file is empty): re-run the sweep") from None
    except (EOFError, zlib.error, gzip.BadGzipFile, UnicodeDecodeError, pd.errors.ParserError) as err:
        raise ResultsError(f"{path} is truncated or corrupt ({err}): re-run the sweep") from None
    problem = not_a_sweep(frame.columns)
    if problem:
        raise ResultsError(f"{path} {problem}")
    if frame.empty:
        raise ResultsError(f"{path} holds no results (a header without rows): re-run the sweep")
    text = {c: frame[c].fillna("") for c in ("contract", "scaled_mm") if c in frame}
    flags = {c: frame[c].astype(bool) for c in ("bitwise", "bias") if c in frame}
    frame = frame.assign(**text, **flags)
    env_file = path.parent / ENV_FILE
    if env_file.is_file():
        frame.attrs["env"] = json.loads(env_file.read_text())
    return frame

