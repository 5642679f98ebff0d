"""fp8_impl: a minimal FP8 training module (tensorwise dynamic scaling, torch._scaled_mm).

matmul.py teaches the math (how FP8 training works, why each GEMM operand has its layout);
linear.py is the module API, with torchao-compatible signatures.
"""

from fp8_impl.linear import (
    Float8Linear,
    Float8LinearConfig,
    Float8LinearRecipeName,
    convert_to_float8_training,
)
from fp8_impl.matmul import E4M3, E5M2, EPS, FP8_MAX, float8_matmul, to_float8

__all__ = [
    "E4M3", "E5M2", "EPS", "FP8_MAX",
    "Float8Linear", "Float8LinearConfig", "Float8LinearRecipeName",
    "convert_to_float8_training", "float8_matmul", "to_float8",
]
