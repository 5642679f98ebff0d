"""Diagnosis along the data path: what each GEMM was handed, against what its recipe's oracle hands it.

The recorded calls' part lives in parity.call_diagnosis (its names are importable from here); this
module holds the result stage and the diagnosis by behaviour.

For every FP8 GEMM of a recipe the exact oracle (parity.oracles) knows the operands the GEMM
must receive: the fp8 values of A and B and their inverse scales. A recorded _scaled_mm call
(parity.contract, with its tensors kept) is compared with that, stage by stage, per operand:

    fp8_dtype   the operand's fp8 format
    scale       the inverse scale of every element (tensor, row, tile or block scales alike)
    bytes       the fp8 values (logical values: a transposed copy is the same operand)
    fast_accum  the use_fast_accum flag (a CPU ignores it; the H100 does not)
    result      what the implementation does with the GEMM's result (rescaling, dtype, bias)

The first stage that differs names the operand and, through the hypothesis that reproduces
the recorded operand exactly, the bug class. Hypotheses are composed, not listed: every
operand of every GEMM is tried against the same space of mistakes (another fp8 format; amax
without abs, over another region or without its floor; a scale rounded, not inverted, not
rounded to a power of two or aimed at another max; a clamp at another bound; the operand
transposed, reshaped, read with the wrong strides or taken from the previous call), and every
result against rescaling, transposition, another rounding and the bias. An operand that
differs but matches none is reported as such, with the stages that agree.

Implementations whose GEMMs make no _scaled_mm call (their own kernels, fp8_impl's blockwise
on a CPU, a plain bf16 layer) are diagnosed by behaviour: the same hypotheses emulated end to
end and compared with the implementation's results; the nearest one names the bug when it
matches closely and clearly better than the correct emulation (ties go to the correct one).

Bug classes (the vocabulary of bisect): transpose, layout, scale, fp8_dtype, saturation,
accumulation, contract, stale_state, crash, and precision (a GEMM that runs in another precision
than its recipe says: no FP8 call where the recipe has one, or an FP8 one where it has none; or
an operand rounded to a lower precision before its fp8 cast).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Sequence

import torch

from parity import oracles
from parity.cases import Case
from parity.call_diagnosis import (OperandExplanation, StageFinding, _same, assign_calls,  # noqa: F401 - re-exported
                                   call_findings, compare_call, explain_operand, resolve_calls, stage_finding)
from parity.data import StepData
from parity.exact_reproduction import BitMatch, GemmBits, equal_elements
from parity.findings import Finding
from parity.metrics import compare, sqnr_db
from parity.mistakes import (NARROWER, Hypothesis, high_precision_hypotheses, operand_hypotheses, quantize_mistaken,
                             rounded_before_cast, scaled_over)
from parity.operand_sources import OperandSources
from parity.oracles import Quantized
from parity.result_mistakes import Explanation, ResultMistake, result_mistakes
from parity.recipes import Cast, Recipe, Scaling
from parity.vocabulary import BugClass, Kind, Operand, Stage, Tensor

MATCH_DB = 45.0  # a hypothesis "matches" results above this SQNR: quantization-level bugs sit near 25-30 dB
MARGIN_DB = 10.0  # ... and only when it is this much closer than the correct emulation (ties: the correct one)
# A result this close to the exact FP8 result (but beyond the accumulation bound), that no hypothesis
# reproduces, is read as an accumulation-level difference. Measured on Gaussian data (3 recipes x 3 seeds x
# 3 GEMMs): the operand mistakes of the hypothesis space leave 21-49 dB between the mistaken and the correct
# exact result (a median near 29 dB), except where a mistake does not change that data's numbers; a
# mistake outside the space that leaves more than 40 dB would be misread as accumulation.
ACCUMULATION_DB = 40.0


# ---- what the implementation did with a GEMM's result ---------------------------------------------

def gemm_inverse_scales(step: StepData, gemm: str, recipe: Recipe) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The recipe's inverse scales of a GEMM's A, one per row [rows, 1], and of its B, one per
    column [1, cols] (float64); None where scales vary along the inner dim (block scales) or the
    GEMM has none (high precision)."""
    spec = recipe.gemm(gemm)
    if spec.high_precision:
        return None
    K, N = step.input.shape[-1], step.weight.shape[0]
    a_hp, b_hp = oracles.operand_views(step.input.reshape(-1, K), step.weight, step.grad_output.reshape(-1, N))[gemm]
    try:
        a, b = (oracles.quantize(hp, cast, **oracles.scale_rounding(recipe)) for hp, cast in ((a_hp, spec.a),
                                                                                               (b_hp, spec.b)))
    except RuntimeError:
        return None
    if a.inv_scale.shape[1] != 1 or b.inv_scale.shape[1] != 1:
        return None
    rows, cols = a_hp.shape[0], b_hp.shape[0]
    a_rows = a.inv_scale.cpu().repeat_interleave(a.tile[0], dim=0).expand(rows, 1)
    b_cols = b.inv_scale.cpu().repeat_interleave(b.tile[0], dim=0).expand(cols, 1).t()
    return a_rows, b_cols


@dataclass(frozen=True)
class ResultReading:
    """What the result stage reads of a GEMM's result: the explanation (None: none), and where the GEMM's bits
    were computed again, how near the result stage's mistakes came to them bit for bit (also where none
    explains it: how close the nearest came)."""

    explanation: Explanation | None
    reproduced: BitMatch | None = None


def explain_result(got: torch.Tensor, exact: torch.Tensor, case: Case, tensor: str, recipe: Recipe, *,
                   bias: torch.Tensor | None = None, scales=None) -> Explanation | None:
    """The Explanation when `got` is the exact GEMM result `exact` (float64) transformed after the
    GEMM (rescaled, transposed, reshaped, rounded through another dtype, a bias twice or dropped: the
    result mistakes of parity.mistakes); None when no such transform reproduces it. With the GEMM's
    per-row and per-column inverse `scales` (gemm_inverse_scales), also a scale misapplied to the
    result, which blames the operand whose scale it is."""
    return read_result(got, exact, case, tensor, recipe, bias=bias, scales=scales).explanation


def read_result(got: torch.Tensor, exact: torch.Tensor, case: Case, tensor: str, recipe: Recipe, *,
                bias: torch.Tensor | None = None, scales=None, bits: GemmBits | None = None,
                beyond_bound: bool = True) -> ResultReading:
    """explain_result's reading, and with `bits` (the GEMM as the kernel that ran its call computed it,
    parity.exact_reproduction) each mistake applied to those bits and compared bit for bit first: one that
    reproduces every element explains the result outright, before any that only comes near the exact
    result. A result within the accumulation bound (not `beyond_bound`) is explained only so: there
    closeness cannot tell a mistake from the accumulation's own rounding."""
    mistakes = result_mistakes(got, exact, case, tensor, recipe, has_bias=bias is not None, scales=scales)
    bit_match = None
    if bits is not None:
        exactly, bit_match = _bit_for_bit(got, bits, mistakes, case, tensor, recipe, bias)
        if exactly is not None or bit_match is None or not beyond_bound:
            return ResultReading(exactly, bit_match)
    elif not beyond_bound:
        return ResultReading(None)
    named = _explained_near(got, exact, mistakes, case, tensor, recipe, bias)
    if named is None or bit_match is None:
        return ResultReading(named, bit_match)
    mistake = next((m for m in mistakes if m.explanation == named), None)
    if mistake is None:  # the overflow reading: no mistake's bits to count
        return ResultReading(named, bit_match)
    equal = _equal_through(got, bits, mistake, case, tensor, recipe, bias)
    return ResultReading(dataclasses.replace(named, reproduced=dataclasses.replace(bit_match, equal=equal or 0)),
                         bit_match)


def _explained_near(got: torch.Tensor, exact: torch.Tensor, mistakes: Sequence[ResultMistake], case: Case,
                    tensor: str, recipe: Recipe, bias: torch.Tensor | None) -> Explanation | None:
    """The first mistake whose float64 result comes within MATCH_DB of `got` (bit for bit, for a second
    rounding), or the overflow reading; None."""
    got64 = got.detach().to(torch.float64).cpu().reshape(-1, got.shape[-1])
    exact = exact.detach().to(torch.float64).cpu()
    b = None if bias is None else bias.detach().to(torch.float64).cpu()
    chain = oracles.rounding_chain(case, tensor, recipe)

    def rounded(value: torch.Tensor) -> torch.Tensor:
        for dtype in chain:
            value = value.to(dtype)
        return value.to(torch.float64)

    def reproduces(mistake: ResultMistake, value: torch.Tensor) -> bool:  # same NaN and Inf, the rest within MATCH_DB
        value = rounded(value)
        if mistake.bit_exact:
            return _same(value.reshape(got64.shape), got64)
        return value.shape == got64.shape and _closeness(got64, value) >= MATCH_DB
    for mistake in mistakes:
        value = mistake.transform(exact, b)
        if value is not None and reproduces(mistake, value):
            return mistake.explanation
    if bool((~torch.isfinite(got64) & torch.isfinite(rounded(exact if b is None else exact + b))).any()):
        return Explanation(BugClass.SATURATION, "the result overflows its dtype where the exact result does not")
    return None


def _finished(value: torch.Tensor, case: Case, tensor: str, recipe: Recipe, bias: torch.Tensor | None,
              times: int) -> torch.Tensor:
    """A GEMM's result before its roundings, rounded as the layer writes it: through the recipe's dtypes, the
    output's bias (`times` times) added in the output dtype as torch adds it (in fp32, then rounded) before
    the last rounding."""
    chain = oracles.rounding_chain(case, tensor, recipe)
    with_bias = bias is not None and tensor == "output" and case.bias
    for dtype in chain[:-1] if with_bias else chain:
        value = value.to(dtype)
    if with_bias:
        out = chain[-1]
        for _ in range(times):
            value = (value.to(torch.float64) + bias.to(out).to(torch.float64)).to(torch.float32).to(out)
        value = value.to(out)
    return value


def _equal_through(got: torch.Tensor, bits: GemmBits, mistake: ResultMistake | None, case: Case, tensor: str,
                   recipe: Recipe, bias: torch.Tensor | None) -> int | None:
    """How many elements of `got` a mistake (None: none, the recipe's own epilogue) applied to the kernel's
    `bits` reproduces bit for bit; None where the mistake changes nothing on them."""
    kernel = bits.value.detach().cpu().to(torch.float64)
    value = kernel if mistake is None else mistake.transform(kernel, None)
    if value is None:
        return None
    times = 1 if mistake is None else mistake.bias_times
    return equal_elements(got, _finished(value, case, tensor, recipe, None if bias is None else bias.cpu(), times))


def _bit_for_bit(got: torch.Tensor, bits: GemmBits, mistakes: Sequence[ResultMistake], case: Case, tensor: str,
                 recipe: Recipe, bias: torch.Tensor | None) -> tuple[Explanation | None, BitMatch | None]:
    """(the first mistake that reproduces every element of `got` from the kernel's bits, or None; how near
    the mistakes came). (None, None) where the recipe's own epilogue reproduces them: nothing after the
    GEMM is wrong."""
    elements = got.numel()
    if _equal_through(got, bits, None, case, tensor, recipe, bias) == elements:
        return None, None
    counts = [(count, mistake) for mistake in mistakes
              if (count := _equal_through(got, bits, mistake, case, tensor, recipe, bias)) is not None]
    nearest = max((count for count, _ in counts), default=0)
    whole = next((mistake for count, mistake in counts if count == elements), None)
    match = BitMatch(nearest, elements, nearest, bits.kernel)
    if whole is None:
        return None, match
    return dataclasses.replace(whole.explanation, reproduced=match), match


# ---- by behaviour: the same hypotheses, end to end ------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class Match(Finding):
    """The hypothesis whose end-to-end emulation comes nearest a GEMM's results (its operand, class and
    description), how near (`db`) and how near the correct emulation comes (`correct_db`)."""

    kind: Kind = Kind.BEHAVIOUR
    stage: Stage = Stage.BEHAVIOUR
    description: str
    db: float  # closeness of the hypothesis to the implementation's result
    correct_db: float  # closeness of the correct emulation
    hypothesis: Hypothesis | None = None  # the mistake of the space it is (None: a result transform)

    @property
    def sentence(self) -> str:
        return f"{self.operand}: its results are the exact emulation's with {self.description}"

    @property
    def is_mistake(self) -> bool:
        """A hypothesis that matches (>= MATCH_DB) and is clearly closer than the correct emulation (ties go
        to the correct one), not the accumulation-level reading of a result near the exact one."""
        return self.db >= MATCH_DB and self.db >= self.correct_db + MARGIN_DB and self.correct_db < math.inf


def _closeness(got: torch.Tensor, want: torch.Tensor) -> float:
    """SQNR of `got` against a hypothesis's `want`, where non-finite values must match exactly: a
    NaN or Inf that one has and the other has not rules the hypothesis out (-inf), and matching
    ones are left out of the SQNR (all of them matching: inf). An amax without its floor gives
    NaN on an all-zero tile; only a hypothesis that makes those NaN may explain it."""
    got, want = got.to(torch.float64), want.to(torch.float64)
    got_bad, want_bad = ~got.isfinite(), ~want.isfinite()
    if not torch.equal(got_bad, want_bad) or not torch.equal(got[got_bad].nan_to_num(nan=0.0),
                                                             want[want_bad].nan_to_num(nan=0.0)):
        return -math.inf
    keep = ~got_bad
    return sqnr_db(got[keep], want[keep]) if bool(keep.any()) else math.inf


@dataclass(frozen=True)
class _Score:
    """How near one hypothesis's emulation comes to a GEMM's results."""

    db: float
    operand: str
    category: str
    description: str
    hypothesis: Hypothesis | None = None


@dataclass
class _GemmScoring:
    """One GEMM's results (`target`) against the emulation of every hypothesis: the scores so far."""

    gemm: str
    target: torch.Tensor
    sources: OperandSources
    case: Case
    recipe: Recipe
    bias: torch.Tensor | None
    scores: list = None

    def __post_init__(self):
        self.spec = self.recipe.gemm(self.gemm)
        self.scores = []
        self.a_hp, self.b_hp = (self.sources.view(self.gemm, role, "same") for role in ("a", "b"))
        self.qa, self.qb = (quantize_mistaken(hp, cast, self.recipe)
                            for hp, cast in ((self.a_hp, self.spec.a), (self.b_hp, self.spec.b)))
        self.correct_value = oracles.gemm(self.qa, self.qb)
        self.correct_db = self.closeness(self.correct_value)

    def closeness(self, value: torch.Tensor) -> float:
        value = value.cpu()
        if self.gemm == "output" and self.bias is not None:
            value = value + self.bias.to(torch.float64).cpu()
        want = oracles.rounded_like_result(value, self.case, self.gemm, self.recipe).reshape(self.target.shape)
        return _closeness(self.target.cpu(), want)

    def score(self, db: float, operand: str, category: str, description: str, hypothesis=None) -> None:
        self.scores.append(_Score(db, operand, category, description, hypothesis))

    def with_operand(self, role: str, q: Quantized) -> torch.Tensor:
        """The GEMM with operand `role` quantized as `q`, the other as the recipe casts it."""
        return oracles.gemm(q, self.qb) if role == "a" else oracles.gemm(self.qa, q)

    def mistakes(self, role: str, operand: str, cast: Cast, hypotheses: Sequence[Hypothesis]) -> None:
        """Each mistake on one operand, the other as the recipe casts it: how near the result it comes."""
        shape = (self.a_hp if role == "a" else self.b_hp).shape
        for hypothesis in hypotheses:
            q = self.sources.quantized(hypothesis, self.gemm, role, cast, self.recipe, shape)
            if q is not None:
                self.score(self.closeness(self.with_operand(role, q)), operand, hypothesis.category,
                           hypothesis.description, hypothesis)


def _score_high_precision(s: _GemmScoring) -> None:
    """A GEMM the recipe computes in high precision: its operands from an fp8 copy, taken from elsewhere
    or rounded narrower first, the whole GEMM in a narrower dtype, or in a wider precision."""
    spec, recipe = s.spec, s.recipe
    for role, operand in (("a", spec.operands[0]), ("b", spec.operands[1])):
        hp = s.a_hp if role == "a" else s.b_hp
        rows, inner = hp.shape
        for cast in {c for _, c in recipe.casts_of(operand) if c.fp8 is not None}:
            for tile in {cast.scaling.tile(rows, inner), (1, inner), (rows, 1), (rows, inner)}:
                q = quantize_mistaken(hp, cast, recipe, scaled_over(tile))
                if q is None:
                    continue
                fp8_copy = Quantized(q.dequantized(), hp.new_ones((1, 1), dtype=torch.float64), (rows, inner), None)
                s.score(s.closeness(s.with_operand(role, fp8_copy)), operand, "precision",
                        f"{operand} taken from its {cast.fp8} copy where the recipe computes this GEMM in high "
                        f"precision")
    # its high-precision operands taken from elsewhere, or rounded to a narrower dtype first
    not_cast = Cast(Scaling.NONE, None)
    for role, operand in (("a", spec.operands[0]), ("b", spec.operands[1])):
        s.mistakes(role, operand, not_cast, high_precision_hypotheses())
    # the whole GEMM in a narrower dtype than the recipe's: both operands and the result rounded to it
    chain = ", ".join(str(d).replace("torch.", "") for d in oracles.rounding_chain(s.case, s.gemm, recipe))
    # (operands already in that dtype stay as they are: the result's rounding alone then tells)
    for name, dtype in NARROWER:
        narrow = [quantize_mistaken(hp, not_cast, recipe, rounded_before_cast(dtype)) for hp in (s.a_hp, s.b_hp)]
        value = oracles.gemm(narrow[0] or s.qa, narrow[1] or s.qb).to(dtype).to(torch.float64)
        s.score(s.closeness(value), "result", "precision", f"computed in {name} (operands and result) where the "
                                                            f"recipe's result is rounded to {chain} only")
    # computed in a wider precision than the recipe's: nearer the exact product than its roundings allow
    target = s.target
    wider = _closeness(target.cpu(), s.correct_value.reshape(target.shape).to(target.dtype).cpu()) \
        if s.bias is None or s.gemm != "output" else -math.inf
    s.score(wider, "result", "precision", f"computed in {str(target.dtype).replace('torch.', '')} without the "
                                          f"recipe's rounding to {chain}")


def _score_fp8(s: _GemmScoring) -> None:
    """An FP8 GEMM: each mistake of the space on either operand, and one shared by both (one cast routine)."""
    spec, recipe = s.spec, s.recipe
    for role, operand, cast in (("a", spec.operands[0], spec.a), ("b", spec.operands[1], spec.b)):
        s.mistakes(role, operand, cast, operand_hypotheses(cast, recipe, *(s.a_hp if role == "a" else s.b_hp).shape))
    of_b = {h.description: h for h in operand_hypotheses(spec.b, recipe, *s.b_hp.shape)}
    for hypothesis in operand_hypotheses(spec.a, recipe, *s.a_hp.shape):
        twin = of_b.get(hypothesis.description)
        if twin is None or hypothesis.source != "same" or twin.source != "same" or hypothesis.transform is None:
            continue
        both = (quantize_mistaken(s.a_hp, spec.a, recipe, hypothesis),
                quantize_mistaken(s.b_hp, spec.b, recipe, twin))
        if None not in both:
            s.score(s.closeness(oracles.gemm(*both)), spec.operands[0], hypothesis.category,
                    f"{hypothesis.description}, in both operands", hypothesis)


def _best_match(s: _GemmScoring, step_index: int) -> Match | None:
    """The nearest hypothesis when it matches; else, for a result near the exact one, an accumulation-level
    reading; else None."""
    if not s.scores:
        return None
    best = max(s.scores, key=lambda score: score.db)  # the first of equals: the order of the space decides ties
    match = Match(tensor=Tensor(s.gemm), step=step_index, operand=Operand(best.operand),
                  category=BugClass(best.category), description=best.description, db=best.db,
                  correct_db=s.correct_db, hypothesis=best.hypothesis)
    if match.is_mistake:
        return match
    if s.correct_db >= ACCUMULATION_DB:  # the operands must be right: only the sums differ
        return Match(tensor=Tensor(s.gemm), step=step_index, operand=Operand.RESULT, category=BugClass.ACCUMULATION,
                     description=f"the exact result summed or rounded less precisely ({s.correct_db:.1f} dB from it, "
                                 f"where operand mistakes leave < {ACCUMULATION_DB:.0f} dB)",
                     db=s.correct_db, correct_db=s.correct_db)
    return None


def diagnose_behaviour(got: dict[str, torch.Tensor], step_index: int, steps: Sequence[StepData], case: Case,
                       recipe: Recipe, gemms: Sequence[str], *, bias: torch.Tensor | None = None,
                       strided: StepData | None = None) -> list[Match]:
    """For each GEMM in `gemms` (its result in `got`), the hypothesis (one operand's mistake, or a
    transform of the result) whose end-to-end emulation is closest to the implementation, when it
    matches (>= MATCH_DB and >= MARGIN_DB closer than the correct emulation)."""
    sources = OperandSources(steps[step_index], steps[step_index - 1] if step_index else None, strided)
    out = []
    for gemm_name in gemms:
        scoring = _GemmScoring(gemm_name, got[gemm_name], sources, case, recipe, bias)
        if scoring.spec.high_precision:
            _score_high_precision(scoring)
        else:
            _score_fp8(scoring)
        explained = explain_result(scoring.target, scoring.correct_value, case, gemm_name, recipe,
                                   bias=bias if gemm_name == "output" else None,
                                   scales=gemm_inverse_scales(steps[step_index], gemm_name, recipe))
        if explained is not None:
            scoring.score(MATCH_DB, explained.operand, explained.category, explained.description)
        match = _best_match(scoring, step_index)
        if match is not None:
            out.append(match)
    return out


def high_precision_closeness(got: dict[str, torch.Tensor], step: StepData, case: Case,
                             recipe: Recipe) -> tuple[float, float]:
    """(SQNR of the results against the exact high-precision product, against the recipe's exact
    FP8 emulation), worst over the GEMMs: an 'FP8' implementation nearer the first is not FP8."""
    exact = oracles.emulate_linear(step.input, step.weight, step.grad_output, recipe)
    K, N = step.input.shape[-1], step.weight.shape[0]
    x, w, go = (t.to(torch.float64) for t in (step.input.reshape(-1, K), step.weight, step.grad_output.reshape(-1, N)))
    plain = {"output": x @ w.t(), "grad_input": go @ w, "grad_weight": go.t() @ x}
    hp, fp8 = math.inf, math.inf
    for name, value in got.items():
        hp = min(hp, compare(value.double().cpu(), plain[name].reshape(value.shape))["sqnr_db"])
        fp8 = min(fp8, compare(value.double().cpu(), getattr(exact, name).reshape(value.shape))["sqnr_db"])
    return hp, fp8


