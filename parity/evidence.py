"""bisect's step 4: the evidence lines that back a localization.

The violations, the stage findings, the behaviour matches, a crash beside the numbers, the recorded
calls of the blamed GEMMs and how they differ from the reference's, and the metamorphic relations
(parity.relations) the candidate breaks on the diagnosed case.
"""

from __future__ import annotations

from typing import Sequence

from parity.case_findings import CaseDiagnosis
from parity.cases import Layout
from parity.contract import ScaledMMCall, sm90_problems
from parity.localization import Localization
from parity.relations import RELATIONS, check_layout_invariance, check_relation, check_weight_update, missing_tensors
from parity.diagnose import MATCH_DB
from parity.exact_reproduction import Kernel
from parity.runner import execute
from parity.call_diagnosis import StageFinding
from parity.vocabulary import Kind, Method, Stage


def _layout(stride) -> str:
    return "row-major" if stride[1] == 1 else "column-major" if stride[0] == 1 else f"strides {stride}"


# What a call may do in another form than the reference's call and still hand its GEMM the recipe's operands:
# its scales as other tensors (torchao's rowwise hands unit scales and scales the result after the GEMM), its
# operands in other strides (what an H100 accepts: parity.contract's rules say where it does not)
_FORM = ("scale shapes", "A layout", "B layout")


def call_differences(candidate: Sequence[ScaledMMCall], reference: Sequence[ScaledMMCall],
                     reference_name: str, findings: Sequence[StageFinding] | None = None) -> list[str]:
    """Evidence lines: a candidate call whose dtypes, layouts, scales or flags differ from the
    reference's call for the same GEMM, and calls that would fail on an H100. Where the calls were
    compared with the recipe's oracle element by element (`findings`: what that found), a difference
    in form alone (_FORM: scale shapes, strides) is left out unless a finding of that call's stages
    (its scales; a rule of the H100) backs it: the reference's form is one of several correct ones."""
    lines = []
    theirs = {(call.step, call.gemms): call for call in reference}
    for call in candidate:
        problems = sm90_problems(call)
        lines += [f"_scaled_mm {call.label} GEMM: {problem}" for problem in problems]
        other = theirs.get((call.step, call.gemms))
        if other is None:
            continue
        stages = None if findings is None else {f.stage for f in findings
                                                if f.step == call.step and f.gemm in call.gemms}
        for label, mine, ref in (
                ("A dtype", call.a_dtype, other.a_dtype), ("B dtype", call.b_dtype, other.b_dtype),
                ("A layout", _layout(call.a_stride), _layout(other.a_stride)),
                ("B layout", _layout(call.b_stride), _layout(other.b_stride)),
                ("scale shapes", (call.scale_a[0], call.scale_b[0]), (other.scale_a[0], other.scale_b[0])),
                ("out_dtype", call.out_dtype, other.out_dtype),
                ("use_fast_accum", call.use_fast_accum, other.use_fast_accum)):
            backed = stages is None or label not in _FORM or (
                problems if "layout" in label else stages & {Stage.SCALE, Stage.UNIT_SCALES, Stage.RECIPE})
            if mine != ref and backed:
                lines.append(f"_scaled_mm {call.label} GEMM: {label} {mine} where {reference_name} uses {ref}")
    return lines


def _findings_lines(result: Localization, d: CaseDiagnosis) -> list[str]:
    lines = [f"{v.metric}: {v.full_message}" for v in d.outcome.violations[:6]
             if v.kind not in (Kind.SCALED_MM_CONTRACT, Kind.OPERAND)]
    lines += [f"stage {f.stage}: {f}" for f in d.findings[:8]]
    lines += exact_lines(d)
    diverging = {v.tensor for v in d.numeric}
    lines += [f"behaviour: {m.gemm}: matches the exact emulation with {m.description} ({m.db:.1f} dB; "
              f"the correct emulation: {m.correct_db:.1f} dB)" + ("" if m.gemm in diverging else
              "; its result is within the accumulation bound here, yet nearer this mistake")
              for m in d.matches]
    if result.crash:
        lines.append(f"crash: {result.crash.message} "
                     f"({'; '.join(map(str, result.crash.triggers)) or 'on the minimal case'})")
    return lines


KERNEL_WORDS = {Kernel.CPU_FAST: "the CPU's fast scaled-GEMM kernel, which computed the call",
                Kernel.CPU_HOPPER: "the Hopper model, which computed the call (--cpu-gemm hopper)",
                Kernel.HOPPER_MODEL: "the Hopper model, calibrated bit for bit for this call on this GPU"}


def exact_lines(d: CaseDiagnosis) -> list[str]:
    """The result stage's bit-for-bit readings: a mistake that reproduces every element of its GEMM, or, where
    none does, how near the nearest came."""
    lines = []
    for f in d.findings:
        match = f.reproduced if f.stage is Stage.RESULT else None
        if match is None:
            continue
        where = f"exact: {f.gemm} GEMM (step {f.step}), its call through {KERNEL_WORDS[match.kernel]}"
        if match.whole:
            lines.append(f"{where}: the mistake named reproduces all {match.elements} elements bit for bit")
        else:
            lines.append(f"{where}: no mistake of the result stage reproduces its {match.elements} elements bit for "
                         f"bit (the nearest: {match.nearest}); the one named comes within {MATCH_DB:.0f} dB of the "
                         f"exact result and reproduces {match.equal} of {match.elements}")
    lines += [f"exact: {u.gemm} GEMM (step {u.step}), its call through {KERNEL_WORDS[u.reproduced.kernel]}: no "
              f"mistake of the result stage reproduces its {u.reproduced.elements} elements bit for bit (the "
              f"nearest: {u.reproduced.nearest})" for u in d.unreproduced]
    return lines


def _add_relations(lines: list[str], d: CaseDiagnosis) -> None:
    """The metamorphic relations the candidate breaks on the case (its execution the base of each), each
    added to `lines` as it is found (a relation that cannot be checked leaves those before it)."""
    candidate, case, data, execution = d.plan.candidate, d.case, d.data, d.execution
    for relation in RELATIONS:
        if relation.applies(case):
            outcome = check_relation(relation, candidate, data, base=execution)
            if not outcome.holds:
                lines.append(f"relation {relation.name} fails ({relation.description}): "
                             f"{outcome.error or '; '.join(outcome.broken[:2])}")
    contiguous = (Layout.CONTIGUOUS,) * 3
    layouts = (case.input_layout, case.weight_layout, case.grad_output_layout)
    other_layouts = contiguous if layouts != contiguous else (Layout.TRANSPOSED,) * 3
    layout_outcome = check_layout_invariance(candidate, data, other_layouts, base=execution)
    if not layout_outcome.holds:
        lines.append(f"relation {layout_outcome.relation} fails: "
                     f"{layout_outcome.error or '; '.join(layout_outcome.broken[:2])}")
    if case.steps > 1:
        update = check_weight_update(candidate, data, base=execution)
        if not update.holds:
            lines.append(f"relation weight_update fails: {update.error or '; '.join(update.broken[:2])}")


def add_evidence(result: Localization, d: CaseDiagnosis) -> None:
    result.evidence += _findings_lines(result, d)
    plan, execution = d.plan, d.execution
    reference_run = execute(plan.reference, d.data, record=plan.reference.recipe.is_fp8)
    diagnosed = d.findings if result.method is Method.RECORDED_CALLS else None
    result.evidence += call_differences(execution.calls, reference_run.calls, plan.reference.name, diagnosed)
    result.evidence += [f"recorded call: {call.describe()}" for call in execution.calls
                        if set(call.gemms) & set(result.gemm)][:6]
    missing = missing_tensors(execution, d.case)
    if missing:
        result.evidence.append(f"relations not checked: {missing}")
    if execution.error or missing:
        return
    _add_relations(result.evidence, d)
