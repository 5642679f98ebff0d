"""`fp8-parity bench` (forward+backward time of each implementation on a GPU) and `fp8-parity
throughput` (cases per second of the harness itself)."""

from __future__ import annotations

import json
import sys

import pandas as pd
import torch

from parity import cmd_inputs
from parity.bench import DEFAULT_IMPLS, PRESETS, NoGPUError, bench_verdict, run_bench, write_bench_report
from parity.exits import EXIT_FAIL, EXIT_PASS, CannotRun
from parity.impls import load_impl
from parity.progress import Progress
from parity.results_file import EARLIER_REPORT
from parity.throughput import measure
from parity.worker import Died, Worker


def cmd_bench(args) -> int:
    if not torch.cuda.is_available():  # before anything is printed or created
        raise CannotRun("no CUDA device is available: bench measures GPU kernels (there is no CPU benchmark)")
    impls = [load_impl(name) for name in args.impl or DEFAULT_IMPLS]
    presets = [PRESETS[name] for name in dict.fromkeys(args.preset or ["small"])]
    modes = {"both": (False, True), "off": (False,), "on": (True,)}[args.compile]
    out = args.out or cmd_inputs.default_report_dir()
    cmd_inputs.report_folder(out, "--out", force=None, protected=EARLIER_REPORT)
    names = "+".join(p.name for p in presets)
    print(f"fp8-parity bench: preset {names}, {sum(len(p.shapes) for p in presets)} shapes x {len(impls)} "
          f"implementations x {len(modes)} compile modes", file=sys.stderr)
    try:
        out.mkdir(parents=True, exist_ok=True)
        if any(impl.remote for impl in impls):
            frame = _bench_in_worker(args, presets, impls, modes)
        else:
            with Progress(not args.quiet, "configurations") as progress:
                frame = run_bench(presets, impls, compile_modes=modes, device=args.device, warmup=args.warmup,
                                  iters=args.iters, progress=progress, checkpoint=out / "partial.csv")
    except NoGPUError as err:
        raise CannotRun(str(err)) from None
    judged = bench_verdict(frame, candidate=impls[0].name)
    written = write_bench_report(frame, out, title=f"fp8-parity bench: {names} on {frame.attrs['env']['gpu']}",
                                 verdict=judged)
    (out / "partial.csv").unlink(missing_ok=True)  # the complete table is written
    print(judged.headline)
    print(f"report: {out}/summary.md ({len(written)} files, {frame.attrs['env']['seconds']} s)")
    return EXIT_PASS if judged.ok else EXIT_FAIL


def cmd_throughput(args) -> int:
    device = cmd_inputs.device(args.device)
    result = measure(device=device, workers=args.workers, cases=args.cases)
    print(f"{result['cases_per_second']} cases/s: {result['cases']} small cases (candidate fp8_impl, torchao "
          f"reference, exact emulation, metrics, policy) in {result['seconds']} s on {device} with "
          f"{result['workers']} worker(s)")
    if result["phase_share"]:
        print("host time per phase: " + ", ".join(f"{k} {v:.0%}" for k, v in result["phase_share"].items()))
    return EXIT_PASS


def _bench_in_worker(args, presets, impls, modes) -> pd.DataFrame:
    """run_bench in a CUDA worker (parity.worker): the code under test is timed there, never imported here.
    The table comes back as plain data; no partial table or progress (the worker runs it whole)."""
    print("fp8-parity bench: code under test is timed in a worker process (no progress until it ends)", file=sys.stderr)
    with Worker("cuda") as runner:
        measured = runner.call(_bench_here, [p.name for p in presets], [impl.name for impl in impls], modes,
                               args.device, args.warmup, args.iters)
    if isinstance(measured, Died):
        raise CannotRun(f"the benchmark's worker did not finish: {measured.message}")
    if not (isinstance(measured, dict) and isinstance(measured.get("records"), list)
            and isinstance(measured.get("env"), dict)):
        raise CannotRun("the benchmark's worker sent back no table: the code under test tampered with the worker")
    frame = pd.DataFrame.from_records(measured["records"])
    frame.attrs["env"] = measured["env"]
    return frame


def _bench_here(preset_names: list[str], impl_names: list[str], modes, device: str, warmup, iters) -> dict:
    """In a worker: run_bench, its table as plain data."""
    frame = run_bench([PRESETS[name] for name in preset_names], [load_impl(name) for name in impl_names],
                      compile_modes=modes, device=device, warmup=warmup, iters=iters)
    # through JSON: plain Python values (numpy's int64 and bool_ are not plain data; NaN becomes None)
    return dict(records=json.loads(frame.to_json(orient="records")),
                env=json.loads(json.dumps(frame.attrs["env"], default=str)))
