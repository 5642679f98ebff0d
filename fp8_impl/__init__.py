"""fp8_impl: a minimal FP8 training module (dynamic scaling, torch._scaled_mm).

matmul.py teaches the math (how FP8 training works, what each recipe does and why, why each GEMM operand
has its layout); config.py describes the recipes (tensorwise, rowwise, rowwise_with_gw_hp, blockwise,
mxfp8, mxfp8_floor); linear.py is the module API, with torchao-compatible signatures.
"""

from fp8_impl.config import CastConfig, Float8LinearConfig, Float8LinearRecipeName, GemmConfig, Scaling
from fp8_impl.linear import Float8Linear, convert_to_float8_training
from fp8_impl.matmul import E4M3, E5M2, EPS, FP8_MAX, float8_matmul, quantize, to_float8

__all__ = ["E4M3", "E5M2", "EPS", "FP8_MAX", "CastConfig", "GemmConfig", "Scaling", "Float8Linear",
           "Float8LinearConfig", "Float8LinearRecipeName", "convert_to_float8_training", "float8_matmul", "quantize",
           "to_float8"]
