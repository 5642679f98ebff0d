"""The headline of a failure: which finding names it, made the same way in every command.

check, the pytest plugin and train (through check's comparisons of its case file) see a failure as
violations; an "operand" violation carries what the recorded GEMM calls were handed that the
recipe's oracle does not hand them (parity.call_diagnosis's StageFindings). bisect sees the same
findings on the case it diagnoses, and classifies them (parity.classification). Each command opens
its report with a parity.findings.Headline built here:

    naming_finding   the finding that names a failure: the first by step, GEMM (output, grad_input,
                     grad_weight) and stage along the data path (STAGE_ORDER) that a mistake explains;
                     else the first that differs (bisect's classification picks by the same order)
    flag_triggers    where the numbers cannot show the failure: on a CPU that ignores use_fast_accum
                     (or runs a call an H100 rejects), every violation is the recorded call's lint,
                     and the failure shows "only on the GPU". Under --cpu-gemm hopper the CPU computes
                     what the H200 does, the flag shows in the numbers, and no such trigger is named.
    of_violations    the headline of check's (or the suite's, or train's) violations, or None where no
                     recorded call was diagnosed (bisect's diagnosis by behaviour can still name it)
"""

from __future__ import annotations

from typing import Iterable, Sequence

from parity.findings import Finding, Headline, Trigger, gemm_order, stage_order
from parity.policy import Violation
from parity.vocabulary import Cause, Condition, Kind


def is_gpu_lint(violation: Violation) -> bool:
    """A _scaled_mm call that would fail on an H100, or that asks for fast accumulation where the
    recipe does not, seen where it runs with the right numbers (a CPU)."""
    return violation.kind is Kind.SCALED_MM_CONTRACT or (violation.kind is Kind.OPERAND
                                                         and violation.cause is Cause.FLAG_IGNORED_ON_CPU)


def flag_triggers(violations: Sequence[Violation]) -> tuple[Trigger, ...]:
    """"only on the GPU" where every violation is a lint of the recorded calls (is_gpu_lint): the CPU ran
    them with the right numbers, a GPU would not."""
    if not violations or not all(is_gpu_lint(v) for v in violations):
        return ()
    linted = any(v.kind is Kind.SCALED_MM_CONTRACT for v in violations)
    return (Trigger(Condition.GPU_LINTED if linted else Condition.GPU_FAST_ACCUM),)


def finding_order(finding: Finding) -> tuple[int, int, int]:
    """(step, GEMM, stage): the order in which findings are read, the first that differs first."""
    return finding.step, gemm_order(finding.gemm), stage_order(finding.stage)


def naming_finding(findings: Iterable[Finding]) -> Finding | None:
    """The finding that names a failure: the first (finding_order) that a mistake explains (its bug
    class), else the first; None where there is none."""
    ordered = sorted(findings, key=finding_order)
    return next((f for f in ordered if f.category), ordered[0] if ordered else None)


def of_violations(violations: Sequence[Violation]) -> Headline | None:
    """The headline of a case's violations: the naming finding among what the recorded calls were handed
    (the "operand" violations' StageFindings), with "only on the GPU" where only the calls show it."""
    finding = naming_finding(f for v in violations if v.kind is Kind.OPERAND for f in v.problems
                             if isinstance(f, Finding))
    if finding is None:
        return None
    return Headline(finding, finding.category, flag_triggers(violations))
