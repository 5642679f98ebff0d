"""`fp8-parity train`: lockstep training runs compared GEMM by GEMM (parity.train), each run in its own
worker process, and their report (parity.train_report). Exit 0 when parity and the loss hold, 1 for a
finding (a run that raised, died, ran out of time or changed torch's global state included), 2 for bad
usage, 4 when Ctrl-C or SIGTERM stopped training and the steps that finished hold no finding (their
report is headed INCOMPLETE)."""

from __future__ import annotations

import sys

from parity import cmd_inputs
from parity.exits import UsageError
from parity.model import ModelError
from parity.outputs import OutputLock
from parity.progress import Progress
from parity.train import run_training
from parity.train_plan import TrainError, TrainPlan
from parity.train_report import write_train_report
from parity.train_verdict import exit_code


def cmd_train(args) -> int:
    device = cmd_inputs.device(args.device, args.cpu_gemm)
    out = args.out or cmd_inputs.default_report_dir()
    cmd_inputs.writable_dir(out, "--out")
    try:
        plan = TrainPlan(args.impl, against=args.against, baseline=args.baseline, model=args.model, steps=args.steps,
                         device=device, seed=args.seed, sample_every=args.sample_every, window=args.window,
                         lr=args.lr, form=args.form, recipe=args.recipe, grad_accum=args.grad_accum,
                         checkpoint=args.checkpoint, data=None if args.data is None else str(args.data))
        options = "".join([f", {plan.grad_accum} micro-batches a step" if plan.grad_accum > 1 else "",
                           ", activation checkpointing" if plan.checkpoint else "",
                           f", data {plan.data}" if plan.data else ""])
        print(f"fp8-parity train: {args.impl} on the {plan.model} model, {plan.steps} steps on {device}{options}",
              file=sys.stderr)
        with OutputLock(out):
            with Progress(not args.quiet, "steps") as progress:
                result = run_training(plan, out_dir=out, progress=progress, timeout=args.timeout)
            write_train_report(result, out)
    except (TrainError, ModelError) as err:
        raise UsageError(str(err)) from None
    judged = result.verdict
    print(judged.headline)
    for line in judged.details:
        print(f"  {line}")
    if judged.next_step:
        print(f"next: {judged.next_step}  ({judged.NEXT_STEP_WHY})")
    seconds_per_step = result.frame.attrs["env"].get("seconds_per_step")
    print(f"report: {out}/summary.md ({result.seconds:.1f} s"
          + (f", {seconds_per_step:.3f} s per step" if seconds_per_step is not None else "") + ")")
    return exit_code(result)
