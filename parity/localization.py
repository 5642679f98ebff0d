"""What `fp8-parity bisect` concludes (Localization) and what it reads of one case's violations (Outcome).

parity.bisect runs the localization; parity.triggers finds the conditions a failure needs,
parity.case_findings what each GEMM of the case was handed and gave, parity.classification the bug
class and operand, parity.evidence the lines that back it. They share the types here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from parity.cases import Case
from parity.check import CheckPlan
from parity.env import environment
from parity.exact_reproduction import BitMatch
from parity.findings import STAGE_ORDER, Finding, Headline, Trigger, gemm_order, labels  # noqa: F401 - re-exported
from parity.headline import is_gpu_lint  # noqa: F401 - re-exported
from parity.policy import Violation
from parity.vocabulary import BugClass, Cause, Kind, Method, Operand, Stage, Verdict

NUMERIC_KINDS = (Kind.BITWISE, Kind.EXACT, Kind.ACCUMULATION_BOUND, Kind.SQNR_DB, Kind.PAIRED_SQNR_DB,
                 Kind.NONFINITE, Kind.OPERAND)
# the classes of the GPU rules (parity.contract) whose rejection of a call names the bug rather than a crash
NAMED_BY_REJECTION = (BugClass.LAYOUT, BugClass.FP8_DTYPE)


def is_contract_only(violation: Violation) -> bool:
    """nn.Linear's contract broken, or equal values in another dtype: no wrong number."""
    return violation.kind is Kind.CONTRACT or (violation.kind is Kind.BITWISE and
                                               violation.cause in (Cause.DTYPE_ONLY, Cause.MISSING))


@dataclass
class Outcome:
    """What the plan's comparisons say about one case."""

    violations: list[Violation]

    @property
    def fails(self) -> bool:
        return bool(self.violations)

    @property
    def crashed(self) -> bool:
        return any(v.kind is Kind.CRASH for v in self.violations)

    @property
    def crashes(self) -> list[Violation]:
        return [v for v in self.violations if v.kind is Kind.CRASH]

    @property
    def numeric(self) -> list[Violation]:
        return [v for v in self.violations if v.kind in NUMERIC_KINDS and not is_contract_only(v)]


@dataclass(frozen=True)
class CrashNote:
    """A crash found beside the numbers diagnosed: its sentence and the conditions it needs."""

    message: str
    triggers: tuple[Trigger, ...] = ()

    def to_json(self) -> dict:
        return dict(message=self.message, trigger=labels(self.triggers))


def _diagnosis_entry(finding: Finding) -> dict:
    """A finding as the JSON's `diagnosis` lists it."""
    if finding.kind is Kind.BEHAVIOUR:
        return dict(step=finding.step, gemm=finding.gemm, operand=finding.operand, stage=Stage.BEHAVIOUR,
                    category=finding.category, message=f"matches the exact emulation with {finding.description} "
                                                       f"({finding.db:.1f} dB; the correct emulation: "
                                                       f"{finding.correct_db:.1f} dB)", exact=None)
    reproduced = getattr(finding, "reproduced", None)
    return dict(step=finding.step, gemm=finding.gemm, operand=finding.operand, stage=finding.stage,
                category=finding.category or "", message=finding.message,
                exact=None if reproduced is None else reproduced.to_json())


@dataclass
class Localization:
    verdict: Verdict  # PASS: nothing to localize
    plan: CheckPlan
    device: str
    minimal_case: Case | None = None
    gemm: list[str] = field(default_factory=list)  # diverging GEMMs (tensors), in GEMM order
    first: str | None = None
    operand: Operand | None = None
    category: BugClass | None = None
    triggers: list[Trigger] = field(default_factory=list)
    evidence: list[str] = field(default_factory=list)
    violations: list[Violation] = field(default_factory=list)
    error: str | None = None
    method: Method | None = None
    findings: list[Finding] = field(default_factory=list)  # the stage findings and behaviour matches diagnosed
    crash: CrashNote | None = None
    diagnosed_case: Case | None = None
    named_by: Finding | None = None  # the finding that names the class (parity.classification): the headline's
    cases_run: int = 0  # the cases the search for a failing case ran
    search_budget: int | None = None  # the generated cases that search could try (None: the cases were given)
    seconds: dict = field(default_factory=dict)  # wall time of each phase (check, triggers, diagnosis, evidence)

    @property
    def trigger(self) -> list[str]:
        """The triggers as the text and the JSON list them."""
        return labels(self.triggers)

    @property
    def headline(self) -> Headline | None:
        """The failure in one line, as check and the pytest plugin head the same bug (parity.headline)."""
        if self.named_by is None:
            return None
        return Headline(self.named_by, self.category, tuple(self.triggers))

    @property
    def reproduction(self) -> BitMatch | None:
        """How the finding that named the class and first GEMM reproduced that GEMM's bits, where they were
        computed again (parity.exact_reproduction); None where they were not, or another finding named it."""
        return next((finding.reproduced for finding in self.findings if getattr(finding, "reproduced", None)
                     and finding.gemm == self.first and finding.category == self.category), None)

    @property
    def diagnosis(self) -> list[dict]:
        """The findings as the JSON lists them."""
        return [_diagnosis_entry(finding) for finding in self.findings]

    def to_json(self) -> dict:
        return dict(verdict=self.verdict, impl=self.plan.candidate.name, reference=self.plan.reference.name,
                    device=self.device, gemm=self.gemm, first=self.first, operand=self.operand,
                    category=self.category, trigger=self.trigger,
                    finding=None if self.headline is None else str(self.headline),
                    minimal_case=None if self.minimal_case is None else self.minimal_case.id,
                    evidence=self.evidence, error=self.error, method=self.method, diagnosis=self.diagnosis,
                    exact=None if self.reproduction is None else self.reproduction.to_json(),
                    crash=None if self.crash is None else self.crash.to_json(), recipe=self.plan.candidate.recipe.name,
                    diagnosed_case=None if self.diagnosed_case is None else self.diagnosed_case.id,
                    seconds={phase: round(value, 2) for phase, value in self.seconds.items()},
                    env=environment(self.device))
