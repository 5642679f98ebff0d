"""`fp8-parity`: argument parsing only. One builder of arguments per command; `main` parses, runs
the command's body (parity.commands names the module of each) and maps what it raised to an exit
code (parity.exits lists them).

Every flag is validated before any work starts; a bad one is one line saying what, the value and the
fix. Exit codes (all commands): 0 success / parity holds, 1 a violation was found, 2 bad usage or
input, 3 an internal error of fp8-parity (one line; FP8_PARITY_TRACEBACK=1 shows the traceback), 4
`report` of an interrupted sweep's partial table, or of an unverified one (no seal), in which
nothing failed (not a pass: cases are missing, or may be), 125 cannot run here (e.g. a GPU-only
command without a GPU; what `git bisect run` reads as "skip this commit"), 130 / 143 interrupted by
SIGINT / SIGTERM.
"""

from __future__ import annotations

import argparse
import difflib
import math
import signal
import sys
import traceback
from pathlib import Path

# Standard library and torch-free modules only: `fp8-parity --help` and a mistyped flag are answered
# by the parser before anything heavy loads (with torch, torchao and pandas imported here they took
# 3.4-11 s; issue 28, item 7). The names the parser offers come from parity.names and
# parity.model_configs; a command's body imports the harness when it runs (parity.commands), and
# main imports the exceptions it maps to exit codes once the arguments have parsed.
# property_tests/test_cli_latency.py keeps it so.
from parity.commands import RUNS_YOUR_CODE, command
from parity.exits import (EXIT_CANNOT_RUN, EXIT_FAIL, EXIT_INCOMPLETE, EXIT_INTERNAL, EXIT_PASS, EXIT_SIGNAL,
                          EXIT_USAGE, TRACEBACK_ENV, CannotRun, UsageError, clear_stops, install_quiet_lost_connections,
                          interrupted_by, one_line, quiet_lost_stops, stop_on_signal, stopped_by, traceback_requested)
from parity.model_configs import MODELS
from parity.names import (BENCH_DEFAULT_IMPLS, BENCH_PRESET_DESCRIPTIONS, BENCH_PRESET_SHAPES, BISECT_SEARCH,
                          BUILTIN_HELP, BUILTIN_NAMES, CHECK_SEARCH, CPU_GEMM_MODES, DEFAULT_BASELINE,
                          DISTRIBUTED_MODES, FACTORY_PROTOCOL, FORMS, FP8_RECIPES, LEARNING_RATE, POLICIES,
                          SWEEP_DEFAULT_IMPLS, SWEEP_PRESET_DESCRIPTIONS)

# the exit codes, importable from here as from parity.exits (scripts and tests read them here)
__all__ = ["EXIT_CANNOT_RUN", "EXIT_FAIL", "EXIT_INCOMPLETE", "EXIT_INTERNAL", "EXIT_PASS", "EXIT_SIGNAL",
           "EXIT_USAGE", "build_parser", "main"]

class Parser(argparse.ArgumentParser):
    """argparse with one-line errors: what was wrong, the value, the fix; exit 2."""

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"{self.prog}: {message} (see {self.prog} --help)\n")


def _count(low: int, high: int, example: int):
    """An integer in [low, high] ("--max-examples 0" would run nothing and pass)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be an integer from {low} to {high}, got {text!r} (e.g. {example})")
        return value
    return parse


def _amount(low: float, high: float, example: str, *, low_open: bool = False):
    """A finite number in [low, high] (or (low, high]): a NaN tolerance would let everything through."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value > high or value < low or (low_open and value == low):
            bound = f"greater than {low:g}" if low_open else f"at least {low:g}"
            raise argparse.ArgumentTypeError(f"must be a finite number {bound} and at most {high:g}, got {text!r} "
                                             f"(e.g. {example})")
        return value
    return parse


def _timeout_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--timeout", type=_amount(0, 86400, "--timeout 300", low_open=True), default=None,
                        metavar="SECONDS",
                        help="time limit of one case, past which the implementation is stopped and the case is a "
                             "finding (default: 120 s plus the case's size at a pessimistic rate)")


def _implementation(value: str) -> str:
    """An --impl, --against or --baseline value: a built-in's name or a `module:attr` / `file.py:attr` spec. A name
    that is neither is refused here, before torch is imported (a typo answered in 0.1 s, not 4)."""
    name = value.strip()
    if ":" in name or name in BUILTIN_NAMES:
        return name
    close = difflib.get_close_matches(name, BUILTIN_NAMES, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    raise argparse.ArgumentTypeError(f"unknown implementation {name!r}: {hint}name a built-in (this command's --help "
                                     f"lists them) or 'package.module:attr' or 'path/to/file.py:attr'")


def _impl_arg(parser: argparse.ArgumentParser, *, default: str | None, help_prefix: str) -> None:
    names = ", ".join(BUILTIN_HELP)
    parser.add_argument("--impl", type=_implementation, default=default, required=default is None, metavar="IMPL",
                        help=f"{help_prefix}: a built-in ({names}), package.module:attr or path/to/file.py:attr")


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                        help="where to run (default: cuda if a GPU is present, else cpu)")
    parser.add_argument("--form", choices=list(FORMS), default=None,
                        help="override the detected form of --impl")
    parser.add_argument("--recipe", default=None, choices=None, metavar="RECIPE",
                        help=f"the recipe --impl implements ({', '.join(FP8_RECIPES)}; default tensorwise for your "
                             f"own code; for fp8_impl and emulated it picks theirs); decides the oracle, the policy "
                             f"and which case dims are valid")
    _cpu_gemm_arg(parser)


def _cpu_gemm_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cpu-gemm", choices=list(CPU_GEMM_MODES), default=None,
                        help="how a CPU computes every FP8 GEMM call, of your code and of the references alike: fast "
                             "(default: an fp32 matmul), hopper (as an H200 does, bit for bit: parity.hopper's model; "
                             "fast-accumulation and accumulation-order bugs show in the numbers; slower) or torch "
                             "(torch's own CPU kernel)")


def _force_arg(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("--force", action="store_true",
                        help=f"{what}; without it such a folder is refused, since the report's files (summary.md, "
                             f"index.html, env.json, results.csv.gz, the plots) would replace files of those names")


def _add_check(commands) -> None:
    check = commands.add_parser("check", help="search for a parity violation of an implementation",
                                description="Compare an FP8 implementation with a reference, forward and backward, "
                                            "on pinned edge cases and hypothesis-generated cases; shrink a failure "
                                            "to a minimal case.")
    _impl_arg(check, default=None, help_prefix="implementation under test")
    check.add_argument("--against", default=None, type=_implementation, metavar="REF",
                       help="reference implementation (default: the recipe's: torchao's implementation of it, or "
                            "its exact emulation where torchao has none here; fp64 for a high-precision one)")
    _common(check)
    check.add_argument("--max-examples", type=_count(1, 100_000, "--max-examples 100"), default=CHECK_SEARCH,
                       help=f"hypothesis cases to try (default {CHECK_SEARCH})")
    check.add_argument("--max-dim", type=_count(16, 16384, "--max-dim 256"), default=256,
                       help="largest M, K and N generated (default 256; the verdict says the largest that ran)")
    check.add_argument("--case", action="append", default=None, metavar="CASE_ID",
                       help="run exactly this case (repeatable) instead of searching")
    check.add_argument("--case-file", type=Path, default=None, metavar="PATH",
                       help="run exactly the tensors of this case file (`fp8-parity train` writes one where two runs "
                            "diverge) instead of searching")
    check.add_argument("--policy", choices=list(POLICIES), default=None,
                       help="override the parity policy (default: chosen from the recipes)")
    check.add_argument("--no-oracle", action="store_true", help="do not also run the exact emulation")
    check.add_argument("--seed", type=_count(0, 2**31 - 1, "--seed 0"), default=0,
                       help="seed of the search (default 0)")
    _timeout_arg(check)
    check.add_argument("--json", type=Path, default=None, metavar="PATH", help="write the result as JSON")
    check.add_argument("--results", type=Path, default=None, metavar="PATH",
                       help="also write every comparison's row (a results table, .csv.gz, as a sweep's: "
                            "`fp8-parity diff` compares two, say a CPU run under --cpu-gemm hopper and a GPU run)")
    check.add_argument("--quiet", action="store_true", help="no progress line")
    check.add_argument("--distributed", choices=list(DISTRIBUTED_MODES), default=None,
                       help="instead of searching cases: train a small MLP (parity.distributed.TrainSpec) under "
                            "this data-parallel wrapper on --world-size ranks (gloo on the CPU, nccl on GPUs, one GPU "
                            "a rank), --impl and --against in one launch, and require every step's loss and "
                            "gradients to be bitwise equal; exit 1 names the first differing step and parameter")
    check.add_argument("--world-size", type=_count(1, 64, "--world-size 2"), default=None, metavar="N",
                       help="ranks of --distributed (default 2)")


def _add_sweep(commands) -> None:
    sweep = commands.add_parser("sweep", help="error tables of many implementations on named shapes and samples",
                                description="Run implementations against fp64 and torchao tensorwise on a preset's "
                                            "named layer shapes plus a hypothesis sample; write a report. Exit 1 "
                                            "when the candidate (first --impl) loses parity anywhere.")
    sweep.add_argument("--impl", action="append", type=_implementation, default=None, metavar="IMPL",
                       help=f"implementations (repeatable; default: {', '.join(SWEEP_DEFAULT_IMPLS)}); the first is "
                            f"the candidate whose parity decides the exit code")
    sweep.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                       help="default: cuda if a GPU is present, else cpu")
    _cpu_gemm_arg(sweep)
    sweep.add_argument("--preset", choices=list(SWEEP_PRESET_DESCRIPTIONS), default="quick",
                       help="; ".join(f"{name}: {about}" for name, about in SWEEP_PRESET_DESCRIPTIONS.items()))
    sweep.add_argument("--out", type=Path, default=None, help="report directory (default reports/<timestamp>/)")
    sweep.add_argument("--samples", type=_count(0, 100_000, "--samples 20"), default=None,
                       help="override the preset's number of sampled cases")
    sweep.add_argument("--resume", action="store_true",
                       help="continue the interrupted sweep whose partial table is in --out (same arguments)")
    _timeout_arg(sweep)
    sweep.add_argument("--gpus", type=_count(1, 64, "--gpus 2"), default=1,
                       help="split the cases over this many GPUs, one process each (default 1; capped at the GPUs "
                            "present; on the CPU one worker)")
    sweep.add_argument("--accuracy-only", action="store_true",
                       help="compare with fp64 only (no parity reference, no exact emulation): SQNR tables of "
                            "large layers")
    sweep.add_argument("--seed", type=_count(0, 2**31 - 1, "--seed 0"), default=0)
    sweep.add_argument("--quiet", action="store_true", help="no progress bar")
    _force_arg(sweep, "write into --out though it holds files fp8-parity did not write, an earlier run's report or "
                      "an interrupted sweep's rows (without --resume: started over)")


def _add_bisect(commands) -> None:
    bisect = commands.add_parser("bisect", help="localize a failing implementation: GEMM, operand, bug class, trigger",
                                 description="Find a minimal failing case and localize the bug: which GEMM, which "
                                             "operand, which bug class, under which conditions, with evidence. "
                                             "With --git GOOD BAD: the first bad commit of a repository.")
    _impl_arg(bisect, default=None, help_prefix="implementation to localize")
    bisect.add_argument("--against", default=None, type=_implementation, metavar="REF",
                        help="reference (default: the recipe's, as for check)")
    _common(bisect)
    bisect.add_argument("--case", default=None, metavar="CASE_ID",
                        help="localize on this failing case (with --git: each commit's check runs only it)")
    bisect.add_argument("--case-file", type=Path, default=None, metavar="PATH",
                        help="localize on the tensors of this case file (written by `fp8-parity train`)")
    bisect.add_argument("--max-examples", type=_count(1, 100_000, "--max-examples 100"), default=None,
                        help=f"search budget for a failing case, after the edge cases (default {BISECT_SEARCH}; "
                             f"check's is {CHECK_SEARCH}; with --git, each commit's check: {CHECK_SEARCH})")
    _timeout_arg(bisect)
    bisect.add_argument("--git", nargs=2, metavar=("GOOD", "BAD"), default=None,
                        help="git bisect the repository in the current directory between two commits, with "
                             "`fp8-parity check --impl IMPL` as the test")
    bisect.add_argument("--json", type=Path, default=None, metavar="PATH", help="write the result as JSON")


def _add_bench(commands) -> None:
    bench = commands.add_parser("bench", help="fwd+bwd time, TFLOP/s, memory and roofline fraction on the GPU",
                                description="Time forward+backward of a linear layer per implementation and shape, "
                                            "eager and torch.compile'd, on a CUDA GPU; report speedups vs torchao "
                                            "tensorwise and bf16 and the fraction of a limit measured in the same "
                                            "run. Exit 1 when a configuration failed, 125 without an FP8 GPU.")
    bench.add_argument("--impl", action="append", type=_implementation, default=None, metavar="IMPL",
                       help=f"implementations (repeatable; default: {', '.join(BENCH_DEFAULT_IMPLS)}); the first is "
                            f"the candidate of the headline")
    bench.add_argument("--preset", action="append", choices=list(BENCH_PRESET_DESCRIPTIONS), default=None,
                       help="repeatable (default: small); " + "; ".join(
                           f"{name}: {about}, {BENCH_PRESET_SHAPES[name]} shapes"
                           for name, about in BENCH_PRESET_DESCRIPTIONS.items()))
    bench.add_argument("--compile", choices=["both", "on", "off"], default="both",
                       help="time eager, torch.compile'd or both (default both; compiling dominates the run time)")
    bench.add_argument("--device", choices=["cuda"], default="cuda", help="the GPU (there is no CPU benchmark)")
    bench.add_argument("--warmup", type=_count(0, 100_000, "--warmup 10"), default=None,
                       help="untimed iterations (default: the preset's)")
    bench.add_argument("--iters", type=_count(1, 100_000, "--iters 50"), default=None,
                       help="timed iterations (default: the preset's)")
    bench.add_argument("--out", type=Path, default=None, help="report directory (default reports/<timestamp>/)")
    bench.add_argument("--quiet", action="store_true", help="no progress bar")


def _add_throughput(commands) -> None:
    throughput = commands.add_parser("throughput", help="cases per second of the harness itself (small shapes)")
    throughput.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    throughput.add_argument("--workers", type=_count(1, 64, "--workers 2"), default=1,
                            help="processes sharing the device (default 1)")
    throughput.add_argument("--cases", type=_count(1, 1_000_000, "--cases 300"), default=300,
                            help="small cases to run (default 300)")


TRAIN_DESCRIPTION = (
    "Train a small GPT on a synthetic language (no download) with --impl, --against and --baseline in lockstep "
    "from the same weights and batches; compare every layer's three GEMMs bitwise at every call (every "
    "micro-batch under --grad-accum; under --checkpoint the backward GEMMs on the recompute's tensors), sample "
    "SQNR, amax, underflow and saturation, judge the loss against the baseline's seed-to-seed noise; save the "
    "first diverging GEMM as a case file for check and bisect; time every step. Your own model: --model "
    "path/to/file.py:factory, where factory is " + FACTORY_PROTOCOL + "; every nn.Linear in it is converted and "
    "its weights are drawn under torch.manual_seed(--seed). Your own data: --data FILE. Exit 1 when parity or "
    "the loss fails.")


def _add_train(commands) -> None:
    train = commands.add_parser("train", help="parity over real training steps: lockstep runs, per-layer numerics, "
                                              "the first diverging GEMM",
                                description=TRAIN_DESCRIPTION)
    _impl_arg(train, default=None, help_prefix="implementation under test")
    train.add_argument("--against", default=None, type=_implementation, metavar="REF",
                       help="the implementation it must agree with (default: its recipe's parity reference)")
    train.add_argument("--baseline", default=DEFAULT_BASELINE, type=_implementation, metavar="IMPL",
                       help=f"what the loss is measured against (default {DEFAULT_BASELINE})")
    _common(train)
    train.add_argument("--model", default="tiny", metavar="MODEL",
                       help="; ".join(f"{c.name}: {c.n_layer} layers, d_model {c.d_model}, {c.tokens_per_step} "
                                      f"tokens a step" for c in MODELS.values())
                            + " (default tiny); or path/to/file.py:factory, your own model (see the description)")
    train.add_argument("--data", type=Path, default=None, metavar="FILE",
                       help="train on this file instead of the synthetic language: token ids as a .pt (an integer "
                            "tensor, torch.save) or .npy (an integer array, numpy.save) file, or any other file as "
                            "UTF-8 text read as bytes (ids 0-255: needs a vocabulary of 256, e.g. --model small); "
                            "ids must be below the model's vocab_size; sequences are windows at seeded offsets; no "
                            "loss floor is known")
    train.add_argument("--steps", type=_count(1, 1_000_000, "--steps 50"), default=50, help="steps (default 50)")
    train.add_argument("--grad-accum", type=_count(1, 4096, "--grad-accum 2"), default=1, metavar="N",
                       help="micro-batches a step (gradient accumulation, each micro-batch the model's batch; "
                            "every micro-batch's GEMMs are compared; default 1)")
    train.add_argument("--checkpoint", action="store_true",
                       help="activation checkpointing: torch.utils.checkpoint (use_reentrant=False) around each "
                            "block of the built-in GPT; the backward GEMMs are compared on the recompute's tensors")
    train.add_argument("--sample-every", type=_count(1, 1_000_000, "--sample-every 5"), default=5,
                       help="compute SQNR, amax, underflow and saturation every this many steps (default 5)")
    train.add_argument("--window", type=_count(1, 1_000_000, "--window 10"), default=None,
                       help="steps at the end whose mean loss is judged (default: the last fifth)")
    train.add_argument("--lr", type=_amount(0, 10, f"--lr {LEARNING_RATE}", low_open=True), default=None,
                       help="AdamW learning rate (default: the model's: "
                            + ", ".join(f"{c.name} {c.learning_rate:g}" for c in MODELS.values())
                            + f"; {LEARNING_RATE:g} for your own model)")
    train.add_argument("--timeout", type=_amount(0, 86400, "--timeout 300", low_open=True), default=None,
                       metavar="SECONDS",
                       help="time limit of each run's micro-batch (forward and backward) and optimizer step, past "
                            "which the run is stopped and is a finding (default: 120 s plus the step's size at a "
                            "pessimistic rate)")
    train.add_argument("--seed", type=_count(0, 2**31 - 1, "--seed 0"), default=0,
                       help="seed of the weights and the data (the noise run uses seed + 1)")
    train.add_argument("--out", type=Path, default=None, help="report directory (default reports/<timestamp>/)")
    train.add_argument("--quiet", action="store_true", help="no progress bar")


def _add_report(commands) -> None:
    report = commands.add_parser("report", help="re-render a report from a stored results table")
    report.add_argument("results", type=Path, help="results.csv.gz (or .csv/.parquet) or a report directory")
    report.add_argument("--out", type=Path, default=None,
                        help="report directory (default: the directory of RESULTS, whose table is not rewritten)")
    report.add_argument("--candidate", default="fp8_impl", help="whose parity the verdict judges")
    report.add_argument("--unverified", action="store_true",
                        help="report a table that carries no seal (its row count and checksum: written before "
                             "fp8-parity sealed its tables, compressed again, or a plain CSV), headed UNVERIFIED; "
                             "exit 4 where it would pass")
    _force_arg(report, "write into --out (or beside the table) though it holds files fp8-parity did not write or "
                       "another report's table")


def _add_diff(commands) -> None:
    diff = commands.add_parser("diff", help="compare two result sets: what moved beyond noise",
                               description="Compare two results tables (two torch versions, two commits) case by "
                                           "case; list the cases and tensors whose metrics moved beyond noise.")
    diff.add_argument("a", type=Path, help="results table or report directory (before)")
    diff.add_argument("b", type=Path, help="results table or report directory (after)")
    diff.add_argument("--sqnr-tolerance", type=_amount(0, 1000, "--sqnr-tolerance 0.1"), default=0.1,
                      help="dB an SQNR may move (default 0.1)")
    diff.add_argument("--csv", type=Path, default=None, help="also write the moves as CSV")


def _add_test(commands) -> None:
    test = commands.add_parser("test", help="run the shipped property suite against an implementation (pytest)",
                               description="The hypothesis property suite (the same as `pytest --fp8-impl X`), "
                                           "with pytest's exit code mapped to fp8-parity's. Arguments after `--` "
                                           "go to pytest (e.g. -- -x -k contracts --junitxml=out.xml).")
    _impl_arg(test, default=None, help_prefix="implementation under test")
    test.add_argument("--against", default=None, type=_implementation, metavar="REF",
                      help="reference (default: its recipe's)")
    test.add_argument("--recipe", default=None, metavar="RECIPE", help="the recipe --impl implements")
    test.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    test.add_argument("--case", default=None, metavar="CASE_ID", help="exactly this case")
    _cpu_gemm_arg(test)
    test.add_argument("--report", type=Path, default=None, metavar="DIR", help="write the rows as a report")
    test.add_argument("pytest_args", nargs=argparse.REMAINDER, help="after --: arguments for pytest")


def _add_calibrate(commands) -> None:
    calibrate = commands.add_parser(
        "calibrate", help="measure the Hopper model against this GPU's FP8 GEMMs, bit for bit (a table)",
        description="Run every configuration of the calibration grid (kinds of scaled GEMM calls, formats, out "
                    "dtypes, fast accumulation, layer and odd shapes) on this GPU and in parity.hopper's model, "
                    "and write how many elements agree bit for bit: the table that says where the harness may "
                    "judge a call exactly. Exit 4 when the time limit cut the grid short, 125 without a GPU.")
    calibrate.add_argument("--out", type=Path, default=None, metavar="PATH",
                           help="the table to write (default calibration-<gpu>.csv here; never overwritten)")
    calibrate.add_argument("--seconds", type=_count(1, 10**6, "--seconds 300"), default=None,
                           help="stop measuring after this long (the table then says how much it covers)")
    calibrate.add_argument("--limit", type=_count(1, 10**6, "--limit 50"), default=None,
                           help="only the first N configurations of the grid")


# The subcommands in the order `fp8-parity --help` lists them.
BUILDERS = (_add_check, _add_sweep, _add_bisect, _add_bench, _add_throughput, _add_train, _add_report, _add_diff,
            _add_test, _add_calibrate)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="fp8-parity", description="Numerical parity and accuracy harness for FP8 training in PyTorch.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.required = True
    for add in BUILDERS:
        add(commands)
    return parser


def _warm_up_workers(args) -> None:
    """Start the workers a command that runs your code will need (parity.entry started them already
    when it could tell from the raw arguments; the parsed ones decide here)."""
    named = [*(args.impl if isinstance(getattr(args, "impl", None), list) else [getattr(args, "impl", None)]),
             getattr(args, "against", None)]
    in_worker = args.command in RUNS_YOUR_CODE and getattr(args, "distributed", None) is None
    if in_worker and any(name and name not in BUILTIN_NAMES for name in named):
        import torch  # here, not at the top: the parser answers --help and bad flags without it
        on_gpu = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
        from parity.worker import warm_up  # (multiprocessing: not for a --help)
        # code under test runs in workers: their imports run beside this process's
        warm_up("cuda" if on_gpu else "cpu", RUNS_YOUR_CODE[args.command])


def _user_errors() -> tuple[type[Exception], ...]:
    """The exceptions that are bad input from the user (one line, exit 2), imported only once the
    arguments have parsed: most come from modules that import torch, which every command's body
    imports anyway and which a --help or a bad flag must not wait for."""
    from parity.cases import CaseError
    from parity.history import HistoryError
    from parity.impls import ImplError
    from parity.outputs import OutputError
    from parity.recipes import RecipeError
    return ImplError, CaseError, UsageError, HistoryError, RecipeError, OutputError


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    name = f"fp8-parity {args.command}"
    clear_stops()
    previous = {sig: signal.signal(sig, stop_on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    previous_hook, sys.unraisablehook = sys.unraisablehook, quiet_lost_stops(sys.unraisablehook)
    previous_except_hook = sys.excepthook
    install_quiet_lost_connections()
    _warm_up_workers(args)
    # Bound before the try: a Ctrl-C or a failing import while _user_errors loads torch still ends in
    # one line (interrupted; an internal error), as inside a command.
    user_errors: tuple[type[Exception], ...] = (UsageError,)
    failed_to_load: tuple[type[Exception], ...] = ()
    show_traceback = False
    try:
        show_traceback = traceback_requested()
        user_errors = _user_errors()
        from parity.impls import ImplDied
        failed_to_load = (ImplDied,)
        code = command(args.command)(args)
        by = stopped_by()
        if by is not None and code not in EXIT_SIGNAL.values():  # its exception was lost: the verdict does not count
            print(f"{name}: interrupted by {by.name}; what it printed is void", file=sys.stderr)
            return EXIT_SIGNAL[by]
        return code
    except failed_to_load as err:  # the code under test died or hung at import, in its worker: a finding
        print(f"FAIL: {one_line(err)}")
        return EXIT_FAIL
    except user_errors as err:
        print(f"{name}: {one_line(err)}", file=sys.stderr)
        return EXIT_USAGE
    except CannotRun as err:
        print(f"{name}: cannot run here: {one_line(err)}", file=sys.stderr)
        return EXIT_CANNOT_RUN
    except KeyboardInterrupt as err:
        by = interrupted_by(err)
        print(f"{name}: interrupted by {by.name}; nothing was judged", file=sys.stderr)
        return EXIT_SIGNAL[by]
    except Exception as err:  # noqa: BLE001 - a bug of fp8-parity itself: one line, the traceback on request
        if show_traceback:  # printed, not re-raised: an uncaught exception exits 1, which reads as a violation
            traceback.print_exc()
        how = "the traceback is above" if show_traceback else f"rerun with {TRACEBACK_ENV}=1 for the traceback"
        print(f"{name}: internal error of fp8-parity: {type(err).__name__}: {one_line(err)} ({how}, and report it)",
              file=sys.stderr)
        return EXIT_INTERNAL
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        sys.unraisablehook = previous_hook
        sys.excepthook = previous_except_hook
        clear_stops()  # its exit code said it; a later run in this process (a test's) starts unstopped


if __name__ == "__main__":
    sys.exit(main())
