"""A GEMM's bits computed again, and how many of them a mistake of the result stage reproduces.

bisect's result stage (parity.case_findings) explains a GEMM whose recorded calls are the recipe's
but whose result is not by the mistakes of parity.result_mistakes: the result rescaled, transposed,
rounded through another dtype, the bias added twice. Applied to the float64 emulation a mistake can
only come near the result (parity.diagnose.MATCH_DB), since the real GEMM summed in another order;
two mistakes may both come that near, and then the order of the space decides. Where the kernel that
computed the call is known bit for bit, each mistake is applied to that kernel's result instead and
compared with the implementation's bit for bit: a mistake that reproduces every element is what the
code did, and it wins outright.

The GEMM's bits are known exactly (gemm_bits) where the kernel that computed its call is:

    a CPU, the default kernel   parity.cpu_gemm's fast kernel computed every TensorWise and RowWise call
                                of the run: the same kernel on the oracle's operands gives the same bits
                                (the call's operands are the oracle's, or the result stage would not
                                run), whatever strides the call had (the kernel multiplies in one layout)
    a CPU, --cpu-gemm hopper    parity.hopper's model computed every call: the model again
    a GPU                       the same model (parity.hopper_oracle), where the calibration table
                                vouches for the call's configuration (parity.calibration)

and nowhere else: under torch's own CPU kernel (FP8_PARITY_CPU_SCALED_MM=torch its sums follow the
operands' strides, which the oracle does not have), for block-scaled GEMMs on a CPU (no _scaled_mm
computes them there), for the microscaled GEMMs of MXFP8 and NVFP4 anywhere (no model of SM100's),
on a GPU the table does not vouch for, for a call that adds a bias (the fp32 epilogue's rounding is
not modelled) and for GEMMs that made no call (their bits are the implementation's own arithmetic:
parity.diagnose ranks those hypotheses by closeness, as before).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from parity import cpu_gemm, hopper, hopper_oracle
from parity.contract import ScaledMMCall
from parity.oracles import Quantized
from parity.recipes import Recipe
from parity.vocabulary import Word

CALL_OUT_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class Kernel(Word):
    """What computed a GEMM's bits again (the JSON's word; parity.evidence says it in a sentence)."""

    CPU_FAST = "cpu_fast"  # parity.cpu_gemm's fast kernel, the CPU's default
    CPU_HOPPER = "cpu_hopper"  # the Hopper model, as --cpu-gemm hopper computes every CPU call
    HOPPER_MODEL = "hopper_model"  # the Hopper model standing for a GPU's call, where calibrated


@dataclass(frozen=True)
class GemmBits:
    """A GEMM's result as its call wrote it ([rows, cols] in the call's out dtype), and what computed it."""

    value: torch.Tensor
    kernel: Kernel


@dataclass(frozen=True)
class BitMatch:
    """How many of a GEMM's `elements` the named mistake reproduced bit for bit (`equal`), the most that any
    mistake of the result stage reproduced (`nearest`), and the kernel their GEMM was computed with."""

    equal: int
    elements: int
    nearest: int
    kernel: Kernel

    @property
    def whole(self) -> bool:
        """Every element reproduced: the mistake is what the code did."""
        return self.equal == self.elements

    def to_json(self) -> dict:
        return dict(bit_for_bit=self.whole, equal=self.equal, elements=self.elements, nearest=self.nearest,
                    kernel=self.kernel)


def equal_elements(got: torch.Tensor, want: torch.Tensor) -> int:
    """How many elements of `want`, rounded to `got`'s dtype, have `got`'s bits (any NaN equals any NaN;
    +0 and -0 differ); 0 where the element counts differ."""
    if got.numel() != want.numel():
        return 0
    got = got.detach().cpu().reshape(-1)
    want = want.detach().cpu().reshape(-1).to(got.dtype)
    if got.dtype.is_floating_point and got.element_size() in (2, 4, 8):
        bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[got.element_size()]
        same = got.view(bits) == want.view(bits)
        return int((same | (got.isnan() & want.isnan())).sum())
    return int((got == want).sum())


def call_out_dtype(calls: Sequence[ScaledMMCall], step: int, gemm: str) -> torch.dtype | None:
    """The one dtype the recorded calls of GEMM `gemm` at `step` write; None where they write several, one
    the model does not know, or add a bias in the call."""
    mine = [call for call in calls if call.step == step and gemm in call.gemms and not call.raised]
    written = {call.out_dtype for call in mine}
    if len(written) != 1 or any(call.bias_dtype is not None for call in mine):
        return None
    return CALL_OUT_DTYPES.get(written.pop())


def gemm_bits(recipe: Recipe, gemm: str, operands: tuple[Quantized, Quantized], out_dtype: torch.dtype,
              device: torch.device) -> GemmBits | None:
    """GEMM `gemm` of the oracle's quantized operands (A [rows, inner], B.T [cols, inner]) written in
    `out_dtype` as the kernel that ran the implementation's call on `device` computes it, with the recipe's
    epilogue around the call (parity.hopper_oracle's: unit scales and the row scales after); None where
    that kernel's bits are not known (the module docstring)."""
    spec = recipe.gemm(gemm)
    if spec.high_precision or not hopper.available() and (device.type == "cuda" or cpu_gemm.mode() == "hopper"):
        return None
    if spec.kind in ("BlockWise1x32", "BlockWise1x16"):  # microscaled: no kernel of theirs is modelled, anywhere
        return None
    a, b = operands
    if device.type == "cuda":
        rows, inner = a.values.shape
        vouched = hopper_oracle.call_exactness(recipe, gemm, rows, inner, b.values.shape[0], out_dtype, device)
        if not vouched.exact:
            return None
        on_device = [Quantized(q.values.to(device), q.inv_scale.to(device), q.tile, q.fp8_dtype) for q in (a, b)]
        return GemmBits(hopper_oracle.call_result(recipe, gemm, *on_device, out_dtype).cpu(), Kernel.HOPPER_MODEL)
    if spec.kind == "BlockWise":
        return None
    if cpu_gemm.mode() == "hopper":
        return GemmBits(hopper_oracle.call_result(recipe, gemm, a, b, out_dtype), Kernel.CPU_HOPPER)
    if cpu_gemm.mode() == "fast":
        with cpu_gemm.FastScaledMM():
            return GemmBits(hopper_oracle.call_result(recipe, gemm, a, b, out_dtype, scaled_mm=_scaled_mm),
                            Kernel.CPU_FAST)
    return None


def _scaled_mm(kind, a_fp8: torch.Tensor, b_rows: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor, *,
               out_dtype: torch.dtype, fast_accum: bool) -> torch.Tensor:
    """One TensorWise or RowWise call as the CPU kernel whose dispatch mode is active computes it (which,
    like the implementation's call, it tells by the scales' shapes, not by `kind`)."""
    return torch._scaled_mm(a_fp8, b_rows.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype,
                            use_fast_accum=fast_accum)
