"""bisect's step 2: what each GEMM of one case was handed and what it gave, as findings.

The candidate runs the case once more, in this process, with its _scaled_mm calls recorded (and
their tensors kept). Its findings come, in this order, from: the recorded calls against the recipe's
oracle, stage by stage (parity.call_diagnosis.call_findings; a scale no single mistake reproduces may be
one kept from the call before); the calls an H100 rejects (parity.contract's GPU rules); unit scales
in a call; the results' contract (dtype, shape, strides, operands written in place); the result
stage of a GEMM whose calls are the recipe's; GEMMs that made no call, by behaviour
(parity.diagnose.diagnose_behaviour); a GEMM that runs in another precision; a call that writes
another dtype; and grad_bias, which says how often the bias enters the output.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from parity import oracles
from parity.cases import Case
from parity.check import CheckPlan
from parity.contract import Breach, ContractProblem, GpuProblem, ScaledMMCall, contract_problems, expected_contract, \
    sm90_problems
from parity.data import CaseData, make_data
from parity.call_diagnosis import StageFinding, call_findings, resolve_calls, stage_finding
from parity.diagnose import (ACCUMULATION_DB, MATCH_DB, Match, diagnose_behaviour, gemm_inverse_scales,
                             high_precision_closeness, read_result)
from parity.exact_reproduction import BitMatch, GemmBits, call_out_dtype, gemm_bits
from parity.localization import Localization, Outcome, gemm_order
from parity.metrics import compare
from parity.operand_sources import strides_ignored
from parity.policy import Violation
from parity.recipes import GEMMS, OPERANDS, Recipe
from parity.runner import Execution, emulated_steps_of, execute
from parity.vocabulary import BugClass, Kind, Method, Stage


@dataclass(frozen=True)
class Unreproduced:
    """A GEMM of the result stage that no mistake explains, and how near the nearest came bit for bit."""

    step: int
    gemm: str
    reproduced: BitMatch


@dataclass
class CaseDiagnosis:
    """One case run again with its calls recorded, and what was found on it."""

    plan: CheckPlan
    case: Case
    outcome: Outcome
    data: CaseData
    host: CaseData  # the data on the CPU, where the oracles run
    execution: Execution
    findings: list[StageFinding] = field(default_factory=list)
    matches: list[Match] = field(default_factory=list)
    # GEMMs at the result stage whose bits were computed again and that no mistake explains: how near they came
    unreproduced: list[Unreproduced] = field(default_factory=list)

    @property
    def recipe(self) -> Recipe:
        return self.plan.candidate.recipe

    @property
    def fp8(self) -> bool:
        return self.recipe.is_fp8 and not self.plan.candidate.exact

    @property
    def numeric(self) -> list[Violation]:
        return self.outcome.numeric

    @property
    def diverging(self) -> list[str]:
        """The tensors whose numbers are wrong, in GEMM order."""
        return sorted({v.tensor for v in self.numeric}, key=gemm_order)

    @property
    def crashes(self) -> list[Violation]:
        return self.outcome.crashes

    @property
    def gpu_problems(self) -> list[tuple[ScaledMMCall, GpuProblem]]:
        """(call, problem) for every rule of an H100 a recorded call breaks."""
        return [(call, problem) for call in self.execution.calls for problem in sm90_problems(call)]


def first_gemm(call: ScaledMMCall, among=GEMMS) -> str | None:
    return next((g for g in call.gemms if g in among), None)


def run_again(plan: CheckPlan, case: Case, outcome: Outcome, device: str) -> CaseDiagnosis:
    """The candidate on `case` once more, its calls recorded (each naming the one GEMM it is)."""
    data = make_data(case, device)
    host = data.on_host()
    execution = execute(plan.candidate, data, record=True, keep_data=True)
    diagnosis = CaseDiagnosis(plan, case, outcome, data, host, execution)
    if diagnosis.fp8:  # one GEMM per call, for every stage below (a call whose shapes fit two: the oracle it matches)
        execution.calls = resolve_calls(execution.calls, host.steps, diagnosis.recipe, case)
    return diagnosis


def examine(result: Localization, d: CaseDiagnosis, device: str) -> None:
    """Every finding of the case, in the order of the module docstring."""
    if d.fp8 and d.execution.calls:
        d.findings = call_findings(d.execution.calls, d.host.steps, d.recipe, d.case)
        result.method = Method.RECORDED_CALLS
        if d.case.steps == 1 and any(f.stage is Stage.SCALE and not f.category for f in d.findings):
            d.findings = _kept_scales(d.findings, d.plan.candidate, d.case, d.recipe, device)
    d.findings += _gpu_rule_findings(d)
    _unit_scales(d)
    d.findings += _contract_findings(d)
    d.findings += _result_findings(d)
    _behaviour(result, d)
    d.findings += _out_dtype_findings(d)
    d.findings += _bias_findings(d)


def _kept_scales(findings: list[StageFinding], candidate, case: Case, recipe, device: str) -> list[StageFinding]:
    """A first call's scale that no single mistake reproduces may be one kept from call to call (delayed
    scaling: the first call gets an initial value, each later call the scale of the call before). A
    second call tells: where its scale is the first call's (the stale_state hypothesis of
    parity.diagnose), the unexplained scale of the first call is named so."""
    twice = case.replace(steps=2)
    data = make_data(twice, device)
    host = data.on_host()
    execution = execute(candidate, data, record=True, keep_data=True)
    if not execution.calls:
        return findings
    calls = resolve_calls(execution.calls, host.steps, recipe, twice)
    kept = {(f.gemm, f.operand): f for f in call_findings(calls, host.steps, recipe, twice)
            if f.step == 1 and f.category is BugClass.STALE_STATE and f.stage is Stage.SCALE}
    return [StageFinding(step=f.step, tensor=f.gemm, operand=f.operand, stage=Stage.SCALE,
                         message=f"{f.message}. On a second call ({twice.id}) {second.message}",
                         category=BugClass.STALE_STATE, hypothesis=second.hypothesis)
            if f.stage is Stage.SCALE and not f.category and (second := kept.get((f.gemm, f.operand))) else f
            for f in findings]


def _gpu_rule_findings(d: CaseDiagnosis) -> list[StageFinding]:
    """Calls an H100 rejects: a finding of their GEMM (a crash there comes first: the GPU never gets further)."""
    out = []
    for call, problem in d.gpu_problems:
        gemm = first_gemm(call)
        if gemm is not None:
            role = problem.role
            operand = OPERANDS[gemm][0 if role == "a" else 1] if role in ("a", "b") else "result"
            out.append(stage_finding(call.step, gemm, operand, "calls" if problem.category is BugClass.CRASH
                                     else "gpu_rule", f"{gemm} GEMM: {problem.message}", problem.category))
    return out


def _unit_scales(d: CaseDiagnosis) -> None:
    """Unit scales in a call: applied after the GEMM (a rounding-level difference) or never (a scale bug)."""
    for index, finding in enumerate(d.findings):
        if finding.stage is not Stage.UNIT_SCALES or finding.step >= len(d.execution.steps):
            continue
        got_result = d.execution.steps[finding.step][finding.gemm]
        exact = oracles.rounded_like_result(getattr(emulated_steps_of(d.host, d.recipe)[finding.step], finding.gemm),
                                            d.case, finding.gemm, d.recipe)
        db = -math.inf if got_result is None else compare(got_result.cpu(), exact.reshape(got_result.shape))["sqnr_db"]
        category, what = (("accumulation", "applied to the result after the GEMM: a second rounding")
                          if db >= ACCUMULATION_DB else ("scale", "never applied to the result"))
        d.findings[index] = stage_finding(finding.step, finding.gemm, "result", "unit_scales",
                                          f"the call's scales are all ones while its fp8 operands are the recipe's: "
                                          f"the scales are {what} ({db:.1f} dB from the exact result)", category)


def _written_in_place(violation: Violation) -> str | None:
    """The operand a contract violation says the call wrote in place (grad_output first, then input, weight)."""
    written = {p.subject for p in violation.problems
               if isinstance(p, ContractProblem) and p.breach is Breach.MODIFIED_IN_PLACE}
    return next((op for op in ("grad_output", "input", "weight") if op in written), None)


def _contract_findings(d: CaseDiagnosis) -> list[StageFinding]:
    """The results' dtypes, shapes and strides (nn.Linear's contract): a finding of their GEMM."""
    out = []
    for violation in d.outcome.violations:
        if violation.kind is Kind.CONTRACT and violation.tensor in GEMMS:
            gemm, operand = violation.tensor, "result"
            # an operand written in place (reported with the output): blamed on the first GEMM that then
            # computes a wrong result from it (grad_output: a backward GEMM)
            moved = _written_in_place(violation)
            if moved is not None:
                later = [g for g in d.diverging if g in GEMMS and (moved != "grad_output" or g != "output")]
                gemm, operand = (later[0] if later else "grad_input" if moved == "grad_output" else "output"), moved
            out.append(stage_finding(violation.step, gemm, operand, "contract" if moved is None else "in_place",
                                     violation.message, "contract", problems=violation.problems))
    execution = d.execution
    if d.crashes and execution.forward_outputs and not any(f.stage is Stage.CONTRACT for f in d.findings + out):
        expected = expected_contract(d.case, compute_dtype=d.plan.candidate.compute_dtype)["output"]
        for problem in contract_problems(execution.forward_outputs[0], expected, "output"):
            out.append(stage_finding(0, "output", "result", "contract", f"output (step 0): {problem} (before the "
                                     f"crash)", "contract", problems=(problem,)))
    return out


def _result_findings(d: CaseDiagnosis) -> list[StageFinding]:
    """GEMMs whose calls are the recipe's but whose results are not: the result stage. A GEMM beyond the
    accumulation bound (or with Inf or NaN) is explained as before, the mistakes that reproduce its bits
    exactly first where they are known (parity.exact_reproduction); one that differs only bit for bit
    (policy exact against the Hopper model, or bitwise against the reference) is explained only by a mistake
    that reproduces every bit."""
    bounded = {(v.step, v.tensor) for v in d.numeric if v.kind in (Kind.ACCUMULATION_BOUND, Kind.NONFINITE)}
    # a grad_bias that breaks nn.Linear's contract: the bias is the output GEMM's, whose result is then
    # explained even within the bound (a GPU's is loose enough to hide a dropped bias)
    if d.host.bias is not None:
        bounded |= {(v.step, "output") for v in d.outcome.violations if v.tensor == "grad_bias"}
    bitwise = {(v.step, v.tensor) for v in d.numeric if v.kind in (Kind.EXACT, Kind.BITWISE)} - bounded
    flagged = {(f.step, f.gemm) for f in d.findings}
    execution, host, recipe = d.execution, d.host, d.recipe
    out = []
    for step_index, gemm in sorted(bounded | bitwise, key=lambda k: (k[0], gemm_order(k[1]))):
        if gemm not in GEMMS or (step_index, gemm) in flagged or step_index >= len(execution.steps) \
                or not any(step_index == c.step and gemm in c.gemms for c in execution.calls):
            continue
        got_result = execution.steps[step_index][gemm]
        emulated = emulated_steps_of(host, recipe)[step_index]
        bits = _gemm_bits(d, step_index, gemm, emulated)
        if got_result is None or (bits is None and (step_index, gemm) in bitwise):
            continue
        reading = read_result(got_result, getattr(emulated, gemm), d.case, gemm, recipe,
                              bias=host.bias if gemm == "output" else None,
                              scales=gemm_inverse_scales(host.steps[step_index], gemm, recipe), bits=bits,
                              beyond_bound=(step_index, gemm) in bounded)
        explained = reading.explanation
        if explained is not None:
            out.append(stage_finding(step_index, gemm, explained.operand, "result",
                                     f"{explained.description} (every recorded operand is the recipe's)",
                                     explained.category, reproduced=explained.reproduced))
        if reading.reproduced is not None and (explained is None or explained.reproduced is None):
            d.unreproduced.append(Unreproduced(step_index, gemm, reading.reproduced))
    return out


def _gemm_bits(d: CaseDiagnosis, step_index: int, gemm: str, emulated) -> GemmBits | None:
    """The GEMM as the kernel that ran its recorded call computes it from the oracle's operands, where that
    kernel's bits are known (parity.exact_reproduction); None elsewhere."""
    out_dtype = call_out_dtype(d.execution.calls, step_index, gemm)
    if out_dtype is None or gemm not in emulated.operands:
        return None
    return gemm_bits(d.recipe, gemm, emulated.operands[gemm], out_dtype, d.data.device)


def _uncalled_results(d: CaseDiagnosis) -> tuple[int, dict[str, torch.Tensor]]:
    """(the first step with wrong numbers, the results there of the GEMMs that made no call): those that
    diverge and those before the first that does (a GEMM within a loose bound, the tensor cores' on a
    GPU, can still be nearer a mistake)."""
    execution, diverging = d.execution, d.diverging
    called = {g for call in execution.calls for g in call.gemms}
    first_diverging = min((gemm_order(g) for g in diverging if g in GEMMS), default=len(GEMMS))
    uncalled = [g for g in GEMMS if g not in called and (g in diverging or gemm_order(g) < first_diverging)]
    step = min((v.step for v in d.numeric), default=0)
    got = {}
    if step < len(execution.steps):
        got = {g: execution.steps[step][g].detach().cpu() for g in uncalled if execution.steps[step][g] is not None}
    elif execution.forward_outputs and "output" in uncalled and step < len(execution.forward_outputs):
        got = {"output": execution.forward_outputs[step].detach().cpu()}
    return step, got


def _behaviour(result: Localization, d: CaseDiagnosis) -> None:
    """GEMMs of the case that made no call: by behaviour; and an FP8 GEMM of the recipe that made no call
    and whose result is the high-precision product."""
    step, got = _uncalled_results(d)
    if not (d.fp8 and got):
        return
    host, recipe = d.host, d.recipe
    matches = diagnose_behaviour(got, step, host.steps, d.case, recipe, list(got), bias=host.bias,
                                 strided=strides_ignored(host.steps[step], d.case))
    # a GEMM within the bound counts only where it is as far from the correct emulation as operand
    # mistakes leave it, and a mistake is much nearer
    d.matches = [m for m in matches if m.gemm in d.diverging or (m.is_mistake and m.correct_db < ACCUMULATION_DB)]
    result.method = result.method or Method.BEHAVIOUR
    if not d.execution.calls:
        hp_db, fp8_db = high_precision_closeness(got, host.steps[step], d.case, recipe)
        result.evidence.append(f"no _scaled_mm call was recorded: its results are {hp_db:.1f} dB from the exact "
                               f"high-precision product and {fp8_db:.1f} dB from the exact {recipe.name} FP8 result")
    for gemm_name, value in got.items():
        if recipe.gemm(gemm_name).high_precision or not bool(torch.isfinite(value).all()):
            continue
        hp_db, fp8_db = high_precision_closeness({gemm_name: value}, host.steps[step], d.case, recipe)
        if hp_db >= MATCH_DB and hp_db >= fp8_db + 10:
            d.findings.append(stage_finding(step, gemm_name, "result", "calls",
                                            f"no _scaled_mm call for {gemm_name} and its result is the "
                                            f"high-precision product ({hp_db:.1f} dB from it, {fp8_db:.1f} dB from "
                                            f"the exact {recipe.name} FP8 result): this GEMM does not run in FP8",
                                            "precision"))


def _out_dtype_findings(d: CaseDiagnosis) -> list[StageFinding]:
    """A call that writes another dtype than the recipe's, on a GEMM whose result is wrong."""
    out = []
    for call in d.execution.calls:
        gemm_name = first_gemm(call, d.diverging)
        if gemm_name is None or call.out_dtype is None or d.recipe.gemm(gemm_name).high_precision:
            continue
        want = str(oracles.rounding_chain(d.case, gemm_name, d.recipe)[0]).replace("torch.", "")
        if call.out_dtype != want:
            out.append(stage_finding(call.step, gemm_name, "result", "out_dtype",
                                     f"the {gemm_name} call writes {call.out_dtype} where the {d.recipe.name} "
                                     f"recipe's GEMM writes {want}: another rounding of the sums (or their overflow)",
                                     "accumulation"))
    return out


def _bias_findings(d: CaseDiagnosis) -> list[StageFinding]:
    """grad_bias is grad_output summed over tokens, whatever the GEMMs do: k times that sum says the
    bias enters the output k times (twice: added by two layers of the code; none: dropped)."""
    host, execution = d.host, d.execution
    if "grad_bias" not in d.diverging or host.bias is None:
        return []
    step_index = min(v.step for v in d.numeric if v.tensor == "grad_bias")
    got_bias = execution.steps[step_index]["grad_bias"] if step_index < len(execution.steps) else None
    want_bias = host.steps[step_index].grad_output.reshape(-1, d.case.N).to(torch.float64).sum(0)
    if got_bias is None or not want_bias.abs().sum() > 0:
        return []
    times = float((got_bias.detach().cpu().to(torch.float64) * want_bias).sum() / (want_bias ** 2).sum())
    if abs(times - round(times)) < 0.02 and round(times) != 1:
        return [stage_finding(step_index, "output", "result", "result",
                              f"grad_bias is {round(times)} times grad_output summed over the tokens: the bias "
                              f"enters the output {round(times)} times instead of once", "contract")]
    return []
