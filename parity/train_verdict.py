"""The verdict of `fp8-parity train`, made in the process that judges from what the runs' workers
sent: the loss table, and parity (bitwise while the recipes agree), the loss gap, a crash or death,
changes to torch's global state, and an interrupted run's INCOMPLETE heading."""

from __future__ import annotations

import math

import pandas as pd

from parity.exits import EXIT_FAIL, EXIT_INCOMPLETE, EXIT_PASS
from parity.report_verdict import Verdict
from parity.train_calls import bisect_command
from parity.train_plan import DEEPSEEK_RELATIVE_LOSS_GAP, ROLES, TrainResult


def losses_per_step(frame: pd.DataFrame) -> pd.DataFrame:
    """One row per (step, role) of the tidy table: the loss, seed and sampling of each run's step."""
    return frame.drop_duplicates(["step", "role"])


def steps_done(result: TrainResult) -> int:
    """The steps every run finished (all of them, unless a crash or an interrupt stopped training)."""
    return int(result.frame["step"].max()) + 1 if len(result.frame) else 0


def loss_window(result: TrainResult) -> int:
    """The steps at the end whose mean loss is judged: the plan's window, or all the steps that ran
    when an interrupted run has fewer."""
    return min(result.plan.loss_window, max(1, steps_done(result)))


def loss_table(result: TrainResult) -> pd.DataFrame:
    """Per run: mean loss over the last `window` steps, its relative gap to the baseline, its excess over
    the source's entropy rate (the floor; none for --data)."""
    frame, window = result.frame, loss_window(result)
    steps = losses_per_step(frame)
    last = steps[steps["step"] >= steps_done(result) - window]
    mean = last.groupby("role", sort=False)["loss"].mean()
    floor = math.nan if result.source.entropy_rate is None else result.source.entropy_rate
    records = [dict(role=role, impl=result.runs[role], seed=int(steps[steps["role"] == role]["seed"].iloc[0]),
                    **{f"mean loss, last {window} steps": mean[role],
                       "gap to baseline %": 100 * (mean[role] - mean["baseline"]) / mean["baseline"],
                       "excess over floor": mean[role] - floor})
               for role in ROLES]
    return pd.DataFrame.from_records(records)


def train_verdict(result: TrainResult) -> Verdict:
    """The verdict of the steps that ran; an interrupted run's is headed INCOMPLETE (and is no pass)."""
    judged = _complete_verdict(result)
    if result.interrupted is None:
        return judged
    heading = (f"INCOMPLETE: interrupted by {result.interrupted} after {steps_done(result)} of {result.plan.steps} "
               f"steps; the report holds the steps that finished. ")
    if not len(result.frame) and result.crash is None and not result.state_changes:
        return Verdict(False, heading + "Nothing was judged.", [], None)
    return Verdict(False, heading + "Among the steps that ran: " + judged.headline, judged.details, judged.next_step)


def _complete_verdict(result: TrainResult) -> Verdict:
    plan, details = result.plan, []
    changed = [f"{line}: a finding (training cannot be trusted to run under other rules)"
               for line in result.state_changes]
    if result.crash is not None or not len(result.frame):
        done = steps_done(result)
        what = result.crash or "nothing ran"
        return Verdict(False, f"FAIL: {what}", [f"training stopped there, after {done} complete steps", *changed],
                       None)
    table = loss_table(result).set_index("role")
    window = loss_window(result)
    gap_column = "gap to baseline %"
    gap = table.loc["candidate", gap_column] / 100
    noise = abs(table.loc["baseline_seed", gap_column]) / 100
    allowed = max(noise, DEEPSEEK_RELATIVE_LOSS_GAP)
    loss_ok = gap <= allowed  # a candidate that trains better than the baseline is not a finding
    details.append(f"loss over the last {window} steps: {result.runs['candidate']} is "
                   f"{100 * gap:+.3f}% from {result.runs['baseline']}; seed-to-seed noise of the baseline "
                   f"{100 * noise:.3f}%, DeepSeek-V3's line 0.25%: allowed {100 * allowed:.3f}%")
    if result.source.entropy_rate is not None:
        details.append(f"the loss floor (the source's entropy rate) is {result.source.entropy_rate:.4f} nats; the "
                       f"candidate ends {table.loc['candidate', 'excess over floor']:.4f} above it")
    else:
        details.append(f"no loss floor: the data ({result.source.kind} from {result.source.path}) has no known "
                       f"entropy rate")
    if result.recompute_differs is not None:
        step, micro, layer = result.recompute_differs
        where = f"step {step}" + (f", micro-batch {micro}" if plan.grad_accum > 1 else "")
        details.append(f"under --checkpoint the candidate's recompute of {layer}'s output GEMM gives other bits than "
                       f"its forward first at {where}: its backward GEMMs consume tensors the forward never made "
                       f"(state advanced between the two calls)")
    details += changed
    parity_ok, pair = True, f"{result.runs['candidate']} and {result.runs['against']}"
    done = steps_done(result)
    if result.finding is not None:  # check's words for what the diverging (or first) GEMM was handed
        details.insert(0, f"finding: {result.finding}")
    if result.divergence is not None:
        parity_ok = not result.bitwise_required
        where = f" (case file: {result.divergence.case_file})" if result.divergence.case_file else ""
        details.insert(0, f"{pair} first differ at {result.divergence}{where}"
                       + ("" if result.bitwise_required else "; their recipes differ, so bitwise equality is not "
                          "required"))
    elif result.loss_differs_at is not None:
        parity_ok = not result.bitwise_required
        details.insert(0, f"every GEMM of {pair} agrees bitwise, but the loss differs from step "
                       f"{result.loss_differs_at}: outside the converted layers")
    else:
        calls = f" and all {plan.grad_accum} micro-batches of each" if plan.grad_accum > 1 else ""
        details.insert(0, f"{pair} are bitwise equal in every GEMM of every layer at all {done} steps{calls}")
    calls_differ = result.divergence is None and result.finding is not None  # parity.train_calls
    if calls_differ:
        parity_ok = False
        where = f" (case file: {result.calls_case_file})" if result.calls_case_file else ""
        details.insert(1, f"check's comparisons of the first layer's first call{where} find what the numbers here "
                          f"do not show")
    if result.state_changes:
        headline = f"FAIL: {result.state_changes[0]}"
    elif calls_differ:
        headline = (f"FAIL: {result.runs['candidate']}'s _scaled_mm calls are not the {_candidate_recipe(result)} "
                    f"recipe's, though it trains in bitwise lockstep with {result.runs['against']} on {plan.device}")
    elif not parity_ok:
        first = result.divergence or f"the loss at step {result.loss_differs_at}"
        headline = f"FAIL: {pair} must be bitwise equal and diverge first at {first}"
    elif not loss_ok:
        headline = (f"FAIL: {result.runs['candidate']} trains {100 * gap:.3f}% worse than {result.runs['baseline']} "
                    f"over the last {window} steps, beyond the allowed {100 * allowed:.3f}%")
    else:
        headline = (f"PASS: {result.runs['candidate']} trains {done} steps of the {plan.model} model "
                    + ("in bitwise lockstep with " + result.runs["against"] if result.divergence is None else
                       "(its recipe differs from " + result.runs["against"] + "'s)")
                    + f", within {100 * allowed:.3f}% of {result.runs['baseline']}'s loss")
    case_file = result.calls_case_file if calls_differ else result.divergence and result.divergence.case_file
    next_step = None
    if case_file is not None and not parity_ok:
        next_step = bisect_command(result.runs["candidate"], result.runs["against"], plan.device, case_file,
                                   recipe=plan.recipe, form=plan.form)
    ok = bool(parity_ok and loss_ok and not result.state_changes)
    return Verdict(ok, headline, details, next_step)


def _candidate_recipe(result: TrainResult) -> str:
    """The candidate's recipe, as its rows name it."""
    rows = result.frame[result.frame["role"] == "candidate"]
    return str(rows["recipe"].iloc[0]) if len(rows) else "its"


def exit_code(result: TrainResult) -> int:
    """0 pass, 1 a finding; an interrupted run: 1 when the steps that finished hold a finding, else 4
    (incomplete: not a pass)."""
    if result.interrupted is None:
        return EXIT_PASS if result.verdict.ok else EXIT_FAIL
    nothing_ran = not len(result.frame) and result.crash is None and not result.state_changes
    return EXIT_INCOMPLETE if nothing_ran or _complete_verdict(result).ok else EXIT_FAIL
