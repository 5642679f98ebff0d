"""`fp8-parity sweep`: error tables of many implementations on a preset's named shapes and samples,
written as a report; an interrupted sweep keeps its rows and resumes (parity.sweep_resume)."""

from __future__ import annotations

import dataclasses
import sys

import torch

from parity import cmd_inputs
from parity.exits import EXIT_FAIL, EXIT_PASS, EXIT_SIGNAL, UsageError, interrupted_by
from parity.impls import load_impl
from parity.outputs import OutputLock
from parity.progress import Progress
from parity.report import verdict, write_report
from parity.results_file import EARLIER_REPORT
from parity.sweep import (DEFAULT_IMPLS, PRESETS, SweepInterrupted, accuracy_by_recipe, named_shape_table,
                          run_sweep, run_sweep_sharded, sweep_comparisons)
from parity.sweep_resume import PARTIAL_TABLE, discard_partial, load_partial, save_partial, sweep_arguments


def cmd_sweep(args) -> int:
    device = cmd_inputs.device(args.device, args.cpu_gemm)
    impl_names = args.impl or list(DEFAULT_IMPLS)
    if args.resume and args.out is None:
        raise UsageError("--resume needs --out DIR, the directory of the interrupted sweep")
    out = args.out or cmd_inputs.default_report_dir()
    cmd_inputs.report_folder(out, "--out", force=args.force, protected=_protected(args.resume))
    impls = [load_impl(name, time_limit=args.timeout) for name in impl_names]
    comparisons = sweep_comparisons(impls, device, accuracy_only=args.accuracy_only)
    if not comparisons:
        raise UsageError(f"--impl {' --impl '.join(impl_names)}: nothing to compare: fp64 is the reference every "
                         f"implementation is measured against, and no other reference applies; add an "
                         f"implementation (e.g. --impl fp8_impl)")
    preset = PRESETS[args.preset]
    if args.samples is not None:
        preset = dataclasses.replace(preset, samples=args.samples,
                                     cpu=preset.cpu and dataclasses.replace(preset.cpu, samples=None))
    cases = preset.cases(device, seed=args.seed, alignment=max(impl.recipe.alignment for impl in impls))
    gpus = _gpus(args, device)
    arguments = sweep_arguments(args, impl_names)
    with OutputLock(out):
        done = load_partial(out, arguments) if args.resume else None
        print(f"fp8-parity sweep: preset {preset.name} on {device}: {preset.describe(device)}; {len(cases)} cases x "
              f"{len(impls)} implementations"
              + (f"; resuming after {len(set(zip(done['shape'], done['case_id'])))} cases done" if done is not None
                 else ""),
              file=sys.stderr)
        if gpus > 1:
            frame = run_sweep_sharded(cases, impl_names, devices=[f"cuda:{i}" for i in range(gpus)])
        else:
            try:
                with Progress(not args.quiet, "cases") as progress:
                    frame = run_sweep(cases, comparisons, device=device, progress=progress, time_limit=args.timeout,
                                      done=done, checkpoint=lambda part: save_partial(part, out, arguments, "running"))
            except SweepInterrupted as stop:
                return _interrupted(stop, args, out, arguments)
        judged = verdict(frame, candidate=impls[0].name)
        frame.attrs["env"]["cases"] = preset.describe(device)  # the report says which shapes ran, and why
        written = write_report(frame, out, title=f"fp8-parity sweep: {preset.name} preset on {device}",
                               candidate=impls[0].name, verdict=judged,
                               extra_tables={"by named shape": named_shape_table(frame, candidate=impls[0].name),
                                             "Median SQNR against fp64 (dB) on the named shapes, by recipe and data":
                                                 accuracy_by_recipe(frame)})
        discard_partial(out)  # the complete table is written
    print(judged.headline)
    if judged.next_step:
        print(f"next: {judged.next_step}  ({judged.NEXT_STEP_WHY})")
    print(f"report: {out}/summary.md ({len(written)} files, {frame.attrs['env']['seconds']} s)")
    return EXIT_PASS if judged.ok else EXIT_FAIL


def _protected(resume: bool) -> dict[str, str]:
    """What a sweep's --out must not hold, unless --force: an earlier run's report, and (without --resume)
    an interrupted sweep's rows, which a new sweep would replace."""
    protected = dict(EARLIER_REPORT)
    if not resume:
        protected[PARTIAL_TABLE] = "the rows of an interrupted sweep (--resume continues it)"
    return protected


def _gpus(args, device: str) -> int:
    """The workers the cases are split over: --gpus, capped at the GPUs present (one on the CPU)."""
    gpus = min(args.gpus, torch.cuda.device_count()) if device == "cuda" else 1
    if args.gpus > 1 and gpus < args.gpus:
        print(f"fp8-parity sweep: --gpus {args.gpus}, but {gpus or 'no'} GPU(s) here: using {max(gpus, 1)} worker",
              file=sys.stderr)
    if args.resume and gpus > 1:
        raise UsageError("--resume runs on one device: leave out --gpus")
    return gpus


def _interrupted(stop: SweepInterrupted, args, out, arguments: dict) -> int:
    """Keep the rows of an interrupted sweep and say how to continue it."""
    by = interrupted_by(stop.cause)
    save_partial(stop.frame, out, arguments, by.name)
    command = " ".join(["fp8-parity", "sweep", *sys.argv[2:]] if "--resume" in sys.argv else
                       ["fp8-parity", "sweep", *sys.argv[2:], *([] if args.out else ["--out", str(out)]),
                        "--resume"])
    print(f"fp8-parity sweep: interrupted by {by.name} after {stop.frame.attrs['done']} of "
          f"{stop.frame.attrs['planned']} cases; their rows are in {out / PARTIAL_TABLE} (`fp8-parity "
          f"report {out}` reads them); continue with: {command}", file=sys.stderr)
    return EXIT_SIGNAL[by]
