"""What a run covered: the largest shapes, the dtypes, layouts, distributions and calls of the cases an
implementation actually ran, said in the verdict of a pass.

Why: a pass says only that every case that ran agreed. A layer wrong only when M > 512, or K > 256,
passed `check` (whose search draws M, K, N up to 256 by default) with no word that no case that
large ran (issue 29, item 9). So a pass states its coverage:

    PASS: ... 48 cases in 46.4 s. Covered: M <= 256, K <= 256, N <= 256, input bf16/fp16/fp32,
    weight bf16/fp32, layouts C/P/S/T, 2-D and 3-D input, with and without bias, up to 2 calls,
    12 of 13 data distributions.

and a reader sees at once what was not tried (larger layers: `check --max-dim`, or `sweep --preset
cpu-layers`; docs/commands/sweep.md).

    Coverage.of(rows, impl)     of Rows or a results table, the cases `impl` ran (None: none ran)
    covered(rows, impl)         ". Covered: ..." for a verdict line ("" when no case ran)
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence

import pandas as pd

from parity.cases import DRAWN_DISTS, Dist
from parity.rows import Row
from parity.rows import frame as rows_frame

LAYOUT_COLUMNS = ("input_layout", "weight_layout", "grad_output_layout")


@dataclass(frozen=True)
class Coverage:
    """The cases an implementation ran (not skipped): how many, the largest M, K and N, the dtypes, the
    layouts of any operand, the input ranks, bias, the most calls of a case and the data distributions."""

    cases: int
    max_M: int
    max_K: int
    max_N: int
    input_dtypes: tuple[str, ...]
    weight_dtypes: tuple[str, ...]
    layouts: tuple[str, ...]
    ranks: tuple[int, ...]  # dims of the input: 2 (M, K) and 3 or 4 (batch dims before the tokens)
    bias: tuple[bool, ...]
    max_steps: int
    distributions: tuple[str, ...]

    @classmethod
    def of(cls, rows: Sequence[Row] | pd.DataFrame, impl: str) -> "Coverage | None":
        """The coverage of the cases `impl` ran among `rows` (Rows or a results table); None when it ran none."""
        table = rows if isinstance(rows, pd.DataFrame) else rows_frame(list(rows))
        if table.empty:
            return None
        ran = table[(table["impl"] == impl) & ~_skipped(table)].drop_duplicates("case_id")
        if ran.empty:
            return None
        M = ran["M"] if "M" in ran else ran["case_id"].map(_tokens)
        return cls(cases=len(ran), max_M=int(M.max()), max_K=int(ran["K"].max()), max_N=int(ran["N"].max()),
                   input_dtypes=_sorted(ran["input_dtype"]), weight_dtypes=_sorted(ran["weight_dtype"]),
                   layouts=_sorted(pd.concat([ran[c] for c in LAYOUT_COLUMNS if c in ran])),
                   ranks=tuple(sorted({int(n) for n in ran["ndim"]})) if "ndim" in ran else (),
                   bias=tuple(sorted({bool(b) for b in ran["bias"]})),
                   max_steps=int(ran["steps"].max()) if "steps" in ran else 1,
                   distributions=_sorted(ran["dist"].map(lambda d: re.sub(r"\d+$", "", str(d)))))

    def __str__(self) -> str:
        ranks = "/".join(f"{rank}-D" for rank in self.ranks)
        bias = {(False,): "without bias", (True,): "with bias"}.get(self.bias, "with and without bias")
        parts = [f"M <= {self.max_M}", f"K <= {self.max_K}", f"N <= {self.max_N}",
                 f"input {'/'.join(self.input_dtypes)}", f"weight {'/'.join(self.weight_dtypes)}",
                 f"layouts {'/'.join(self.layouts)}", *([f"{ranks} input"] if ranks else []), bias,
                 f"up to {self.max_steps} call{'s' if self.max_steps > 1 else ''}",
                 f"{len(self.distributions)} of {self.distributions_to_draw} data distributions"]
        return ", ".join(parts)

    @property
    def distributions_to_draw(self) -> int:
        """The distributions a search draws (cases.DRAWN_DISTS), and the NaN edge case where it ran (the
        microscaled recipes' only): a tensorwise check never runs it, and is not one short for that."""
        return len(DRAWN_DISTS) + (Dist.NAN.value in self.distributions)


def covered(rows: Sequence[Row] | pd.DataFrame, impl: str) -> str:
    """". Covered: M <= 256, K <= 256, ..." of the cases `impl` ran, to end a verdict line; "" when it ran none."""
    coverage = Coverage.of(rows, impl)
    return "" if coverage is None else f". Covered: {coverage}"


def _skipped(table: pd.DataFrame) -> pd.Series:
    if "skipped" not in table:
        return pd.Series(False, index=table.index)
    return table["skipped"].fillna("").astype(str).ne("")


def _sorted(values: pd.Series) -> tuple[str, ...]:
    return tuple(sorted({str(v) for v in values.dropna()}))


def _tokens(case_id: str) -> int:
    """M of a case id (the product of its leading dims), for a table without an M column."""
    lead = re.match(r"M([\dx]+)K", case_id)
    product = 1
    for dim in (lead.group(1).split("x") if lead else ["0"]):
        product *= int(dim)
    return product
