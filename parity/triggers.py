"""bisect's step 1: the conditions a failure needs (its triggers), by experiment.

Each condition of the minimal case (a non-contiguous layout, K == N, N-D input, a dtype, a second
call, the data distribution, a bias) is flipped on its own, with the same seed: a condition is a
trigger when the failure disappears without it. A crash is tracked apart from wrong numbers, so a
condition that only turns a crash off is the crash's trigger, and the case without it is where the
numbers are diagnosed. Each trigger is a parity.findings.Trigger (a Condition and what it concerns).
"""

from __future__ import annotations

from typing import Callable

import torch

from parity.cases import DRAWN_DISTS, INPUT_DTYPES, WEIGHT_DTYPES, Case, Dist, Layout
from parity.check import CheckPlan
from parity.findings import Trigger
from parity.localization import Localization, Outcome
from parity.recipes import BLOCK
from parity.vocabulary import Condition, Operand

OutcomeOf = Callable[..., Outcome]  # (case, device, runner=...) -> what the plan's comparisons say


def conditions(case: Case, alignment: int = 16) -> list[tuple[Trigger, Case]]:
    """(the trigger a condition of the case is, the case without that condition); `alignment`, the plan's:
    K != N is made with an N the recipe takes."""
    undo = []
    layouts = (("input_layout", Operand.INPUT), ("weight_layout", Operand.WEIGHT),
               ("grad_output_layout", Operand.GRAD_OUTPUT))
    for attr, operand in layouts:
        layout = getattr(case, attr)
        if layout is not Layout.CONTIGUOUS:
            undo.append((Trigger(Condition.NON_CONTIGUOUS, operand, layout=layout.name.lower()),
                         case.replace(**{attr: Layout.CONTIGUOUS})))
    if case.K == case.N:
        step = BLOCK if case.K % BLOCK == 0 else max(16, alignment)
        undo.append((Trigger(Condition.K_EQUALS_N, Operand.WEIGHT), case.replace(N=case.N + step)))
    if len(case.lead) > 1:
        undo.append((Trigger(Condition.ND_INPUT, Operand.INPUT), case.replace(lead=(case.M,))))
    if case.input_dtype != "bf16":
        undo.append((Trigger(Condition.DTYPE, Operand.INPUT, dtype=case.input_dtype), case.replace(input_dtype="bf16")))
    if case.weight_dtype != "bf16":
        undo.append((Trigger(Condition.DTYPE, Operand.WEIGHT, dtype=case.weight_dtype),
                     case.replace(weight_dtype="bf16")))
    if case.steps > 1:
        undo.append((Trigger(Condition.SECOND_CALL, Operand.WEIGHT), case.replace(steps=1)))
    if case.dist is not Dist.NORMAL:
        undo.append((Trigger(Condition.DISTRIBUTION, dist=case.dist_token), case.replace(dist=Dist.NORMAL)))
    if case.bias:
        undo.append((Trigger(Condition.BIAS), case.replace(bias=False)))
    return undo


def one_condition_more(case: Case, plan: CheckPlan, device: str) -> list[Case]:
    """The case with one trigger condition of `conditions` added (a layout, a dtype, N-D input, K == N, a
    bias, a second call, a data distribution), those the plan can run."""
    variants = [case.replace(**{attr: Layout.TRANSPOSED})
                for attr in ("input_layout", "weight_layout", "grad_output_layout")]
    variants += [case.replace(input_dtype=dtype) for dtype in INPUT_DTYPES]
    variants += [case.replace(weight_dtype=dtype) for dtype in WEIGHT_DTYPES]
    variants += [case.replace(N=case.K), case.replace(bias=True), case.replace(steps=2)]
    if len(case.lead) == 1:
        variants.append(case.replace(lead=(2, case.M // 2)))
    variants += [case.replace(dist=dist) for dist in DRAWN_DISTS]
    return [v for v in dict.fromkeys(variants) if v != case and plan.unsupported(v, torch.device(device).type) is None]


def _needs(result: Localization, condition: Condition) -> bool:
    return any(trigger.condition is condition for trigger in result.triggers)


def more_distributions(result: Localization, case: Case, device: str, outcome_of: OutcomeOf) -> None:
    """A failure that needs its data distribution may need one of several: each other distribution
    is tried on the same case, and those that fail too are named ("or with X data")."""
    if not _needs(result, Condition.DISTRIBUTION):
        return
    for dist in DRAWN_DISTS:
        if dist not in (case.dist, Dist.NORMAL) and outcome_of(case.replace(dist=dist), device).fails:
            other = case.replace(dist=dist)
            result.triggers.append(Trigger(Condition.DISTRIBUTION, dist=other.dist_token, alternative=True))


def more_dtypes(result: Localization, plan: CheckPlan, case: Case, device: str, outcome_of: OutcomeOf) -> None:
    """A failure that needs the input's (or the weight's) dtype may come with another dtype of that tensor
    (fp16 beside fp32) or with the other tensor's: that condition undone and each other dtype given to
    either tensor alone; those that fail too are named ("or with fp16 input")."""
    base = case.replace(input_dtype="bf16", weight_dtype="bf16")
    dtypes = {Operand.INPUT: INPUT_DTYPES, Operand.WEIGHT: WEIGHT_DTYPES}
    needed = [tensor for tensor in dtypes
              if Trigger(Condition.DTYPE, tensor, dtype=getattr(case, f"{tensor}_dtype")) in result.triggers]
    tried = [(Trigger(Condition.DTYPE, tensor, dtype=dtype, alternative=True),
              base.replace(**{f"{tensor}_dtype": dtype}))
             for tensor in dtypes if needed for dtype in dtypes[tensor]
             if dtype != "bf16" and not (tensor in needed and dtype == getattr(case, f"{tensor}_dtype"))]
    for trigger, other in tried:
        if plan.unsupported(other, torch.device(device).type) is None and outcome_of(other, device).fails:
            result.triggers.append(trigger)


def flip_conditions(result: Localization, case: Case, base: Outcome, device: str,
                    outcome_of: OutcomeOf, alignment: int = 16) -> tuple[list[Trigger], list[tuple[Case, Outcome]]]:
    """Each condition flipped alone: the numbers' triggers into `result`; returned, the crash's triggers
    and the cases that run without the crash (case, outcome)."""
    crash_triggers, running = [], []
    for trigger, flipped in conditions(case, alignment):
        outcome = outcome_of(flipped, device)
        if not outcome.fails:
            result.triggers.append(trigger)
        elif base.crashed and not outcome.crashed:
            crash_triggers.append(trigger)
            running.append((flipped, outcome))
    if base.crashed:  # an axis that does not follow a .t() raises unless two dims are equal, and is wrong there
        kn, mk = max(case.K, case.N), max(case.M, case.K)  # the larger: more than one scale block along each
        square = [(Trigger(Condition.K_NOT_N), case.replace(K=kn, N=kn))] + \
                 ([(Trigger(Condition.M_NOT_K), case.replace(lead=(mk,), K=mk))] if len(case.lead) == 1 else [])
        for trigger, flipped in square:
            outcome = outcome_of(flipped, device) if flipped != case else None
            if outcome is not None and outcome.fails and not outcome.crashed:
                crash_triggers.append(trigger)
                running.append((flipped, outcome))
    return crash_triggers, running
