"""The results file: the columns a parity sweep's table must have, and reading one back.

`read_results(path)` gives the table of a report directory or a .csv / .csv.gz / .parquet file, or a
ResultsError that says what the file is instead (truncated, empty, another table, a benchmark's, an
older schema). Rows of such a table are read as parity.rows.Row by parity.rows.rows_from_frame.
"""

from __future__ import annotations

import gzip
import io
import json
from pathlib import Path

import pandas as pd

from parity.exits import one_line
from parity.rows import KEY_COLUMNS
from parity.table_seal import GZIP_MAGIC, Seal, SealError, SealMismatch, Unsealed, seal, unseal

RESULTS_FILE, ENV_FILE = "results.csv.gz", "env.json"
# What a command that writes a report must not replace in its folder unless told (--force): an earlier run's
# results (parity.folder_manifest.check_folder's `protected`)
EARLIER_REPORT = {RESULTS_FILE: "the results of an earlier run"}
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
    rows give the same bytes, and sealed with its row count and checksum (parity.table_seal), so a table cut
    short or changed is told from the one written (read_results checks the seal). A table read from a file
    without a seal (attrs["seal"] None: `report --unverified`) is written without one: a copy of it must not
    vouch for rows nobody can tell are whole."""
    csv = frame.to_csv(index=False).encode()
    if "seal" in frame.attrs and frame.attrs["seal"] is None:
        return gzip.compress(csv, mtime=0)
    return seal(csv, len(frame))


def read_results(path: str | Path) -> pd.DataFrame:
    """The results table from a report directory, or a .csv / .csv.gz / .parquet file (parquet
    needs pyarrow), with attrs["env"] from the env.json beside it and attrs["seal"] the seal it
    carries (parity.table_seal; None: the file cannot tell whether it is complete). Text stays text
    (case ids, leading dims like "16"), empty contract/scaled_mm cells are "", index tuples stay
    strings.

    FileNotFoundError when there is no such file; ResultsError (a ValueError) when it is
    truncated or corrupt, fails its seal, holds no rows, is another table, a benchmark's, lacks
    the columns added since it was written, holds text where a number belongs, or its env.json is
    not a JSON object."""
    path = Path(path)
    if path.is_dir():
        path = path / RESULTS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no results file at {path}: give a report directory or a .csv/.csv.gz/.parquet file")
    frame, found = _parsed(path)
    problem = not_a_sweep(frame.columns)
    if problem:
        raise ResultsError(f"{path} {problem}")
    if frame.empty:
        raise ResultsError(f"{path} holds no results (a header without rows): re-run the sweep")
    if found is not None and found.rows != len(frame):
        raise ResultsError(f"{path} holds {len(frame)} rows where its seal says {found.rows}: re-run the sweep")
    _check_types(frame, path)
    text = {c: frame[c].fillna("") for c in ("contract", "scaled_mm") if c in frame}
    flags = {c: frame[c].astype(bool) for c in ("bitwise", "bias") if c in frame}
    frame = frame.assign(**text, **flags)
    frame.attrs["env"] = _env_beside(path)
    frame.attrs["seal"] = found
    return frame


def _parsed(path: Path) -> tuple[pd.DataFrame, Seal | None]:
    """The table in the file and its seal, or ResultsError saying why it cannot be read."""
    try:
        if path.suffix == ".parquet":
            return pd.read_parquet(path), None
        data = path.read_bytes()
        if not data:
            raise pd.errors.EmptyDataError
        unsealed = unseal(data) if path.suffix == ".gz" or data.startswith(GZIP_MAGIC) else Unsealed(data, None)
        # round_trip parsing reads back exactly the floats that to_csv wrote
        frame = pd.read_csv(io.BytesIO(unsealed.csv), dtype={c: "str" for c in TEXT_COLUMNS},
                            float_precision="round_trip")
        return frame, unsealed.seal
    except pd.errors.EmptyDataError:
        raise ResultsError(f"{path} holds no results (the file is empty): re-run the sweep") from None
    except SealMismatch as err:
        raise ResultsError(f"{path} is not the table fp8-parity wrote: {err}: re-run the sweep") from None
    except (SealError, UnicodeDecodeError, pd.errors.ParserError) as err:
        raise ResultsError(f"{path} is truncated or corrupt ({one_line(err, 200)}): re-run the sweep") from None


# Columns every reader computes with: a cell of text there (a table edited by hand, two tables
# concatenated so that the second's header is a row) must be refused here, not crash a verdict.
NUMBER_COLUMNS = ("K", "N", "M", "seed", "steps", "ndim", "step", "n_diff", "numel", "sqnr_db", "rel_l2",
                  "max_abs_err", "max_rel_err", "n_mismatch", "ulp_max", "ulp_p99", "cosine", "nan", "inf",
                  "ref_nan", "ref_inf", "unexpected_inf", "n_eff", "n_diff_where_reference_zero", "bound_ratio",
                  "n_beyond_bound", "rtol", "atol", "worst_candidate", "worst_reference")
FLAG_COLUMNS = ("bitwise", "bias")
_FLAG_TEXT = {"True", "False", "true", "false", "1", "0", "1.0", "0.0"}


def _check_types(frame: pd.DataFrame, path: Path) -> None:
    """ResultsError naming the first cell of text in a number or flag column (its column, file line and value)."""
    for column in (c for c in (*NUMBER_COLUMNS, *FLAG_COLUMNS) if c in frame):
        values = frame[column]
        if pd.api.types.is_numeric_dtype(values) or pd.api.types.is_bool_dtype(values):
            continue
        given = values.notna()
        if column in FLAG_COLUMNS:
            bad = given & ~values.map(lambda v: isinstance(v, bool) or str(v) in _FLAG_TEXT)
        else:
            bad = given & pd.to_numeric(values, errors="coerce").isna()
        if bad.any():
            at = int(bad.to_numpy().argmax())
            kind = "True or False" if column in FLAG_COLUMNS else "a number"
            raise ResultsError(f"{path}: column {column!r} holds {one_line(repr(values.iloc[at]), 80)} on line "
                               f"{at + 2} of the table, where {kind} belongs (edited, or tables joined?): re-run "
                               f"the sweep")
        if column not in FLAG_COLUMNS:
            frame[column] = pd.to_numeric(values)


def _env_beside(path: Path) -> dict:
    """The env.json beside a results file ({} when there is none), or ResultsError when it is not a JSON object."""
    env_file = path.parent / ENV_FILE
    if not env_file.is_file():
        return {}
    try:
        env = json.loads(env_file.read_text())
    except (ValueError, UnicodeDecodeError) as err:
        raise ResultsError(f"{env_file} is not valid JSON ({one_line(err, 120)}): re-run the sweep, or move it away "
                           f"to read the table without it") from None
    if not isinstance(env, dict):
        raise ResultsError(f"{env_file} holds a JSON {type(env).__name__}, not the object fp8-parity writes (versions, "
                           f"device, commit): re-run the sweep, or move it away to read the table without it")
    return env
