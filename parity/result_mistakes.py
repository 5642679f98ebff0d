"""What can be done wrong to a GEMM's result after the GEMM, as data: the inverse scales misapplied,
the result rescaled, transposed or reshaped, the bias added twice or dropped, a rounding through
another dtype. parity.diagnose.explain_result tries them in order against a recorded result.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Callable, Iterable, Sequence

import torch

from parity import oracles
from parity.cases import Case
from parity.exact_reproduction import BitMatch
from parity.recipes import GEMMS, Recipe
from parity.vocabulary import BugClass, Operand


@dataclass(frozen=True)
class Explanation:
    """What reproduces a GEMM's result from its exact value: the bug class, the mistake's description
    and what it blames (an operand whose scale is misapplied, or the result)."""

    category: BugClass
    description: str
    operand: str = Operand.RESULT
    # how many of the GEMM's elements it reproduces bit for bit, where the GEMM's bits are known
    # (parity.exact_reproduction.BitMatch; None where they are not, or where no mistake of the space is it)
    reproduced: BitMatch | None = None


@dataclass(frozen=True)
class ResultMistake:
    """One thing done wrong to a GEMM's result after the GEMM (or in it and after it)."""

    description: str
    bug_class: BugClass
    # (the exact float64 result, the bias or None) -> the result this mistake writes before the result's
    # roundings; None where it changes nothing on this result
    transform: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor | None]
    operand: str = Operand.RESULT
    # matched bit for bit through the roundings (a second rounding leaves results too near the correct
    # ones for closeness to tell), not within parity.diagnose.MATCH_DB
    bit_exact: bool = False
    # how often it adds the bias (the output GEMM's, where the case has one): the bit-for-bit reading
    # (parity.diagnose) adds it after `transform` of the result without it, as the code would
    bias_times: int = 1

    @property
    def explanation(self) -> Explanation:
        return Explanation(self.bug_class, self.description, self.operand)


def _plus_bias(value: torch.Tensor, bias: torch.Tensor | None, times: int = 1) -> torch.Tensor:
    return value if bias is None else value + times * bias


def _misapplied(wrong: Callable[[torch.Tensor], torch.Tensor]):
    """A misapplied scale: the result `wrong` makes of the product, with the bias, unless it is the same."""
    def transform(exact: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        value = wrong(exact)
        return None if torch.allclose(value, exact) else _plus_bias(value, bias)
    return transform


def _epilogue_mistakes(scales, operands: tuple[str, str], shape: Sequence[int]) -> list[ResultMistake]:
    """Each way the inverse scales of A (per row) and B (per column) can be misapplied to the product
    after it (or in it and after it): the exact result is the product times a_inv * b_inv."""
    if scales is None or tuple(shape) != (scales[0].shape[0], scales[1].shape[1]):
        return []
    a_inv, b_inv = scales
    a_name, b_name = operands
    return [ResultMistake(description, BugClass.SCALE, _misapplied(wrong), operand) for operand, description, wrong in (
        (b_name, f"B's ({b_name}) scale multiplied into the result where its inverse belongs",
         lambda exact: exact / b_inv ** 2),
        (a_name, f"A's ({a_name}) scale multiplied into the result where its inverse belongs",
         lambda exact: exact / a_inv ** 2),
        (Operand.RESULT, "both scales multiplied into the result where their inverses belong",
         lambda exact: exact / (a_inv ** 2 * b_inv ** 2)),
        (Operand.RESULT, "the inverse scales applied twice: in the call and again to its result",
         lambda exact: exact * a_inv * b_inv),
        (b_name, f"B's ({b_name}) inverse scale never applied to the result", lambda exact: exact / b_inv),
        (a_name, f"A's ({a_name}) inverse scale never applied to the result", lambda exact: exact / a_inv))]


def _nice_factor(ratio: float, case: Case) -> tuple[float, str]:
    """The factor a least-squares ratio estimates: a power of two or a GEMM dimension (or its
    inverse) within 1%, else the ratio itself."""
    nice = {f"2^{k}": 2.0 ** k for k in range(-24, 25)}
    nice.update({"1/M": 1 / case.M, "1/K": 1 / case.K, "1/N": 1 / case.N, "M": case.M, "K": case.K, "N": case.N})
    name, value = min(nice.items(), key=lambda item: abs(math.log(abs(ratio) / item[1])) if ratio else math.inf)
    value = math.copysign(value, ratio)
    if abs(ratio / value - 1) < 1e-2:
        return value, f"{value:g} (= {'-' if ratio < 0 else ''}{name})"
    return ratio, f"{ratio:.4g}"


def _rescaled(got: torch.Tensor, exact: torch.Tensor, case: Case) -> list[ResultMistake]:
    """The result multiplied by the factor its least-squares ratio to the exact result estimates."""
    got64 = got.detach().to(torch.float64).cpu().reshape(-1, got.shape[-1])
    ratio = float((got64.nan_to_num() * exact).sum() / (exact * exact).sum()) if exact.abs().sum() > 0 else 1.0
    if not (math.isfinite(ratio) and abs(ratio - 1) > 1e-3 and ratio != 0):
        return []
    factor, name = _nice_factor(ratio, case)
    return [ResultMistake(f"the result multiplied by {name} after its GEMM", BugClass.SCALE,
                          lambda exact, bias: _plus_bias(exact * factor, bias))]


def _rearranged(shape: Sequence[int]) -> list[ResultMistake]:
    """The result transposed, or reshaped where a transpose belongs (square: the reshapes change nothing)."""
    square = shape[0] == shape[1]
    return [*([ResultMistake("the result transposed", BugClass.TRANSPOSE,
                             lambda exact, bias: _plus_bias(exact.t(), bias))] if square else []),
            ResultMistake("the result reshaped from the transposed product", BugClass.TRANSPOSE,
                          lambda exact, bias: _plus_bias(exact.t().contiguous().reshape(exact.shape), bias)),
            *([] if square else [ResultMistake(
                "the result reshaped to its transpose's shape where a transpose belongs (and transposed back)",
                BugClass.TRANSPOSE, lambda exact, bias: _plus_bias(exact.reshape(exact.shape[1], exact.shape[0]).t(),
                                                                   bias))])]


BIAS_MISTAKES = (
    ResultMistake("the bias added twice", BugClass.CONTRACT, lambda exact, bias: _plus_bias(exact, bias, 2),
                  bias_times=2),
    ResultMistake("the bias dropped", BugClass.CONTRACT, lambda exact, bias: exact, bias_times=0))


def _rounded_through(dtype: torch.dtype, exact: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return _plus_bias(exact, bias).to(dtype)


def _roundings_through(chain: Iterable[torch.dtype], got_dtype: torch.dtype,
                       category: BugClass) -> list[ResultMistake]:
    """The result rounded through another dtype on its way to its own: a second rounding."""
    chain, name = list(chain), (lambda dtype: str(dtype).replace("torch.", ""))
    return [ResultMistake(f"the result rounded through {name(through)} on its way to {name(got_dtype)}: a second "
                          f"rounding", category, partial(_rounded_through, through), bit_exact=True)
            for through in (torch.bfloat16, torch.float16, torch.float32)
            if through not in chain and through != got_dtype]


def result_mistakes(got: torch.Tensor, exact: torch.Tensor, case: Case, gemm: str, recipe: Recipe, *,
                    has_bias: bool, scales=None) -> list[ResultMistake]:
    """Every mistake tried on the result `got` of a GEMM whose exact float64 result is `exact`, in the
    order they are tried: misapplied scales (with the GEMM's per-row and per-column inverse `scales`,
    parity.diagnose.gemm_inverse_scales), a rescaling, a transposition, the bias, another rounding."""
    operands = recipe.gemm(gemm).operands if gemm in GEMMS else ("A", "B")
    # a GEMM the recipe keeps in high precision: its precision is what the recipe says of it
    rounding = BugClass.PRECISION if gemm in GEMMS and recipe.gemm(gemm).high_precision else BugClass.ACCUMULATION
    return [*_epilogue_mistakes(scales, operands, exact.shape), *_rescaled(got, exact, case),
            *_rearranged(exact.shape), *(BIAS_MISTAKES if has_bias else ()),
            *_roundings_through(oracles.rounding_chain(case, gemm, recipe), got.dtype, rounding)]
