"""The exact oracle on Hopper: a recipe's three GEMMs computed as the H200 computes them (`hopper:<recipe>`).

The float64 emulation (`emulated:<recipe>`, parity.oracles) computes each GEMM exactly and rounds it
once; a real FP8 GEMM accumulates on tensor cores and differs from that by up to the accumulation
bound, so against the emulation a GPU result can only be judged within the bound. This built-in
quantizes each operand as the recipe says (parity.oracles.quantize: the same fp8 bytes and scales
as the emulation) and then runs each call through parity.hopper's model of the H200, with the
recipe's epilogue around it:

    TensorWise GEMM                  one TensorWise call, out dtype the recipe's
    RowWise GEMM with fast accum     one RowWise call (a tensorwise partner's scale broadcast), bf16
                                     where the recipe writes bf16 first (Recipe.scaled_out_bf16)
    RowWise GEMM without             torchao's: a TensorWise call with unit scales writing bf16,
                                     then times scale_a * scale_b (Recipe.unit_scales_without_fast_accum)
    BlockWise GEMM                   one BlockWise call (128x128 or 1x128 B scales), bf16
    high-precision GEMM              float64, rounded once: not an FP8 call, never judged bitwise

then the result's remaining roundings (parity.oracles.result_dtypes) and nn.Linear's bias, added in
the output dtype. So on a calibrated GPU a correct implementation's every FP8 GEMM equals this
reference bit for bit; `call_config` says which calibrated configuration stands for each GEMM of a
case, and the runner asks parity.calibration whether the table vouches for it (policy "exact").
"""

from __future__ import annotations

import dataclasses

import torch

from parity import calibration, cpu_gemm, hopper, oracles
from parity.calibration import Config
from parity.hopper import CallKind
from parity.recipes import GEMMS, Recipe, Scaling

HOPPER = "hopper"  # the family of built-ins: hopper:<recipe>
OUT_NAMES = {torch.bfloat16: "bfloat16", torch.float32: "float32", torch.float16: "float16"}


def _fp8(operand: oracles.Quantized) -> torch.Tensor:
    return operand.values.to(operand.fp8_dtype)  # the values lie on the fp8 grid: exact


def _unit_scales(recipe: Recipe, spec) -> bool:
    return spec.kind == "RowWise" and not spec.fast_accum and recipe.unit_scales_without_fast_accum


def _modelled(kind: CallKind, a_fp8: torch.Tensor, b_rows: torch.Tensor, scale_a: torch.Tensor,
              scale_b: torch.Tensor, *, out_dtype: torch.dtype, fast_accum: bool) -> torch.Tensor:
    """One TensorWise or RowWise call as the H200 computes it (parity.hopper)."""
    call = hopper.tensorwise if kind is CallKind.TENSORWISE else hopper.rowwise
    return call(a_fp8, b_rows, scale_a, scale_b, out_dtype=out_dtype, fast_accum=fast_accum).value


def _call(recipe: Recipe, spec, a: oracles.Quantized, b: oracles.Quantized, out_dtype: torch.dtype,
          scaled_mm=_modelled) -> torch.Tensor:
    """The recipe's GEMM `spec` of quantized A [R, I] and B [C, I], written in `out_dtype` as the GPU writes it;
    its TensorWise and RowWise calls made by `scaled_mm` (the Hopper model; parity.exact_reproduction hands
    the CPU's kernel), BlockWise ones by the model."""
    a_fp8, b_fp8 = _fp8(a), _fp8(b)
    if spec.kind == "TensorWise":
        return scaled_mm(CallKind.TENSORWISE, a_fp8, b_fp8, a.inv_scale.float().reshape(()),
                         b.inv_scale.float().reshape(()), out_dtype=out_dtype, fast_accum=spec.fast_accum)
    if spec.kind == "RowWise":
        rows = a.inv_scale.float().expand(a_fp8.shape[0], 1)
        columns = b.inv_scale.float().reshape(-1, 1).expand(b_fp8.shape[0], 1).reshape(1, -1)
        if _unit_scales(recipe, spec):  # torchao: the tensorwise kernel, then the (power-of-two) scales
            one = torch.ones((), device=a_fp8.device)
            unscaled = scaled_mm(CallKind.TENSORWISE, a_fp8, b_fp8, one, one, out_dtype=out_dtype, fast_accum=False)
            return (unscaled.float() * (rows.to(unscaled.device) * columns.to(unscaled.device))).to(out_dtype)
        return scaled_mm(CallKind.ROWWISE, a_fp8, b_fp8, rows, columns, out_dtype=out_dtype,
                         fast_accum=spec.fast_accum)
    b_tiles = "128x128" if spec.b.scaling is Scaling.BLOCK_128X128 else "1x128"
    return hopper.blockwise(a_fp8, b_fp8, a.inv_scale.float(), b.inv_scale.float(), out_dtype=out_dtype,
                            b_tiles=b_tiles, fast_accum=spec.fast_accum).value


def call_result(recipe: Recipe, name: str, a: oracles.Quantized, b: oracles.Quantized, out_dtype: torch.dtype, *,
                scaled_mm=_modelled) -> torch.Tensor:
    """GEMM `name` of the quantized operands as the recipe's call (and its unit-scale epilogue) writes it in
    `out_dtype`, before the result's further roundings and the bias (the Hopper model unless `scaled_mm`)."""
    return _call(recipe, recipe.gemm(name), a, b, out_dtype, scaled_mm)


def gemm(recipe: Recipe, name: str, a_hp: torch.Tensor, b_hp_t: torch.Tensor, out_dtype: torch.dtype):
    """GEMM `name` of high-precision A [R, I] and B.T [C, I] as the recipe runs it on Hopper, in `out_dtype`."""
    spec = recipe.gemm(name)
    chain = oracles.result_dtypes(recipe, name, out_dtype)
    if spec.high_precision:
        value = a_hp.double() @ b_hp_t.double().t()
    else:
        rounding = oracles.scale_rounding(recipe)
        value = _call(recipe, spec, oracles.quantize(a_hp, spec.a, **rounding),
                      oracles.quantize(b_hp_t, spec.b, **rounding), chain[0])
    for dtype in chain:
        value = value.to(dtype)
    return value


def hopper_matmul(recipe: Recipe):
    """The `hopper:<recipe>` built-in: the recipe on the H200, bit for bit, as a function implementation."""
    def matmul(input_2d: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return oracles.RecipeMatmul.apply(input_2d, weight, recipe, gemm)
    matmul.__name__ = f"hopper_{recipe.name}"
    return matmul


def call_config(recipe: Recipe, tensor: str, rows: int, inner: int, cols: int, out_dtype: torch.dtype) -> Config | None:
    """The calibrated configuration that stands for GEMM `tensor` of a case ([rows, inner] x [inner, cols], the
    case's output dtype), or None where the tensor is no FP8 GEMM call (grad_bias, a high-precision GEMM)."""
    if tensor not in ("output", "grad_input", "grad_weight"):
        return None
    spec = recipe.gemm(tensor)
    if spec.high_precision:
        return None
    out = OUT_NAMES.get(oracles.result_dtypes(recipe, tensor, out_dtype)[0], str(out_dtype))
    if spec.kind == "BlockWise":
        tiles = "128x128" if spec.b.scaling is Scaling.BLOCK_128X128 else "1x128"
        return Config(CallKind.BLOCKWISE, spec.a.fp8, spec.b.fp8, out, spec.fast_accum, rows, inner, cols, tiles)
    if spec.kind == "RowWise" and not _unit_scales(recipe, spec):
        return Config(CallKind.ROWWISE, spec.a.fp8, spec.b.fp8, out, spec.fast_accum, rows, inner, cols)
    return Config(CallKind.TENSORWISE, spec.a.fp8, spec.b.fp8, out, spec.fast_accum and spec.kind == "TensorWise",
                  rows, inner, cols)


def call_exactness(recipe: Recipe, tensor: str, rows: int, inner: int, cols: int, call_out: torch.dtype,
                   device: torch.device) -> calibration.Exactness:
    """Whether the calibration of the GPU `device` vouches for GEMM `tensor` of the recipe made as a call that
    writes `call_out` (the implementation's call may write another dtype than the recipe's first rounding)."""
    config = call_config(recipe, tensor, rows, inner, cols, call_out)
    if config is None or call_out not in OUT_NAMES:
        return calibration.Exactness(False, f"{tensor} is no FP8 call the model computes in {call_out}")
    config = dataclasses.replace(config, out=OUT_NAMES[call_out])
    return calibration.exactness(config, calibration.table_for(torch.cuda.get_device_name(device)))


def gemm_dims(tensor: str, M: int, K: int, N: int) -> tuple[int, int, int]:
    """(rows, inner, cols) of a linear layer's GEMM `tensor` for input [M, K] and weight [N, K]."""
    return {"output": (M, K, N), "grad_input": (M, N, K), "grad_weight": (N, M, K)}[tensor]


def exactness_of(recipe: Recipe, tensor: str, M: int, K: int, N: int, out_dtype: torch.dtype,
                 device: torch.device) -> calibration.Exactness:
    """Whether GEMM `tensor` of a case is judged bit for bit against hopper:<recipe> on `device`, and why."""
    config = call_config(recipe, tensor, *gemm_dims(tensor, M, K, N), out_dtype) if tensor in GEMMS else None
    if config is None:
        what = "grad_bias is a sum" if tensor == "grad_bias" else f"{tensor} is a high-precision GEMM"
        return calibration.Exactness(False, f"{what}, not an FP8 call")
    if device.type == "cuda":
        return calibration.exactness(config, calibration.table_for(torch.cuda.get_device_name(device)))
    if cpu_gemm.mode() == "hopper" and config.kind is CallKind.BLOCKWISE:
        return calibration.Exactness(False, "a CPU has no block-scaled _scaled_mm: implementations emulate those "
                                            "GEMMs themselves, out of the model's sight")
    if cpu_gemm.mode() == "hopper":  # every call of this run went through the model of the H200
        return calibration.exactness(config, calibration.table_for(MODELLED_GPU))
    return calibration.Exactness(False, "the CPU does not compute Hopper's bits (--cpu-gemm hopper does)")


MODELLED_GPU = "NVIDIA H200"  # the GPU whose calibration speaks for --cpu-gemm hopper
