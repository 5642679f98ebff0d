"""`fp8-parity bisect`: localize a failing FP8 implementation to GEMM, operand, bug class,
trigger and minimal case, with evidence.

Starting from the minimal failing case that `check` finds, four kinds of evidence are
gathered, each cheap on a minimal case:

1. Which tensors diverge, in GEMM order (output, grad_input, grad_weight). Backward GEMMs
   are fed the case's own grad_output, never the candidate's forward result, so each GEMM is
   driven on its own. The pattern names the operand: input feeds output and grad_weight;
   weight feeds output and grad_input; grad_output feeds grad_input and grad_weight.
2. The trigger: each condition of the minimal case (a layout, K == N, N-D input, a dtype,
   a second call, the data distribution, a bias, the device) is undone one at a time; the
   ones whose undoing makes the failure vanish are what it needs.
3. Metamorphic relations (parity.relations) that the candidate breaks, and the nearest
   *wrong* oracle: the exact emulation with one deliberate mistake (weight transposed,
   wrong fp8 format, amax without abs, scale not inverted, ...) that reproduces the
   candidate's numbers.
4. The recorded _scaled_mm calls: where the candidate's call for a GEMM differs from the
   reference's (dtypes, strides, scales, flags), or would fail on an H100.

The bug classes (see the README): transpose, layout, scale, fp8_dtype,
saturation, accumulation, contract, stale_state, crash.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from parity import oracles
from parity.cases import Case, Dist, Layout
from parity.check import CheckPlan, run_check
from parity.contract import ScaledMMCall, sm90_violations
from parity.data import StepData, make_data
from parity.env import environment
from parity.metrics import compare
from parity.policy import Violation
from parity.relations import RELATIONS, check_layout_invariance, check_relation, check_weight_update
from parity.diagnose import call_findings
from parity.runner import emulated_steps_of, execute, run_case

GEMMS = ("output", "grad_input", "grad_weight")
OPERANDS_OF = {"output": ("input", "weight"), "grad_input": ("grad_output", "weight"),
               "grad_weight": ("grad_output", "input")}  # (A, B) of each GEMM
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
MATCH_DB = 45.0  # a wrong oracle "matches" above this SQNR: quantization-level bugs sit near 25-30 dB


# ---- wrong oracles --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class WrongOracle:
    """The exact emulation with one deliberate mistake."""

    name: str
    category: str
    operand: str
    description: str
    quantize: dict = field(default_factory=dict)  # operand -> oracles.quantize keyword overrides (+ "fp8")
    weight_view: str = "transposed"  # output GEMM's B: weight.T | "reshaped" [K,N] | "untransposed" (K == N)
    grad_weight_view: str = "normal"  # "reshaped": (input.T @ grad_output) reshaped to [N, K]
    previous_weight: bool = False  # the weight of the call before (a stale cache)

    def applies(self, case: Case, step_index: int) -> bool:
        return (self.weight_view != "untransposed" or case.K == case.N) and (not self.previous_weight or step_index > 0)

    def emulate(self, step: StepData, previous: StepData | None = None) -> dict[str, torch.Tensor]:
        if self.previous_weight:
            step = StepData(step.input, previous.weight, step.grad_output)
        K, N = step.input.shape[-1], step.weight.shape[0]
        fp8 = {"input": E4M3, "weight": E4M3, "grad_output": E5M2}

        def q(name, tensor):  # tensor laid out [rows, inner] as its GEMM reads it
            options = dict(self.quantize.get(name, {}))
            return oracles.quantize(tensor, options.pop("fp8", fp8[name]), **options)
        x, w, go = step.input.reshape(-1, K), step.weight, step.grad_output.reshape(-1, N)
        if self.weight_view == "reshaped":
            output = oracles.gemm(q("input", x), q("weight", w.reshape(K, N).t()))
        elif self.weight_view == "untransposed":
            output = oracles.gemm(q("input", x), q("weight", w.t()))
        else:
            output = oracles.gemm(q("input", x), q("weight", w))
        if self.grad_weight_view == "reshaped":
            grad_weight = oracles.gemm(q("input", x.t()), q("grad_output", go.t())).reshape(N, K)
        else:
            grad_weight = oracles.gemm(q("grad_output", go.t()), q("input", x.t()))
        return dict(output=output, grad_input=oracles.gemm(q("grad_output", go), q("weight", w.t())),
                    grad_weight=grad_weight)


def _quantization_mistakes() -> list[WrongOracle]:
    mistakes = []
    for operand, right, wrong in (("input", "e4m3", E5M2), ("weight", "e4m3", E5M2), ("grad_output", "e5m2", E4M3)):
        other = "e5m2" if right == "e4m3" else "e4m3"
        mistakes += [
            WrongOracle(f"{operand}_{other}", "fp8_dtype", operand,
                        f"{operand} quantized to {other} instead of {right}",
                        {operand: {"fp8": wrong}}),
            WrongOracle(f"{operand}_amax_without_abs", "scale", operand, f"{operand} amax = max(x), not max(|x|)",
                        {operand: {"absolute_amax": False}}),
            WrongOracle(f"{operand}_scale_bf16", "scale", operand, f"{operand} scale rounded to bfloat16",
                        {operand: {"scale_dtype": torch.bfloat16}}),
            WrongOracle(f"{operand}_scale_not_inverted", "scale", operand,
                        f"the GEMM given {operand}'s scale instead of its inverse",
                        {operand: {"inverse_scale": False}}),
        ]
    mistakes += [
        WrongOracle("input_scaled_to_e5m2_max", "saturation", "input",
                    "input scaled to e5m2's max (57344) and saturated at e4m3's 448",
                    {"input": {"target_max": 57344.0}}),
        WrongOracle("weight_scaled_to_e5m2_max", "saturation", "weight",
                    "weight scaled to e5m2's max and saturated at e4m3's 448", {"weight": {"target_max": 57344.0}}),
        WrongOracle("input_clamped_at_240", "saturation", "input", "input clamped at 240 (e4m3fnuz's max) on e4m3fn",
                    {"input": {"clamp_max": 240.0}}),
    ]
    return mistakes


WRONG_ORACLES: tuple[WrongOracle, ...] = (
    WrongOracle("weight_reshaped", "transpose", "weight", "the [N,K] weight reinterpreted as [K,N] (reshape, not .T)",
                weight_view="reshaped"),
    WrongOracle("weight_not_transposed", "transpose", "weight", "input @ weight instead of input @ weight.T",
                weight_view="untransposed"),
    WrongOracle("grad_weight_reshaped", "transpose", "result", "grad_weight computed as input.T @ grad_output "
                "and reshaped to [N,K]", grad_weight_view="reshaped"),
    WrongOracle("previous_weight", "stale_state", "weight", "the weight of the previous call (a stale cache)",
                previous_weight=True),
    *_quantization_mistakes(),
)


def nearest_wrong_oracle(case: Case, steps: Sequence[StepData], step_index: int, got: dict[str, torch.Tensor],
                         tensors: Sequence[str]):
    """(oracle, worst SQNR over `tensors`, the correct emulation's SQNR) for the wrong oracle
    closest to the candidate's results of call `step_index`; the oracle is None unless one
    matches (>= MATCH_DB, and >= 10 dB closer than the correct emulation)."""
    def closeness(results) -> float:
        return min(compare(got[t], oracles.rounded_like_result(results[t], case, t).reshape(got[t].shape))["sqnr_db"]
                   for t in tensors)
    step, previous = steps[step_index], steps[step_index - 1] if step_index else None
    correct = closeness(oracles.emulate_linear(step.input, step.weight, step.grad_output).__dict__)
    scored = [(closeness(o.emulate(step, previous)), o) for o in WRONG_ORACLES if o.applies(case, step_index)]
    best_db, best = max(scored, key=lambda pair: pair[0])
    if best_db >= MATCH_DB and best_db >= correct + 10:
        return best, best_db, correct
    return None, best_db, correct


# ---- triggers --------------------------------------------------------------------------------------------

def _undo_conditions(case: Case) -> list[tuple[str, str, Case]]:
    """(trigger label, operand it points at, the case without that condition)."""
    undo = []
    layouts = (("input_layout", "input"), ("weight_layout", "weight"), ("grad_output_layout", "grad_output"))
    for attr, operand in layouts:
        layout = getattr(case, attr)
        if layout is not Layout.CONTIGUOUS:
            undo.append((f"only with non-contiguous {operand} ({layout.name.lower()})", operand,
                         case.replace(**{attr: Layout.CONTIGUOUS})))
    if case.K == case.N:
        undo.append(("only when K == N", "weight", case.replace(N=case.N + 16)))
    if len(case.lead) > 1:
        undo.append(("only with N-D input", "input", case.replace(lead=(case.M,))))
    if case.input_dtype != "bf16":
        undo.append((f"only with {case.input_dtype} input", "input", case.replace(input_dtype="bf16")))
    if case.weight_dtype != "bf16":
        undo.append((f"only with {case.weight_dtype} weight", "weight", case.replace(weight_dtype="bf16")))
    if case.steps > 1:
        undo.append(("only from the second call", "weight", case.replace(steps=1)))
    if case.dist is not Dist.NORMAL:
        undo.append((f"only with {case.dist_token} data", "", case.replace(dist=Dist.NORMAL)))
    if case.bias:
        undo.append(("only with a bias", "", case.replace(bias=False)))
    return undo


# ---- the localization ---------------------------------------------------------------------------------

@dataclass
class Localization:
    verdict: str  # "pass" (nothing to localize) | "fail" | "error"
    plan: CheckPlan
    device: str
    minimal_case: Case | None = None
    gemm: list[str] = field(default_factory=list)  # diverging GEMMs (tensors), in GEMM order
    first: str | None = None
    operand: str | None = None
    category: str | None = None
    trigger: list[str] = field(default_factory=list)
    trigger_operands: list[str] = field(default_factory=list)  # the operand each trigger points at
    evidence: list[str] = field(default_factory=list)
    violations: list[Violation] = field(default_factory=list)
    error: str | None = None

    def to_json(self) -> dict:
        return dict(verdict=self.verdict, impl=self.plan.candidate.name, reference=self.plan.reference.name,
                    device=self.device, gemm=self.gemm, first=self.first, operand=self.operand,
                    category=self.category, trigger=self.trigger,
                    minimal_case=None if self.minimal_case is None else self.minimal_case.id,
                    evidence=self.evidence, error=self.error, env=environment(self.device))


NUMERIC_METRICS = ("bitwise", "accumulation_bound", "sqnr_db", "paired_sqnr_db", "nonfinite")


def _is_contract_only(violation: Violation) -> bool:
    dtype_only = violation.metric == "bitwise" and str(violation.value).startswith("dtype")
    return violation.metric == "contract" or dtype_only


def _fails(plan: CheckPlan, case: Case, device: str) -> bool:
    rows = run_case(case, plan.comparisons, device=device)
    return bool(plan.judge(rows))


def _call_differences(candidate: Sequence[ScaledMMCall], reference: Sequence[ScaledMMCall], reference_name: str):
    """Evidence lines: a candidate call whose dtypes, layouts, scales or flags differ from the
    reference's call for the same GEMM, and calls that would fail on an H100."""
    def layout(shape, stride):
        return "row-major" if stride[1] == 1 else "column-major" if stride[0] == 1 else f"strides {stride}"
    lines = []
    theirs = {call.gemm: call for call in reference}
    for call in candidate:
        for problem in sm90_violations(call):
            lines.append(f"_scaled_mm {call.gemm} GEMM: {problem}")
        other = theirs.get(call.gemm)
        if other is None:
            continue
        for label, mine, ref in (
                ("A dtype", call.a_dtype, other.a_dtype), ("B dtype", call.b_dtype, other.b_dtype),
                ("A layout", layout(call.a_shape, call.a_stride), layout(other.a_shape, other.a_stride)),
                ("B layout", layout(call.b_shape, call.b_stride), layout(other.b_shape, other.b_stride)),
                ("scale shapes", (call.scale_a[0], call.scale_b[0]), (other.scale_a[0], other.scale_b[0])),
                ("out_dtype", call.out_dtype, other.out_dtype), ("use_fast_accum", call.use_fast_accum,
                                                                 other.use_fast_accum)):
            if mine != ref:
                lines.append(f"_scaled_mm {call.gemm} GEMM: {label} {mine} where {reference_name} uses {ref}")
    return lines


def localize(plan: CheckPlan, *, device: str = "cpu", case: Case | None = None, max_examples: int = 100,
             seed: int = 0) -> Localization:
    """Find (or take) a minimal failing case and localize its bug."""
    found = run_check(plan, device=device, max_examples=max_examples, seed=seed,
                      cases=None if case is None else [case])
    result = Localization(found.verdict, plan, device, found.minimal_case, error=found.error)
    if found.verdict != "fail":
        return result
    case = found.minimal_case
    violations = found.violations
    for label, operand, undone in _undo_conditions(case):
        if not _fails(plan, undone, device):
            result.trigger.append(label)
            result.trigger_operands.append(operand)
    # With M, K, N not all distinct the shapes of a _scaled_mm call cannot say which backward
    # GEMM it is: analyse a distinct-dims twin of the case when it fails too.
    if len({case.M, case.K, case.N}) < 3 and "only when K == N" not in result.trigger:
        twin = case.replace(lead=(16,), K=32, N=48)
        twin_rows = run_case(twin, plan.comparisons, device=device)
        if plan.judge(twin_rows):
            result.evidence.append(f"analysed on {twin.id} (M, K, N distinct, so each GEMM's call is named)")
            case, violations = twin, plan.judge(twin_rows)
    result.violations = violations
    step = min(v.step for v in violations)

    crashes = [v for v in violations if v.metric == "crash"]
    numeric = [v for v in violations if v.metric in NUMERIC_METRICS and not _is_contract_only(v)]
    diverging = {v.tensor for v in numeric}
    result.gemm = [t for t in (*GEMMS, "grad_bias") if t in diverging]
    scaled_mm = [v for v in violations if v.metric == "scaled_mm_contract"]
    if crashes:
        where = str(crashes[0].value)
        result.gemm = ["output"] if ": forward:" in where or "building" in where else ["grad_input", "grad_weight"]
    elif not result.gemm:
        result.gemm = [t for t in GEMMS if any(v.tensor == t for v in violations)]
    result.first = result.gemm[0] if result.gemm else None

    if scaled_mm and not numeric and not crashes:
        result.trigger.append("only on the GPU (cuBLASLt rejects the call; the CPU runs it)")
    elif device == "cuda" and not _fails(plan, case, "cpu"):
        result.trigger.append("only on the GPU")

    data = make_data(case, device)
    execution = execute(plan.candidate, data, record=True, keep_data=True)
    stages = call_findings(execution.calls, emulated_steps_of(data.on_host() if device != "cpu" else data,
                                                             plan.candidate.recipe), plan.candidate.recipe) \
        if plan.candidate.recipe.is_fp8 and not execution.error else []
    reference_run = execute(plan.reference, data, record=not plan.reference.is_reference)
    result.evidence += [f"{v.metric}: {v.full_message}" for v in violations[:6] if v.metric != "scaled_mm_contract"]
    result.evidence += _call_differences(execution.calls, reference_run.calls, plan.reference.name)
    result.evidence += [f"recorded call: {call.describe()}" for call in execution.calls
                        if set(call.gemm.split("|")) & set(result.gemm)]
    for relation in RELATIONS:
        if relation.applies(case):
            outcome = check_relation(relation, plan.candidate, data, base=execution)
            if not outcome.holds:
                result.evidence.append(f"relation {relation.name} fails ({relation.description}): "
                                       f"{outcome.error or '; '.join(outcome.broken[:2])}")
    contiguous = (Layout.CONTIGUOUS,) * 3
    layouts = (case.input_layout, case.weight_layout, case.grad_output_layout)
    other_layouts = contiguous if layouts != contiguous else (Layout.TRANSPOSED,) * 3
    layout_outcome = check_layout_invariance(plan.candidate, data, other_layouts, base=execution)
    if not layout_outcome.holds:
        result.evidence.append(f"relation {layout_outcome.relation} fails: "
                               f"{layout_outcome.error or '; '.join(layout_outcome.broken[:2])}")
    if case.steps > 1:
        update = check_weight_update(plan.candidate, data, base=execution)
        if not update.holds:
            result.evidence.append(f"relation weight_update fails: {update.error or '; '.join(update.broken[:2])}")

    oracle = None
    numeric_gemms = [t for t in result.gemm if t in GEMMS and t in diverging]
    if numeric_gemms and not execution.error and len(execution.steps) > step:
        got = {t: execution.steps[step][t] for t in numeric_gemms}
        oracle, best_db, correct_db = nearest_wrong_oracle(case, data.steps, step, got, numeric_gemms)
        if oracle is not None:
            result.evidence.append(f"matches the exact FP8 emulation with {oracle.description} "
                                   f"({best_db:.1f} dB; the correct emulation: {correct_db:.1f} dB)")
        else:
            result.evidence.append(f"no wrong oracle matches (closest {best_db:.1f} dB); the correct emulation "
                                   f"is {correct_db:.1f} dB away")
        result.category, result.operand = _classify(result, crashes, numeric, scaled_mm, oracle, correct_db, stages)
    else:
        result.category, result.operand = _classify(result, crashes, numeric, scaled_mm, None, None, stages)
    return result


def _operand_of_pattern(gemms: Sequence[str]) -> str:
    gemms = [g for g in gemms if g in GEMMS]
    if len(gemms) == 1:
        return "result"
    shared = set(OPERANDS_OF[gemms[0]]).intersection(*(OPERANDS_OF[g] for g in gemms[1:])) if gemms else set()
    return shared.pop() if len(shared) == 1 else "unknown"


STAGE_CLASSES = {"fast_accum": "accumulation", "fp8_dtype": "fp8_dtype", "scale": "scale"}


def _classify(result: Localization, crashes, numeric, scaled_mm, oracle: WrongOracle | None,
              correct_db: float | None, stages=()) -> tuple[str, str]:
    """(category, operand) from the evidence, most specific first."""
    triggers = result.trigger
    if crashes:
        named = [op for op in result.trigger_operands if op]
        return "crash", named[0] if named else ("input" if result.first == "output" else "grad_output")
    staged = [f for f in stages if f.stage in STAGE_CLASSES]
    if not numeric and staged:  # only the recorded calls differ from the recipe's: the first stage says what
        return STAGE_CLASSES[staged[0].stage], "result" if staged[0].operand == "call" else staged[0].operand
    if not numeric and scaled_mm:
        problem = str(scaled_mm[0].value)
        gemm = result.first or "output"
        a, b = OPERANDS_OF.get(gemm, ("unknown", "unknown"))
        return "layout", (b if "H100: B" in problem else a if "H100: A" in problem else "unknown")
    if not numeric:
        return "contract", "result"
    if any(t == "only from the second call" for t in triggers):
        return "stale_state", _operand_of_pattern(result.gemm)
    layout_operand = next((op for op in ("input", "weight", "grad_output")
                           if any(t.startswith(f"only with non-contiguous {op}") for t in triggers)), None)
    if layout_operand:
        return "layout", layout_operand
    if oracle is not None:
        return oracle.category, oracle.operand
    if correct_db is not None and correct_db >= MATCH_DB:
        return "accumulation", "result"
    if any(v.metric == "nonfinite" for v in numeric):
        return "saturation", _operand_of_pattern(result.gemm)
    return "unknown", _operand_of_pattern(result.gemm)


def render(result: Localization) -> str:
    plan = result.plan
    if result.verdict == "pass":
        return (f"PASS: {plan.candidate.name} shows no violation against {plan.reference.name} on {result.device}: "
                f"nothing to localize.\n")
    if result.verdict == "error":
        return f"ERROR: {result.error}\n"
    lines = [
        f"FAIL: {plan.candidate.name} against {plan.reference.name} on {result.device}",
        f"  minimal case : {result.minimal_case.id}",
        f"  GEMM         : {', '.join(result.gemm)} (first: {result.first})",
        f"  operand      : {result.operand}",
        f"  bug class    : {result.category}",
        f"  trigger      : {'; '.join(result.trigger) or 'none: shows on the simplest case'}",
        "  evidence:",
        *[f"    - {line}" for line in result.evidence],
        "",
        f"Rerun: fp8-parity check --impl {plan.candidate.name} --against {plan.reference.name} --device "
        f"{result.device} --case '{result.minimal_case.id}'",
    ]
    return "\n".join(lines) + "\n"

