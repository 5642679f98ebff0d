"""The words fp8-parity's findings are made of, as enums: read by code, rendered to text only at the edge.

Each is a `str` enum whose value is the word the JSON, the tables and the docs use ("scale",
"grad_weight"), so a value compares equal to its word and prints as it.
"""

from __future__ import annotations

import enum


class Word(str, enum.Enum):
    """A str enum that prints as its value (f-strings, str(), CSV cells, JSON)."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


class BugClass(Word):
    """The bug classes bisect names (DESIGN.md's vocabulary, plus precision and unknown)."""

    TRANSPOSE = "transpose"  # an operand or result logically transposed or reinterpreted with view/reshape
    LAYOUT = "layout"  # the same logical values in other strides give another result
    SCALE = "scale"  # wrong amax region, missing abs, scale instead of inverse, low-precision scale
    FP8_DTYPE = "fp8_dtype"  # another fp8 format for an operand
    SATURATION = "saturation"  # wrong clamp bound, overflow to NaN
    ACCUMULATION = "accumulation"  # differences at accumulation level only (fast accum, out dtype rounding)
    CONTRACT = "contract"  # output or gradient dtype/shape/strides differ from nn.Linear's
    STALE_STATE = "stale_state"  # results depend on earlier calls
    CRASH = "crash"  # the implementation raises
    PRECISION = "precision"  # a GEMM in another precision than its recipe's, or an operand rounded before its cast
    UNKNOWN = "unknown"  # differs, and no hypothesis reproduces it


class Operand(Word):
    """What a finding blames: a GEMM operand, the GEMM's result, the call itself."""

    INPUT = "input"
    WEIGHT = "weight"
    GRAD_OUTPUT = "grad_output"
    RESULT = "result"
    CALL = "call"
    UNKNOWN = "unknown"
