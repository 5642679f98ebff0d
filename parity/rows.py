"""The result row: one case x implementation x reference x tensor x step, as one type.

parity.runner makes Rows; parity.policy judges them; check, bisect, the property suite, sweep and
report read them. A DataFrame (the results table, results.csv.gz) is built from Rows in one place,
`frame`, and Rows are read back from a frame in one place, `rows_from_frame`. The row's key is
`Row.key` (KEY_COLUMNS), defined once here.

A Row's fields are the table's columns, with the same names and values. Its structured parts are
typed in memory and rendered into the table's text columns when the frame is built:

    error, reference_error   Raised (the implementation's exception) or parity.worker.Died (its
                             worker did not come back); text in the table
    contract                 parity.contract.ContractProblem each ("; "-joined in the table)
    scaled_mm                parity.contract.CallProblem each: a call that would fail on an H100
    operands                 parity.diagnose.StageFinding each: what a recorded GEMM call was
                             handed that its recipe's oracle does not hand it
    operand_stages           the Stage of each of those (","-joined, sorted)

Read back from a table, those columns hold the table's text: an error is a RecordedError, a
contract or scaled_mm problem its text; nothing decides on that text but the one fact a results
file keeps only in it: whether an error was a worker's death (see RecordedError).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, fields, replace
from typing import Any, Iterable, Mapping

import pandas as pd

from parity.exits import one_line
from parity.vocabulary import DIED_PREFIX, Phase, Stage

KEY_COLUMNS = ("case_id", "impl", "reference", "tensor", "step")  # what identifies a row


def row_key(case_id: str, impl: str, reference: str, tensor: str, step: int) -> tuple:
    """The key of the row of this case, implementation, reference, tensor and step (Row.key)."""
    return case_id, impl, reference, tensor, int(step)


# ---- what an implementation raised ----------------------------------------------------------------------

@dataclass(frozen=True)
class Raised:
    """An exception the implementation raised, where it was, and the implementation's own line."""

    phase: Phase
    step: int | None  # the call (None: while building the module)
    type: str  # the exception's type name
    message: str  # its first line, at most MESSAGE_CHARS characters
    at: str = ""  # "file:line": the deepest frame of the implementation's own code ("" when none)

    def __post_init__(self):
        # an exception can carry megabytes in one line (a tensor's repr, a log): every report of it (the
        # terminal, --json, the results table) keeps a bounded line that says how long it was
        object.__setattr__(self, "message", one_line(self.message))

    @property
    def where(self) -> str:
        return self.phase.at(self.step)

    def __str__(self) -> str:
        """"<where>: <Type>: <first line> (at file:line)", as the results table's error column holds it."""
        return f"{self.where}: {self._what()}"

    def _what(self) -> str:
        return f"{self.type}: {self.message}" + (f" (at {self.at})" if self.at else "")

    @property
    def after_where(self) -> str:
        """The text after the first ': ' of str(self): the phase within the step and the exception
        (what a worker that gives up its CUDA context says)."""
        return self._what() if self.step is None else f"{self.phase.value}: {self._what()}"

    @property
    def crash_message(self) -> str:
        return f"the implementation raised: {self}"


@dataclass(frozen=True)
class RecordedError:
    """An error read back from a results table: its text, and whether it is a worker's death (the
    table keeps that only in how the text begins: parity.worker.Died's sentences begin with
    vocabulary.DIED_PREFIX, Raised's with a phase)."""

    text: str

    @property
    def died(self) -> bool:
        return self.text.startswith(DIED_PREFIX)

    def __str__(self) -> str:
        return self.text

    @property
    def crash_message(self) -> str:
        return self.text if self.died else f"the implementation raised: {self.text}"


# ---- the row -------------------------------------------------------------------------------------------

NAN = math.nan


@dataclass(kw_only=True, slots=True)
class Row:
    """One row of the results table (see the module docstring for the typed columns)."""

    case_id: str
    # the case (parity.cases.Case.as_record)
    lead: str
    K: int
    N: int
    input_dtype: str
    weight_dtype: str
    bias: bool
    input_layout: str
    weight_layout: str
    grad_output_layout: str
    dist: str
    seed: int
    steps: int
    path: str | None = None  # a saved case's file (parity.cases.SavedCase)
    ndim: int
    M: int
    # what is compared with what, and how it is judged
    impl: str
    reference: str
    recipe: str
    reference_recipe: str
    policy: str  # parity.policy.Policy's value
    device: str
    tensor: str
    step: int
    # parity.metrics.METRICS (NaN where not measured)
    bitwise: bool = False
    n_diff: Any = NAN
    sqnr_db: Any = NAN
    rel_l2: Any = NAN
    max_abs_err: Any = NAN
    max_abs_index: Any = NAN
    worst_candidate: Any = NAN
    worst_reference: Any = NAN
    max_rel_err: Any = NAN
    n_mismatch: Any = NAN
    rtol: Any = NAN
    atol: Any = NAN
    ulp_max: Any = NAN
    ulp_p99: Any = NAN
    cosine: Any = NAN
    nan: Any = NAN
    inf: Any = NAN
    ref_nan: Any = NAN
    ref_inf: Any = NAN
    unexpected_inf: Any = NAN
    numel: Any = NAN
    n_eff: Any = NAN
    n_diff_where_reference_zero: Any = NAN
    # findings about the implementation
    error: Any = None  # Raised | parity.worker.Died | RecordedError | None
    reference_error: Any = None
    contract: tuple = ()
    skipped: str | None = None  # why the comparison was not run
    scaled_mm: tuple = ()
    operands: tuple = ()
    operand_stages: frozenset = frozenset()
    # parity.oracles.accumulation_excess
    bound_ratio: Any = NAN
    n_beyond_bound: Any = NAN
    bound_index: Any = None
    dtype: str | None = None  # the candidate's dtype of this tensor
    # policy "exact" (parity.hopper_oracle): True where the calibration vouches for the call and the row is
    # judged bit for bit against the Hopper model, False where it does not (exact_why says why)
    exact: Any = None
    exact_why: str | None = None
    # the sweep's: the named shape or "sampled" / "edge case"; the device of a sharded sweep
    shape: str | None = None
    gpu: str | None = None

    @property
    def key(self) -> tuple:
        return row_key(self.case_id, self.impl, self.reference, self.tensor, self.step)

    def record(self) -> dict:
        """The row as the table holds it: column -> value (typed parts rendered as text)."""
        return {name: _cell(name, getattr(self, name)) for name in COLUMNS}

    def but(self, **changes) -> "Row":
        return replace(self, **changes)

    def update(self, values: Mapping) -> None:
        """Set the fields named in `values` (parity.metrics.compare's, say): a name that is no column raises."""
        for name, value in values.items():
            setattr(self, name, value)


COLUMNS = tuple(f.name for f in fields(Row))
# in a table only where some row has them: a saved case's file; a sweep's label; a sharded sweep's device;
# the exact policy's judgement
OPTIONAL_COLUMNS = ("path", "shape", "gpu", "exact", "exact_why")
_JOINED = {"contract", "scaled_mm", "operands"}  # "; "-joined problems and findings


def _cell(name: str, value):
    """The table's value of a row's field."""
    if name in _JOINED:
        return "; ".join(map(str, value))
    if name == "operand_stages":
        return ",".join(sorted(stage.value if isinstance(stage, enum.Enum) else stage for stage in value))
    if name in ("error", "reference_error"):
        return None if value is None else str(value)
    if isinstance(value, enum.Enum):
        return value.value
    return value


def frame(rows: Iterable[Row]) -> pd.DataFrame:
    """The results table of `rows` (the one place a table is built from rows)."""
    rows = list(rows)
    columns = [c for c in COLUMNS if c not in OPTIONAL_COLUMNS or any(getattr(r, c) is not None for r in rows)]
    if not rows:
        return pd.DataFrame(columns=columns)
    return pd.DataFrame.from_records([tuple(_cell(c, getattr(row, c)) for c in columns) for row in rows],
                                     columns=columns)


# Columns a table may lack (written before they existed): the value that reads as "not measured".
_MISSING = {"n_eff": math.inf, "unexpected_inf": 0, "n_diff_where_reference_zero": 0, "reference_recipe": None,
            "operand_stages": "", "operands": "", "skipped": None, "recipe": "", "policy": ""}


def _text(value) -> str:
    """A text cell: '' for None or NaN (a re-read CSV's empty cell)."""
    return value if isinstance(value, str) else ""


def _read(record: Mapping) -> Row:
    values = {name: record.get(name, _MISSING.get(name)) for name in COLUMNS if name in record or name in _MISSING}
    for name in ("error", "reference_error"):
        text = _text(values.get(name))
        values[name] = RecordedError(text) if text else None
    for name in _JOINED:
        text = _text(values.get(name))
        values[name] = (text,) if text else ()
    stages = _text(values.get("operand_stages"))  # a list of stage names
    values["operand_stages"] = frozenset(Stage(s) for s in stages.split(",")) if stages else frozenset()
    values["skipped"] = _text(values.get("skipped")) or None
    if "exact" in values and not isinstance(values["exact"], bool):  # a re-read table's empty cell
        values["exact"] = None
    for name in ("recipe", "policy", "path", "shape", "gpu", "dtype", "reference_recipe", "exact_why"):
        if name in values and not isinstance(values[name], str):
            values[name] = "" if name in ("recipe", "policy") else None
    return Row(**values)


def rows_from_frame(table: pd.DataFrame | Iterable[Mapping]) -> list[Row]:
    """The rows of a results table (the one place rows are read back from a table); records
    (column -> value mappings) are read the same way."""
    records = table.to_dict("records") if isinstance(table, pd.DataFrame) else list(table)
    return [_read(record) for record in records]


def as_rows(rows: pd.DataFrame | Iterable[Row | Mapping]) -> list[Row]:
    """Rows, from rows or from a table (or its records)."""
    if isinstance(rows, pd.DataFrame):
        return rows_from_frame(rows)
    rows = list(rows)
    return [row if isinstance(row, Row) else _read(row) for row in rows]
