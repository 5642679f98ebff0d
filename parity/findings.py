"""What fp8-parity finds, as data: the base of every finding, and bisect's triggers.

A finding is made where its fact is known, with that fact in typed fields (its kind, the tensor or
GEMM, the step, the operand, the bug class, the stage); its sentence is carried beside them and
rendered only at the edge (check's and bisect's text, the JSON, the reports), the way
torch.testing's ErrorMeta carries an error's type and message until it is raised. No decision
reads the sentence: code that needs to know something about a finding reads a field.

    Finding          the base: kind, tensor, step, operand, category, stage
      Violation      a row (or pair of rows) that breaks its policy (parity.policy)
      StageFinding   one stage of what a GEMM was handed differs from the oracle's (parity.diagnose)
      Match          a hypothesis that reproduces a GEMM's results end to end (parity.diagnose)
    Trigger          a condition of the case that a failure needs (parity.triggers)
    Headline         a failure in one line: the finding that names it, its bug class, its triggers

Every command that reports a failure (check, bisect, the pytest plugin, train) opens with its
Headline, made by parity.headline from the typed findings and rendered by Headline.__str__ alone:
the same bug reads the same in each.
"""

from __future__ import annotations

from dataclasses import dataclass

from parity.vocabulary import BugClass, Condition, Kind, Operand, Stage, Tensor

# A layer's tensors in the order it computes them: a finding about an earlier GEMM comes first
TENSOR_ORDER = (Tensor.OUTPUT, Tensor.GRAD_INPUT, Tensor.GRAD_WEIGHT, Tensor.GRAD_BIAS)
# The stages along a GEMM's data path, in the order a diagnosis reads them: the first that differs names the bug
STAGE_ORDER = (Stage.IN_PLACE, Stage.CALLS, Stage.RECIPE, Stage.PRECISION, Stage.FP8_DTYPE, Stage.SCALE, Stage.BYTES,
               Stage.UNIT_SCALES, Stage.FAST_ACCUM, Stage.OUT_DTYPE, Stage.RESULT, Stage.CONTRACT, Stage.GPU_RULE)


def gemm_order(name: str) -> int:
    """A GEMM's (or grad_bias's) place in the layer's order: output, grad_input, grad_weight, grad_bias."""
    return TENSOR_ORDER.index(name) if name in TENSOR_ORDER else 9


def stage_order(stage: Stage | None) -> int:
    """A stage's place along the data path (STAGE_ORDER); stages outside it last."""
    return STAGE_ORDER.index(stage) if stage in STAGE_ORDER else len(STAGE_ORDER)


@dataclass(frozen=True, kw_only=True)
class Finding:
    """One fact about the implementation under test and where it is."""

    kind: Kind
    tensor: Tensor  # the tensor (a row's) or the GEMM (a diagnosis's) it is about
    step: int = 0
    operand: Operand | None = None  # what it blames, where it says
    category: BugClass | None = None  # the bug class it names (None: it names none)
    stage: Stage | None = None  # where along the GEMM's data path (diagnosis findings)

    @property
    def gemm(self) -> Tensor:
        """The GEMM a diagnosis finding is about (its tensor: the GEMM's result)."""
        return self.tensor

    @property
    def sentence(self) -> str:
        """What it says of its GEMM, in one sentence (a subclass's own words)."""
        return str(self.kind)


# ---- triggers -----------------------------------------------------------------------------------------

# The sentence of each condition, as bisect prints it and the JSON lists it (`trigger`).
_TRIGGER_LABELS = {
    Condition.K_EQUALS_N: "only when K == N",
    Condition.ND_INPUT: "only with N-D input",
    Condition.SECOND_CALL: "only from the second call",
    Condition.EARLIER_CALLS: "only from the second call (state that earlier calls in the process left)",
    Condition.BIAS: "only with a bias",
    Condition.K_NOT_N: "only when K != N",
    Condition.M_NOT_K: "only when M != K",
    Condition.GPU: "only on the GPU",
    Condition.GPU_LINTED: "only on the GPU (the CPU runs this call; there the contract lint flags it)",
    Condition.GPU_FAST_ACCUM: "only on the GPU (the CPU ignores use_fast_accum; its recorded call shows the flag)",
}


@dataclass(frozen=True)
class Trigger:
    """A condition a failure needs: without it (that condition flipped alone, the same seed) the
    case passes. `operand` is the operand it points at (None: none), `dtype` and `dist` the
    dtype or distribution it is about, `layout` an operand's layout name; `alternative` marks a
    further condition that fails too ("or with fp16 input")."""

    condition: Condition
    operand: Operand | None = None
    dtype: str | None = None
    dist: str | None = None  # the distribution's token (Case.dist_token)
    layout: str | None = None  # the layout's name, lower case (transposed, sliced, padded)
    alternative: bool = False

    def __str__(self) -> str:
        lead = "or" if self.alternative else "only"
        if self.condition is Condition.NON_CONTIGUOUS:
            return f"{lead} with non-contiguous {self.operand} ({self.layout})"
        if self.condition is Condition.DTYPE:
            return f"{lead} with {self.dtype} {self.operand}"
        if self.condition is Condition.DISTRIBUTION:
            return f"{lead} with {self.dist} data"
        return _TRIGGER_LABELS[self.condition]


def labels(triggers) -> list[str]:
    """The triggers as the JSON and the text list them."""
    return [str(trigger) for trigger in triggers]


# ---- the headline ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Headline:
    """A failure in one line: the diagnosis finding that names it (what a GEMM was handed, or did with
    its result: a StageFinding or a behaviour Match), the bug class, and the conditions it needs. check
    and the pytest plugin make it from their violations, bisect from its localization, train from the
    check of its case file (parity.headline); `str` is the only place its words are made, so one bug
    reads the same in every command:

        grad_weight GEMM (step 0): use_fast_accum=True where the tensorwise recipe says False
        [accumulation; only on the GPU (the CPU ignores use_fast_accum; its recorded call shows the flag)]
    """

    finding: Finding
    category: BugClass | None
    triggers: tuple[Trigger, ...] = ()

    def __str__(self) -> str:
        notes = ([str(self.category)] if self.category else []) + labels(self.triggers)
        where = f"{self.finding.gemm} GEMM (step {self.finding.step})"
        return f"{where}: {self.finding.sentence}" + (f" [{'; '.join(notes)}]" if notes else "")
