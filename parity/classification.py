"""bisect's step 3: the GEMMs to blame, the bug class and the operand, from one case's findings.

The class and operand come from the first GEMM (output, grad_input, grad_weight) and the first
stage that differs; a difference within the accumulation bound is a rounding-level (accumulation)
finding, never a structural one; a crash is named by the call the kernel rejected or the phase it
ended in; "unknown" comes with the stages compared. Every decision reads typed fields: the stage,
the bug class, the triggers' conditions, a call's GPU problems and whether its exception ended the
case, a contract finding's problems.
"""

from __future__ import annotations

from typing import Sequence

from parity.case_findings import CaseDiagnosis, first_gemm
from parity.contract import Breach, ContractProblem, ScaledMMCall
from parity.call_diagnosis import StageFinding
from parity.localization import NAMED_BY_REJECTION, STAGE_ORDER, CrashNote, Localization, gemm_order
from parity.policy import Violation
from parity.recipes import GEMMS, OPERANDS, Recipe
from parity.rows import Raised
from parity.vocabulary import BugClass, Condition, Kind, Method, Operand, Phase, Stage
from parity.worker import Died


def _gemms_of(calls) -> set[tuple[int, str]]:
    """(step, GEMM) of each of these recorded calls."""
    return {(call.step, gemm) for call in calls for gemm in call.gemms if gemm in GEMMS}


def _rejected(calls: Sequence[ScaledMMCall]) -> set[tuple[int, str]]:
    """(step, GEMM) of each recorded call the kernel raised on that is the crash: its exception is the one
    that ended the case (a call rejected and caught, as code that falls back to its own GEMM on a CPU
    does, is not)."""
    return _gemms_of(call for call in calls if call.raised and call.ended_case)


def _ended_in_forward(error) -> bool:
    """Whether the crash happened while building the module or in a forward. A worker's death is placed
    by its phase only while building the module: its death in a forward is not told apart from one in
    the backward (as bisect has always read it; telling them apart would change its answers)."""
    if isinstance(error, Raised):
        return error.phase in (Phase.BUILD, Phase.FORWARD)
    return isinstance(error, Died) and error.phase == Phase.BUILD.value


def crash_gemms(crash: Violation, calls: Sequence[ScaledMMCall], recipe: Recipe) -> list[str]:
    """The GEMM a crash happened in: that of a call the kernel rejected; else the forward's; in the
    backward, the first backward GEMM that made no recorded call (the calls made before the crash
    are the GEMMs that ran)."""
    rejected = sorted(_rejected(calls), key=lambda key: (key[0], gemm_order(key[1])))
    if rejected:  # the kernel raised on this call
        return [rejected[0][1]]
    if _ended_in_forward(crash.error):
        return ["output"]
    done = {g for call in calls if call.phase == "backward" for g in call.gemms}
    pending = [g for g in ("grad_input", "grad_weight") if g not in done and not recipe.gemm(g).high_precision]
    return pending[:1] or ["grad_weight" if recipe.gemm("grad_weight").high_precision else "grad_input"]


def blame(result: Localization, d: CaseDiagnosis) -> None:
    """The GEMMs to blame: diverging tensors and GEMMs with an explained finding, in GEMM order (a crash's
    GEMM when nothing else is wrong)."""
    findings, matches = d.findings, d.matches
    gemms = sorted(set(d.diverging) | {f.gemm for f in findings if f.category} | {m.gemm for m in matches},
                   key=gemm_order) or sorted({f.gemm for f in findings} | {m.gemm for m in matches}, key=gemm_order)
    if d.crashes and not d.numeric:
        gemms = crash_gemms(d.crashes[0], d.execution.calls, d.recipe)
        result.method = Method.CRASH
    if not gemms:  # only grad_bias differs: no GEMM is to blame (first: none), the bias's gradient is
        gemms = sorted({v.tensor for v in d.outcome.violations} & set(GEMMS), key=gemm_order)
    if not gemms and d.gpu_problems:
        gemms = sorted({g for call, _ in d.gpu_problems for g in call.gemms if g in GEMMS}, key=gemm_order)
    result.gemm, result.first = gemms, gemms[0] if gemms else None


def first_operand(gemms: Sequence[str]) -> Operand:
    """The operand a pattern of diverging GEMMs shares (one GEMM: its result)."""
    gemms = [g for g in gemms if g in GEMMS]
    if len(gemms) == 1:
        return Operand.RESULT
    shared = set(OPERANDS[gemms[0]]).intersection(*(OPERANDS[g] for g in gemms[1:])) if gemms else set()
    return Operand(shared.pop()) if len(shared) == 1 else Operand.UNKNOWN


def _is_dtype_contract(finding: StageFinding) -> bool:
    """A contract finding that says a result came back in another dtype than nn.Linear's."""
    return finding.stage is Stage.CONTRACT and any(isinstance(p, ContractProblem) and p.breach is Breach.DTYPE
                                                   for p in finding.problems)


def _ordered(d: CaseDiagnosis) -> list[StageFinding]:
    """The findings by step, GEMM and stage. A GEMM whose result is right: what the caller sees (the
    contract) first; so too a result handed back in another dtype than nn.Linear's, which an out_dtype
    finding of the same GEMM only explains."""
    diverging = {v.tensor for v in d.numeric}
    dtype_contract = {(f.step, f.gemm) for f in d.findings if _is_dtype_contract(f)}

    def stage_rank(f: StageFinding) -> int:
        if f.stage is Stage.CONTRACT and (f.gemm not in diverging or (f.step, f.gemm) in dtype_contract):
            return -1
        return STAGE_ORDER.index(f.stage) if f.stage in STAGE_ORDER else 9
    return sorted(d.findings, key=lambda f: (f.step, gemm_order(f.gemm), stage_rank(f)))


def _layout_operand(result: Localization) -> Operand | None:
    """The operand stored non-contiguously that the failure needs, if it needs one."""
    return next((t.operand for t in result.triggers if t.condition is Condition.NON_CONTIGUOUS), None)


def _stale(result: Localization) -> bool:
    """The failure needs a second call of the case (state kept from the call before)."""
    return any(t.condition is Condition.SECOND_CALL for t in result.triggers)


def _by_layout(result: Localization, category: BugClass) -> BugClass:
    """An operand rearranged only when some operand is stored non-contiguously: the result depends on
    the strides of the same logical values (layout), not on a transpose in the code's math."""
    layout_operand = _layout_operand(result)
    if category is BugClass.TRANSPOSE and layout_operand:
        result.evidence.append(f"the rearranged operand shows only with a non-contiguous {layout_operand}: "
                               f"the code reads memory by the wrong strides (layout)")
        return BugClass.LAYOUT
    return category


def _crash_class(result: Localization, d: CaseDiagnosis, explained: list[StageFinding]) -> tuple[BugClass, Operand]:
    """A case that only crashes. The GEMMs that ran before the crash were already handed the wrong
    operands; the call that raised counts only where the kernel rejected it for a rule that names a
    class (its operands' memory order, their fp8 formats: cuBLASLt's layout and e5m2 x e5m2 rules): then
    what that call was handed is the bug, and the crash its symptom. A scale tensor the kernel refuses
    is the crash itself."""
    rejected = _rejected(d.execution.calls) - _gemms_of(call for call, problem in d.gpu_problems
                                                        if call.raised and problem.category in NAMED_BY_REJECTION)
    explained = [f for f in explained if (f.step, f.gemm) not in rejected]
    if explained:
        result.named_by = explained[0]
        result.crash = CrashNote(d.crashes[0].message, tuple(result.triggers))
        result.gemm = sorted({f.gemm for f in explained}, key=gemm_order)
        result.first = result.gemm[0]
        return explained[0].category, explained[0].operand
    named = [t.operand for t in result.triggers if t.operand]
    return BugClass.CRASH, named[0] if named else (Operand.INPUT if result.first == "output" else Operand.GRAD_OUTPUT)


def _unexplained_class(result: Localization, d: CaseDiagnosis, ordered: list[StageFinding]) -> tuple[BugClass, Operand]:
    """No finding names a class and no hypothesis matches: the stage says where, the triggers what; else
    the calls an H100 rejects, the contract, or what the numbers say (rounding, overflow, unknown)."""
    stale, layout_operand, numeric = _stale(result), _layout_operand(result), d.numeric
    if ordered:  # differences no single mistake explains
        first = result.named_by = ordered[0]
        if stale:
            return BugClass.STALE_STATE, first.operand
        if layout_operand:
            return BugClass.LAYOUT, layout_operand
        return (BugClass.SCALE if first.stage is Stage.SCALE else BugClass.UNKNOWN), first.operand
    if d.gpu_problems and not numeric:  # a call the CPU runs and the H100 rejects: the rule says what
        call, problem = d.gpu_problems[0]
        gemm = first_gemm(call) or "output"
        role = problem.role
        return problem.category, Operand(OPERANDS[gemm][0 if role == "a" else 1]) if role in ("a", "b") \
            else Operand.RESULT
    if not numeric:
        return BugClass.CONTRACT, Operand.RESULT
    if stale:
        return BugClass.STALE_STATE, first_operand(result.gemm)
    if layout_operand:
        return BugClass.LAYOUT, layout_operand
    # every recorded call is the recipe's and no transform of the result explains it: rounding only?
    if not any(v.kind in (Kind.ACCUMULATION_BOUND, Kind.NONFINITE) for v in numeric):
        result.evidence.append("every stage of the recorded calls equals the oracle's and the results lie within "
                               "the accumulation bound of the exact result: a rounding-level difference")
        return BugClass.ACCUMULATION, Operand.RESULT
    if any(v.kind is Kind.NONFINITE for v in numeric):
        return BugClass.SATURATION, first_operand(result.gemm)
    result.evidence.append("unexplained: compared and equal: " + (
        "the fp8 formats, scales and values of every recorded call; " if d.execution.calls else "") +
        "no hypothesis of the space (operand and result mistakes) reproduces the results")
    return BugClass.UNKNOWN, first_operand(result.gemm)


def classify(result: Localization, d: CaseDiagnosis) -> tuple[BugClass, Operand]:
    """(category, operand) from the evidence, the first GEMM and stage that differ first; the finding
    that names them becomes result.named_by (the headline's, parity.headline)."""
    numeric, matches = d.numeric, d.matches
    ordered = _ordered(d)
    explained = [f for f in ordered if f.category]
    # a GEMM diagnosed by behaviour before the first GEMM with an explained finding comes first
    first_match = min(matches, key=lambda m: gemm_order(m.gemm), default=None)
    match_step = min((v.step for v in numeric), default=0)
    only_crashed = bool(d.crashes) and not numeric
    if explained and first_match is not None and not only_crashed and \
            (match_step, gemm_order(first_match.gemm)) < (explained[0].step, gemm_order(explained[0].gemm)):
        explained = []
    if only_crashed:
        return _crash_class(result, d, explained)
    if explained:
        first = explained[0]
        stale_finding = next((f for f in explained if f.category is BugClass.STALE_STATE), None)
        if _stale(result) and stale_finding is None:
            result.named_by = first
            return BugClass.STALE_STATE, first_operand(result.gemm)
        first = result.named_by = stale_finding or first
        return _by_layout(result, first.category), first.operand
    if matches:
        result.named_by = first_match
        return _by_layout(result, first_match.category), first_match.operand
    return _unexplained_class(result, d, ordered)
