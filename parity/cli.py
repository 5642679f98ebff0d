"""`fp8-parity`: argument parsing only; each command calls the modules that do the work.

Exit codes (all commands): 0 success / parity holds, 1 a violation was found, 2 bad usage
or input, 125 cannot run here (e.g. a GPU-only command without a GPU). 125 is what
`git bisect run` reads as "skip this commit".
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

from parity.cases import CaseError, parse_case_id
from parity.history import HistoryError
from parity.impls import BUILTIN_HELP, Form, ImplError, load_impl
from parity.policy import Policy
from parity.recipes import FP8_RECIPES, RecipeError

EXIT_PASS, EXIT_FAIL, EXIT_USAGE, EXIT_CANNOT_RUN = 0, 1, 2, 125


class UsageError(Exception):
    """Bad input from the user: printed as one clear message, exit 2."""


class CannotRun(Exception):
    """The command cannot run on this machine (no GPU, ...): one clear message, exit 125."""


def _device(requested: str) -> str:
    """The device to run on (cuda if present for "auto"), or CannotRun with the reason."""
    from parity.check import resolve_device
    device, reason = resolve_device(requested)
    if device is None:
        raise CannotRun(reason)
    return device


def _impl_arg(parser: argparse.ArgumentParser, *, default: str | None, help_prefix: str) -> None:
    names = ", ".join(BUILTIN_HELP)
    parser.add_argument("--impl", default=default, required=default is None, metavar="IMPL",
                        help=f"{help_prefix}: a built-in ({names}), package.module:attr or path/to/file.py:attr")


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                        help="where to run (default: cuda if a GPU is present, else cpu)")
    parser.add_argument("--form", choices=[f.value for f in Form], default=None,
                        help="override the detected form of --impl")
    parser.add_argument("--recipe", default=None, choices=None, metavar="RECIPE",
                        help=f"the recipe --impl implements ({', '.join(FP8_RECIPES)}; default tensorwise for your "
                             f"own code; for fp8_impl and emulated it picks theirs); decides the oracle, the policy "
                             f"and which case dims are valid")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fp8-parity", description="Numerical parity and accuracy harness for FP8 training in PyTorch.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.required = True

    check = commands.add_parser("check", help="search for a parity violation of an implementation",
                                description="Compare an FP8 implementation with a reference, forward and backward, "
                                            "on pinned edge cases and hypothesis-generated cases; shrink a failure "
                                            "to a minimal case.")
    _impl_arg(check, default=None, help_prefix="implementation under test")
    check.add_argument("--against", default=None, metavar="REF",
                       help="reference implementation (default: the recipe's: torchao's implementation of it, or "
                            "its exact emulation where torchao has none here; fp64 for a high-precision one)")
    _common(check)
    check.add_argument("--max-examples", type=int, default=100, help="hypothesis cases to try (default 100)")
    check.add_argument("--max-dim", type=int, default=256, help="largest K and N generated (default 256)")
    check.add_argument("--case", action="append", default=None, metavar="CASE_ID",
                       help="run exactly this case (repeatable) instead of searching")
    check.add_argument("--policy", choices=[p.value for p in Policy], default=None,
                       help="override the parity policy (default: chosen from the recipes)")
    check.add_argument("--no-oracle", action="store_true", help="do not also run the exact emulation")
    check.add_argument("--seed", type=int, default=0, help="seed of the search (default 0)")
    check.add_argument("--json", type=Path, default=None, metavar="PATH", help="write the result as JSON")
    check.add_argument("--quiet", action="store_true", help="no progress line")

    from parity.sweep import DEFAULT_IMPLS, PRESETS
    sweep = commands.add_parser("sweep", help="error tables of many implementations on named shapes and samples",
                                description="Run implementations against fp64 and torchao tensorwise on a preset's "
                                            "named layer shapes plus a hypothesis sample; write a report. Exit 1 "
                                            "when the candidate (first --impl) loses parity anywhere.")
    sweep.add_argument("--impl", action="append", default=None, metavar="IMPL",
                       help=f"implementations (repeatable; default: {', '.join(DEFAULT_IMPLS)}); the first is the "
                            f"candidate whose parity decides the exit code")
    sweep.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                       help="default: cuda if a GPU is present, else cpu")
    sweep.add_argument("--preset", choices=list(PRESETS), default="quick",
                       help="; ".join(f"{p.name}: {p.description}" for p in PRESETS.values()))
    sweep.add_argument("--out", type=Path, default=None, help="report directory (default reports/<timestamp>/)")
    sweep.add_argument("--samples", type=int, default=None, help="override the preset's number of sampled cases")
    sweep.add_argument("--gpus", type=int, default=1,
                       help="split the cases over this many GPUs, one process each (default 1; capped at the GPUs "
                            "present; on the CPU one worker)")
    sweep.add_argument("--accuracy-only", action="store_true",
                       help="compare with fp64 only (no parity reference, no exact emulation): SQNR tables of "
                            "large layers")
    sweep.add_argument("--seed", type=int, default=0)
    sweep.add_argument("--quiet", action="store_true", help="no progress bar")

    bisect = commands.add_parser("bisect", help="localize a failing implementation: GEMM, operand, bug class, trigger",
                                 description="Find a minimal failing case and localize the bug: which GEMM, which "
                                             "operand, which bug class, under which conditions, with evidence. "
                                             "With --git GOOD BAD: the first bad commit of a repository.")
    _impl_arg(bisect, default=None, help_prefix="implementation to localize")
    bisect.add_argument("--against", default=None, metavar="REF",
                        help="reference (default: the recipe's, as for check)")
    _common(bisect)
    bisect.add_argument("--case", default=None, metavar="CASE_ID", help="localize on this failing case")
    bisect.add_argument("--max-examples", type=int, default=100, help="search budget for a failing case")
    bisect.add_argument("--git", nargs=2, metavar=("GOOD", "BAD"), default=None,
                        help="git bisect the repository in the current directory between two commits, with "
                             "`fp8-parity check --impl IMPL` as the test")
    bisect.add_argument("--json", type=Path, default=None, metavar="PATH", help="write the result as JSON")

    from parity.bench import DEFAULT_IMPLS as BENCH_IMPLS, PRESETS as BENCH_PRESETS
    bench = commands.add_parser("bench", help="fwd+bwd time, TFLOP/s, memory and roofline fraction on the GPU",
                                description="Time forward+backward of a linear layer per implementation and shape, "
                                            "eager and torch.compile'd, on a CUDA GPU; report speedups vs torchao "
                                            "tensorwise and bf16 and the fraction of a limit measured in the same "
                                            "run. Exit 1 when a configuration failed, 125 without an FP8 GPU.")
    bench.add_argument("--impl", action="append", default=None, metavar="IMPL",
                       help=f"implementations (repeatable; default: {', '.join(BENCH_IMPLS)}); the first is the "
                            f"candidate of the headline")
    bench.add_argument("--preset", action="append", choices=list(BENCH_PRESETS), default=None,
                       help="repeatable (default: small); " + "; ".join(
                           f"{p.name}: {p.description}, {len(p.shapes)} shapes" for p in BENCH_PRESETS.values()))
    bench.add_argument("--compile", choices=["both", "on", "off"], default="both",
                       help="time eager, torch.compile'd or both (default both; compiling dominates the run time)")
    bench.add_argument("--device", choices=["cuda"], default="cuda", help="the GPU (there is no CPU benchmark)")
    bench.add_argument("--warmup", type=int, default=None, help="untimed iterations (default: the preset's)")
    bench.add_argument("--iters", type=int, default=None, help="timed iterations (default: the preset's)")
    bench.add_argument("--out", type=Path, default=None, help="report directory (default reports/<timestamp>/)")
    bench.add_argument("--quiet", action="store_true", help="no progress bar")

    throughput = commands.add_parser("throughput", help="cases per second of the harness itself (small shapes)")
    throughput.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    throughput.add_argument("--workers", type=int, default=1, help="processes sharing the device (default 1)")
    throughput.add_argument("--cases", type=int, default=300, help="small cases to run (default 300)")

    report = commands.add_parser("report", help="re-render a report from a stored results table")
    report.add_argument("results", type=Path, help="results.csv.gz (or .csv/.parquet) or a report directory")
    report.add_argument("--out", type=Path, default=None, help="report directory (default: next to RESULTS)")
    report.add_argument("--candidate", default="fp8_impl", help="whose parity the verdict judges")

    diff = commands.add_parser("diff", help="compare two result sets: what moved beyond noise",
                               description="Compare two results tables (two torch versions, two commits) case by "
                                           "case; list the cases and tensors whose metrics moved beyond noise.")
    diff.add_argument("a", type=Path, help="results table or report directory (before)")
    diff.add_argument("b", type=Path, help="results table or report directory (after)")
    diff.add_argument("--sqnr-tolerance", type=float, default=0.1, help="dB an SQNR may move (default 0.1)")
    diff.add_argument("--csv", type=Path, default=None, help="also write the moves as CSV")
    return parser


def _progress(enabled: bool):
    if not enabled or not sys.stderr.isatty():
        return None

    def show(done: int, total: int) -> None:
        sys.stderr.write(f"\r  {done} cases run (search budget {total})")
        sys.stderr.flush()
    return show


def _progress_bar(enabled: bool, what: str = "cases"):
    """A one-line progress bar on stderr (a line every 10% when stderr is not a terminal)."""
    if not enabled:
        return None
    tty, last = sys.stderr.isatty(), {"decile": -1}

    def show(done: int, total: int, elapsed: float) -> None:
        left = elapsed / done * (total - done) if done else 0.0
        bar = "#" * int(30 * done / total)
        line = f"  [{bar:<30}] {done}/{total} {what}, {elapsed:.0f} s elapsed, ~{left:.0f} s left"
        if tty:
            sys.stderr.write("\r" + line + ("\n" if done == total else ""))
        elif done * 10 // total != last["decile"]:
            last["decile"] = done * 10 // total
            sys.stderr.write(line + "\n")
        sys.stderr.flush()
    return show


def _default_report_dir() -> Path:
    import datetime
    return Path("reports") / datetime.datetime.now().strftime("%Y%m%d-%H%M%S")


def cmd_sweep(args) -> int:
    from parity.report import verdict, write_report
    from parity.sweep import (DEFAULT_IMPLS, PRESETS, accuracy_by_recipe, named_shape_table, run_sweep,
                              run_sweep_sharded, sweep_comparisons)

    device = _device(args.device)
    impl_names = args.impl or list(DEFAULT_IMPLS)
    impls = [load_impl(name) for name in impl_names]
    preset = PRESETS[args.preset]
    if args.samples is not None:
        preset = dataclasses.replace(preset, samples=args.samples)
    cases = preset.cases(device, seed=args.seed, alignment=max(impl.recipe.alignment for impl in impls))
    out = args.out or _default_report_dir()
    print(f"fp8-parity sweep: preset {preset.name} ({preset.description}), {len(cases)} cases x "
          f"{len(impls)} implementations on {device}", file=sys.stderr)
    gpus = min(args.gpus, torch.cuda.device_count()) if device == "cuda" else 1
    if args.gpus > 1 and gpus < args.gpus:
        print(f"fp8-parity sweep: --gpus {args.gpus}, but {gpus or 'no'} GPU(s) here: using {max(gpus, 1)} worker",
              file=sys.stderr)
    if gpus > 1:
        frame = run_sweep_sharded(cases, impl_names, devices=[f"cuda:{i}" for i in range(gpus)])
    else:
        frame = run_sweep(cases, sweep_comparisons(impls, device, accuracy_only=args.accuracy_only), device=device,
                          progress=_progress_bar(not args.quiet))
    judged = verdict(frame, candidate=impls[0].name)
    written = write_report(frame, out, title=f"fp8-parity sweep: {preset.name} preset on {device}",
                           candidate=impls[0].name, verdict=judged,
                           extra_tables={"by named shape": named_shape_table(frame, candidate=impls[0].name),
                                         "Median SQNR against fp64 (dB) on the named shapes, by recipe and data":
                                             accuracy_by_recipe(frame)})
    print(judged.headline)
    print(f"report: {out}/summary.md ({len(written)} files, {frame.attrs['env']['seconds']} s)")
    return EXIT_PASS if judged.ok else EXIT_FAIL


def cmd_bisect(args) -> int:
    from parity.check import CheckPlan

    device = _device(args.device)
    if args.git:
        from parity.history import git_bisect
        found = git_bisect(args.git[0], args.git[1], impl=args.impl, against=args.against, device=device,
                           max_examples=args.max_examples)
        print(found.render(), end="")
        if args.json:
            args.json.write_text(json.dumps(found.to_json(), indent=2) + "\n")
        return EXIT_FAIL if found.first_bad else EXIT_PASS
    from parity.bisect import localize, render
    plan = CheckPlan.make(load_impl(args.impl, form=args.form, recipe=args.recipe),
                          load_impl(args.against) if args.against else None, device=device)
    result = localize(plan, device=device, case=parse_case_id(args.case) if args.case else None,
                      max_examples=args.max_examples)
    print(render(result), end="")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result.to_json(), indent=2) + "\n")
    return {"pass": EXIT_PASS, "fail": EXIT_FAIL, "error": EXIT_CANNOT_RUN}[result.verdict]


def cmd_throughput(args) -> int:
    from parity.throughput import measure

    device = _device(args.device)
    result = measure(device=device, workers=args.workers, cases=args.cases)
    print(f"{result['cases_per_second']} cases/s: {result['cases']} small cases (candidate fp8_impl, torchao "
          f"reference, exact emulation, metrics, policy) in {result['seconds']} s on {device} with "
          f"{result['workers']} worker(s)")
    if result["phase_share"]:
        print("host time per phase: " + ", ".join(f"{k} {v:.0%}" for k, v in result["phase_share"].items()))
    return EXIT_PASS


def cmd_bench(args) -> int:
    from parity.bench import DEFAULT_IMPLS, PRESETS, NoGPUError, bench_verdict, run_bench, write_bench_report

    impls = [load_impl(name) for name in args.impl or DEFAULT_IMPLS]
    presets = [PRESETS[name] for name in dict.fromkeys(args.preset or ["small"])]
    modes = {"both": (False, True), "off": (False,), "on": (True,)}[args.compile]
    out = args.out or _default_report_dir()
    names = "+".join(p.name for p in presets)
    print(f"fp8-parity bench: preset {names}, {sum(len(p.shapes) for p in presets)} shapes x {len(impls)} "
          f"implementations x {len(modes)} compile modes", file=sys.stderr)
    try:
        out.mkdir(parents=True, exist_ok=True)
        frame = run_bench(presets, impls, compile_modes=modes, device=args.device, warmup=args.warmup,
                          iters=args.iters, progress=_progress_bar(not args.quiet, "configurations"),
                          checkpoint=out / "partial.csv")
    except NoGPUError as err:
        raise CannotRun(str(err)) from None
    judged = bench_verdict(frame, candidate=impls[0].name)
    written = write_bench_report(frame, out, title=f"fp8-parity bench: {names} on {frame.attrs['env']['gpu']}",
                                 verdict=judged)
    (out / "partial.csv").unlink(missing_ok=True)  # the complete table is written
    print(judged.headline)
    print(f"report: {out}/summary.md ({len(written)} files, {frame.attrs['env']['seconds']} s)")
    return EXIT_PASS if judged.ok else EXIT_FAIL


def cmd_report(args) -> int:
    from parity.report import verdict, write_report

    frame = _read(args.results)
    out = args.out or (args.results if args.results.is_dir() else args.results.parent)
    judged = verdict(frame, candidate=args.candidate)
    write_report(frame, out, candidate=args.candidate, verdict=judged)
    print(judged.headline)
    print(f"report: {out}/summary.md")
    return EXIT_PASS


def _read(path: Path):
    from parity.report import read_results
    if not path.exists():
        raise UsageError(f"{path} does not exist (give a results.csv.gz or a report directory)")
    try:
        return read_results(path)
    except (ValueError, OSError) as err:
        raise UsageError(f"cannot read results from {path}: {err}") from None


def cmd_diff(args) -> int:
    from parity.report import diff_results, render_diff

    moves = diff_results(_read(args.a), _read(args.b), sqnr_tolerance_db=args.sqnr_tolerance)
    print(render_diff(moves))
    if args.csv:
        moves.to_csv(args.csv, index=False)
    return EXIT_PASS if moves.empty else EXIT_FAIL


def cmd_check(args) -> int:
    from parity.check import CheckPlan, render, rerun_command, run_check

    device = _device(args.device)
    candidate = load_impl(args.impl, form=args.form, recipe=args.recipe)
    reference = load_impl(args.against) if args.against else None
    cases = [parse_case_id(c) for c in args.case] if args.case else None
    plan = CheckPlan.make(candidate, reference, policy=args.policy, oracle=not args.no_oracle, device=device)
    extra = [*(["--form", args.form] if args.form else []), *(["--recipe", args.recipe] if args.recipe else []),
             *(["--policy", args.policy] if args.policy else [])]
    result = run_check(plan, device=device, max_examples=args.max_examples, cases=cases, max_dim=args.max_dim,
                       seed=args.seed, rerun_command=rerun_command(args.impl, plan.reference.name, device, extra),
                       progress=_progress(not args.quiet))
    if not args.quiet and sys.stderr.isatty():
        sys.stderr.write("\n")
    print(render(result), end="")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result.to_json(), indent=2) + "\n")
    return {"pass": EXIT_PASS, "fail": EXIT_FAIL, "error": EXIT_CANNOT_RUN}[result.verdict]


COMMANDS = {"check": cmd_check, "sweep": cmd_sweep, "bisect": cmd_bisect, "bench": cmd_bench,
            "throughput": cmd_throughput,
            "report": cmd_report, "diff": cmd_diff}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except (ImplError, CaseError, UsageError, HistoryError, RecipeError) as err:
        print(f"fp8-parity {args.command}: {err}", file=sys.stderr)
        return EXIT_USAGE
    except CannotRun as err:
        print(f"fp8-parity {args.command}: cannot run here: {err}", file=sys.stderr)
        return EXIT_CANNOT_RUN


if __name__ == "__main__":
    sys.exit(main())
