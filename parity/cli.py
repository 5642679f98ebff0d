"""`fp8-parity`: argument parsing only; each command calls the modules that do the work.

Every flag is validated before any work starts; a bad one is one line saying what, the value
and the fix. Exit codes (all commands): 0 success / parity holds, 1 a violation was found, 2 bad
usage or input, 3 an internal error of fp8-parity (one line; FP8_PARITY_TRACEBACK=1 shows the
traceback), 4 `report` of an interrupted sweep's partial table in which nothing failed (not a
pass: cases are missing), 125 cannot run here (e.g. a GPU-only command without a GPU; what `git
bisect run` reads as "skip this commit"), 130 / 143 interrupted by SIGINT / SIGTERM.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import signal
import sys
import threading
import time
from pathlib import Path

import torch

from parity.cases import CaseError, parse_case_id
from parity.entry import RUNS_YOUR_CODE
from parity.history import HistoryError
from parity.impls import BUILTIN_HELP, BUILTINS, Form, ImplError, load_impl
from parity.policy import Policy
from parity.recipes import FP8_RECIPES, RecipeError

EXIT_PASS, EXIT_FAIL, EXIT_USAGE, EXIT_INTERNAL, EXIT_INCOMPLETE, EXIT_CANNOT_RUN = 0, 1, 2, 3, 4, 125
EXIT_SIGNAL = {signal.SIGINT: 130, signal.SIGTERM: 143}


class UsageError(Exception):
    """Bad input from the user: printed as one clear message, exit 2."""


class CannotRun(Exception):
    """The command cannot run on this machine (no GPU, ...): one clear message, exit 125."""


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised like a Ctrl-C so that every command stops the same way (workers killed, partial
    results kept)."""


def _interrupted_by(err: KeyboardInterrupt) -> signal.Signals:
    return signal.SIGTERM if isinstance(err, Terminated) else signal.SIGINT


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


def _writable_file(path: Path | None, flag: str) -> None:
    from parity.outputs import OutputError, check_writable_file
    if path is not None:
        try:
            check_writable_file(path)
        except OutputError as err:
            raise UsageError(f"{flag} {path}: {err}") from None


def _writable_dir(path: Path, flag: str) -> None:
    from parity.outputs import OutputError, check_writable_dir
    try:
        check_writable_dir(path)
    except OutputError as err:
        raise UsageError(f"{flag} {path}: {err}") from None


def _cases(ids: list[str], device: str):
    from parity.cases import check_fits
    return [check_fits(parse_case_id(case_id), device) for case_id in ids]


def _case_file(path: Path | None, case_ids, device: str):
    """The case of --case-file PATH (None without one); --case and --case-file exclude each other."""
    if path is None:
        return None
    if case_ids:
        raise UsageError("--case-file runs the file's tensors: leave out --case")
    from parity.cases import check_fits
    from parity.data import saved_case
    return check_fits(saved_case(path), device)


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
    parser = Parser(
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
    check.add_argument("--max-examples", type=_count(1, 100_000, "--max-examples 100"), default=100,
                       help="hypothesis cases to try (default 100)")
    check.add_argument("--max-dim", type=_count(16, 16384, "--max-dim 256"), default=256,
                       help="largest K and N generated (default 256)")
    check.add_argument("--case", action="append", default=None, metavar="CASE_ID",
                       help="run exactly this case (repeatable) instead of searching")
    check.add_argument("--case-file", type=Path, default=None, metavar="PATH",
                       help="run exactly the tensors of this case file (`fp8-parity train` writes one where two runs "
                            "diverge) instead of searching")
    check.add_argument("--policy", choices=[p.value for p in Policy], default=None,
                       help="override the parity policy (default: chosen from the recipes)")
    check.add_argument("--no-oracle", action="store_true", help="do not also run the exact emulation")
    check.add_argument("--seed", type=_count(0, 2**31 - 1, "--seed 0"), default=0,
                       help="seed of the search (default 0)")
    _timeout_arg(check)
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

    bisect = commands.add_parser("bisect", help="localize a failing implementation: GEMM, operand, bug class, trigger",
                                 description="Find a minimal failing case and localize the bug: which GEMM, which "
                                             "operand, which bug class, under which conditions, with evidence. "
                                             "With --git GOOD BAD: the first bad commit of a repository.")
    _impl_arg(bisect, default=None, help_prefix="implementation to localize")
    bisect.add_argument("--against", default=None, metavar="REF",
                        help="reference (default: the recipe's, as for check)")
    _common(bisect)
    bisect.add_argument("--case", default=None, metavar="CASE_ID",
                        help="localize on this failing case (with --git: each commit's check runs only it)")
    bisect.add_argument("--case-file", type=Path, default=None, metavar="PATH",
                        help="localize on the tensors of this case file (written by `fp8-parity train`)")
    bisect.add_argument("--max-examples", type=_count(1, 100_000, "--max-examples 100"), default=100,
                        help="search budget for a failing case")
    _timeout_arg(bisect)
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
    bench.add_argument("--warmup", type=_count(0, 100_000, "--warmup 10"), default=None,
                       help="untimed iterations (default: the preset's)")
    bench.add_argument("--iters", type=_count(1, 100_000, "--iters 50"), default=None,
                       help="timed iterations (default: the preset's)")
    bench.add_argument("--out", type=Path, default=None, help="report directory (default reports/<timestamp>/)")
    bench.add_argument("--quiet", action="store_true", help="no progress bar")

    throughput = commands.add_parser("throughput", help="cases per second of the harness itself (small shapes)")
    throughput.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    throughput.add_argument("--workers", type=_count(1, 64, "--workers 2"), default=1,
                            help="processes sharing the device (default 1)")
    throughput.add_argument("--cases", type=_count(1, 1_000_000, "--cases 300"), default=300,
                            help="small cases to run (default 300)")

    from parity.model import FACTORY_PROTOCOL, MODELS
    from parity.train import DEFAULT_BASELINE, LEARNING_RATE
    train = commands.add_parser("train", help="parity over real training steps: lockstep runs, per-layer numerics, "
                                              "the first diverging GEMM",
                                description="Train a small GPT on a synthetic language (no download) with --impl, "
                                            "--against and --baseline in lockstep from the same weights and "
                                            "batches; compare every layer's three GEMMs bitwise at every call "
                                            "(every micro-batch under --grad-accum; under --checkpoint the "
                                            "backward GEMMs on the recompute's tensors), sample SQNR, amax, "
                                            "underflow and saturation, judge the loss against the baseline's "
                                            "seed-to-seed noise; save the first diverging GEMM as a case file for "
                                            "check and bisect; time every step. Your own model: --model "
                                            "path/to/file.py:factory, where factory is " + FACTORY_PROTOCOL + "; "
                                            "every nn.Linear in it is converted and its weights are drawn under "
                                            "torch.manual_seed(--seed). Your own data: --data FILE. Exit 1 when "
                                            "parity or the loss fails.")
    _impl_arg(train, default=None, help_prefix="implementation under test")
    train.add_argument("--against", default=None, metavar="REF",
                       help="the implementation it must agree with (default: its recipe's parity reference)")
    train.add_argument("--baseline", default=DEFAULT_BASELINE, metavar="IMPL",
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
    train.add_argument("--seed", type=_count(0, 2**31 - 1, "--seed 0"), default=0,
                       help="seed of the weights and the data (the noise run uses seed + 1)")
    train.add_argument("--out", type=Path, default=None, help="report directory (default reports/<timestamp>/)")
    train.add_argument("--quiet", action="store_true", help="no progress bar")

    report = commands.add_parser("report", help="re-render a report from a stored results table")
    report.add_argument("results", type=Path, help="results.csv.gz (or .csv/.parquet) or a report directory")
    report.add_argument("--out", type=Path, default=None,
                        help="report directory (default: the directory of RESULTS, whose table is not rewritten)")
    report.add_argument("--candidate", default="fp8_impl", help="whose parity the verdict judges")

    diff = commands.add_parser("diff", help="compare two result sets: what moved beyond noise",
                               description="Compare two results tables (two torch versions, two commits) case by "
                                           "case; list the cases and tensors whose metrics moved beyond noise.")
    diff.add_argument("a", type=Path, help="results table or report directory (before)")
    diff.add_argument("b", type=Path, help="results table or report directory (after)")
    diff.add_argument("--sqnr-tolerance", type=_amount(0, 1000, "--sqnr-tolerance 0.1"), default=0.1,
                      help="dB an SQNR may move (default 0.1)")
    diff.add_argument("--csv", type=Path, default=None, help="also write the moves as CSV")
    test = commands.add_parser("test", help="run the shipped property suite against an implementation (pytest)",
                               description="The hypothesis property suite (the same as `pytest --fp8-impl X`), "
                                           "with pytest's exit code mapped to fp8-parity's. Arguments after `--` "
                                           "go to pytest (e.g. -- -x -k contracts --junitxml=out.xml).")
    _impl_arg(test, default=None, help_prefix="implementation under test")
    test.add_argument("--against", default=None, metavar="REF", help="reference (default: its recipe's)")
    test.add_argument("--recipe", default=None, metavar="RECIPE", help="the recipe --impl implements")
    test.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    test.add_argument("--case", default=None, metavar="CASE_ID", help="exactly this case")
    test.add_argument("--report", type=Path, default=None, metavar="DIR", help="write the rows as a report")
    test.add_argument("pytest_args", nargs=argparse.REMAINDER, help="after --: arguments for pytest")
    return parser


class Progress:
    """Progress on stderr. On a terminal, one line redrawn in place. Otherwise (a log, CI) a line
    at every tenth of the planned work, and a heartbeat every HEARTBEAT_S seconds with the last
    status, so a long case never leaves the log silent. A context manager: the heartbeat stops
    with the command. Calls: progress(done, total[, elapsed][, work=(work_done, work_planned)]);
    `bar` draws a bar and an ETA.

    The ETA weighs the items by their work where the caller gives it (a sweep: multiply-adds of
    each case, parity.sweep.case_work): a case's time is a fixed cost (a worker's call, the
    float64 references' set-up, the metrics) plus a cost per unit of work, both fitted by least
    squares on the items done so far, so ten small cases left after a large one are not ten
    large ones, nor free. Without work, every item counts the same."""

    HEARTBEAT_S = 30.0

    def __init__(self, enabled: bool, what: str, *, bar: bool = True):
        self.enabled, self.what, self.bar = enabled, what, bar
        self.tty = sys.stderr.isatty()
        self.start = self.last_write = time.monotonic()
        self.status, self.decile = f"  {what}: started", -1
        self._stop = threading.Event()
        self._last = (0.0, 0.0)  # (elapsed, work done) at the previous call
        self._sums = dict.fromkeys(("n", "w", "ww", "t", "wt"), 0.0)  # of the least-squares fit

    def __enter__(self) -> "Progress | None":
        if not self.enabled:
            return None
        if not self.tty:
            threading.Thread(target=self._beat, name="fp8-parity heartbeat", daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self.enabled and self.tty and self.last_write > self.start:
            sys.stderr.write("\n")

    def _write(self, text: str) -> None:
        self.last_write = time.monotonic()
        sys.stderr.write(text)
        sys.stderr.flush()

    def _beat(self) -> None:
        while not self._stop.wait(min(1.0, self.HEARTBEAT_S / 2)):
            if time.monotonic() - self.last_write >= self.HEARTBEAT_S:
                self._write(f"{self.status} (running, {time.monotonic() - self.start:.0f} s)\n")

    def seconds_left(self, done: int, total: int, elapsed: float, work: tuple[float, float] | None = None) -> float:
        """The time left. Without `work`: elapsed per item. With it (one call per item done, as a
        sweep calls; work done and planned of this run): the seconds of each item between calls fit
        as a + b * its work by least squares (a, b at least 0), applied to the items and work left."""
        if work is None:
            return elapsed / done * (total - done) if done else 0.0
        (last_elapsed, last_work), (work_done, work_planned) = self._last, work
        seconds, units = elapsed - last_elapsed, work_done - last_work
        self._last = (elapsed, work_done)
        for key, value in (("n", 1), ("w", units), ("ww", units * units), ("t", seconds), ("wt", units * seconds)):
            self._sums[key] += value
        n, w, ww, t, wt = self._sums.values()
        spread = n * ww - w * w  # n^2 times the variance of the items' work
        # under 1e-9 of n * sum(w^2): the items' work differs by rounding only; the work alone is the weight
        per_unit = (n * wt - w * t) / spread if spread > 1e-9 * n * ww else (t / w if w else 0.0)
        per_item = (t - per_unit * w) / n
        if per_unit < 0:  # time does not grow with work here: a cost per item alone
            per_item, per_unit = t / n, 0.0
        elif per_item < 0:  # no fixed cost: work alone
            per_item, per_unit = 0.0, wt / ww
        return per_item * (total - done) + per_unit * (work_planned - work_done)

    def __call__(self, done: int, total: int, elapsed: float | None = None, *,
                 work: tuple[float, float] | None = None) -> None:
        elapsed = time.monotonic() - self.start if elapsed is None else elapsed
        if self.bar:
            left = self.seconds_left(done, total, elapsed, work)
            self.status = (f"  [{'#' * int(30 * done / total):<30}] {done}/{total} {self.what}, {elapsed:.0f} s "
                           f"elapsed, ~{left:.0f} s left")
        else:
            self.status = f"  {done} {self.what} run (search budget {total}), {elapsed:.0f} s elapsed"
        if self.tty:
            self._write("\r" + self.status)
        elif self.bar and done * 10 // total != self.decile:
            self.decile = done * 10 // total
            self._write(self.status + "\n")


def _default_report_dir() -> Path:
    import datetime
    return Path("reports") / datetime.datetime.now().strftime("%Y%m%d-%H%M%S")


PARTIAL_TABLE, PARTIAL_INFO = "partial.csv.gz", "partial.json"


def _sweep_arguments(args, impl_names: list[str]) -> dict:
    """What decides a sweep's cases and rows: a resumed sweep must be the same sweep."""
    return dict(preset=args.preset, impls=impl_names, samples=args.samples, seed=args.seed,
                accuracy_only=args.accuracy_only)


def _save_partial(frame, out: Path, arguments: dict, reason: str) -> None:
    """The rows of the cases done so far, where `report` and `sweep --resume` read them."""
    import gzip

    from parity.outputs import atomic_write_bytes, atomic_write_text
    atomic_write_bytes(out / PARTIAL_TABLE, gzip.compress(frame.to_csv(index=False).encode(), mtime=0))
    atomic_write_text(out / PARTIAL_INFO, json.dumps(dict(arguments=arguments, done=frame.attrs["done"],
                                                          planned=frame.attrs["planned"], reason=reason,
                                                          env=frame.attrs.get("env", {})), indent=2, default=str))


def _load_partial(out: Path, arguments: dict):
    from parity.report import read_results
    info_path = out / PARTIAL_INFO
    if not info_path.is_file() or not (out / PARTIAL_TABLE).is_file():
        raise UsageError(f"--resume: {out} holds no interrupted sweep ({PARTIAL_TABLE} and {PARTIAL_INFO}); run "
                         f"without --resume to start one")
    info = json.loads(info_path.read_text())
    if info.get("arguments") != arguments:
        raise UsageError(f"--resume: the sweep in {out} ran with {info.get('arguments')}, this one asks for "
                         f"{arguments}: resume with the same --preset, --impl, --samples, --seed and --accuracy-only")
    try:
        return read_results(out / PARTIAL_TABLE)
    except (ValueError, OSError) as err:
        raise UsageError(f"--resume: cannot read {out / PARTIAL_TABLE}: {err}; start the sweep again") from None


def cmd_sweep(args) -> int:
    from parity.outputs import OutputLock
    from parity.report import verdict, write_report
    from parity.sweep import (DEFAULT_IMPLS, PRESETS, SweepInterrupted, accuracy_by_recipe, named_shape_table,
                              run_sweep, run_sweep_sharded, sweep_comparisons)

    device = _device(args.device)
    impl_names = args.impl or list(DEFAULT_IMPLS)
    if args.resume and args.out is None:
        raise UsageError("--resume needs --out DIR, the directory of the interrupted sweep")
    out = args.out or _default_report_dir()
    _writable_dir(out, "--out")
    impls = [load_impl(name) for name in impl_names]
    preset = PRESETS[args.preset]
    if args.samples is not None:
        preset = dataclasses.replace(preset, samples=args.samples,
                                     cpu=preset.cpu and dataclasses.replace(preset.cpu, samples=None))
    cases = preset.cases(device, seed=args.seed, alignment=max(impl.recipe.alignment for impl in impls))
    gpus = min(args.gpus, torch.cuda.device_count()) if device == "cuda" else 1
    if args.gpus > 1 and gpus < args.gpus:
        print(f"fp8-parity sweep: --gpus {args.gpus}, but {gpus or 'no'} GPU(s) here: using {max(gpus, 1)} worker",
              file=sys.stderr)
    if args.resume and gpus > 1:
        raise UsageError("--resume runs on one device: leave out --gpus")
    arguments = _sweep_arguments(args, impl_names)
    with OutputLock(out):
        done = _load_partial(out, arguments) if args.resume else None
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
                    frame = run_sweep(cases, sweep_comparisons(impls, device, accuracy_only=args.accuracy_only),
                                      device=device, progress=progress, time_limit=args.timeout, done=done,
                                      checkpoint=lambda part: _save_partial(part, out, arguments, "running"))
            except SweepInterrupted as stop:
                by = _interrupted_by(stop.cause)
                _save_partial(stop.frame, out, arguments, by.name)
                command = " ".join(["fp8-parity", "sweep", *sys.argv[2:]] if "--resume" in sys.argv else
                                   ["fp8-parity", "sweep", *sys.argv[2:], *([] if args.out else ["--out", str(out)]),
                                    "--resume"])
                print(f"fp8-parity sweep: interrupted by {by.name} after {stop.frame.attrs['done']} of "
                      f"{stop.frame.attrs['planned']} cases; their rows are in {out / PARTIAL_TABLE} (`fp8-parity "
                      f"report {out}` reads them); continue with: {command}", file=sys.stderr)
                return EXIT_SIGNAL[by]
        judged = verdict(frame, candidate=impls[0].name)
        frame.attrs["env"]["cases"] = preset.describe(device)  # the report says which shapes ran, and why
        written = write_report(frame, out, title=f"fp8-parity sweep: {preset.name} preset on {device}",
                               candidate=impls[0].name, verdict=judged,
                               extra_tables={"by named shape": named_shape_table(frame, candidate=impls[0].name),
                                             "Median SQNR against fp64 (dB) on the named shapes, by recipe and data":
                                                 accuracy_by_recipe(frame)})
        for name in (PARTIAL_TABLE, PARTIAL_INFO):  # the complete table is written
            (out / name).unlink(missing_ok=True)
    print(judged.headline)
    if judged.next_step:
        print(f"next: {judged.next_step}  ({judged.NEXT_STEP_WHY})")
    print(f"report: {out}/summary.md ({len(written)} files, {frame.attrs['env']['seconds']} s)")
    return EXIT_PASS if judged.ok else EXIT_FAIL


def cmd_bisect(args) -> int:
    from parity.check import CheckPlan

    from parity.outputs import atomic_write_text

    device = _device(args.device)
    _writable_file(args.json, "--json")
    if args.git:
        from parity.history import git_bisect
        with Progress(True, "bisect --git"):  # a heartbeat in a log: one check per commit takes a while
            found = git_bisect(args.git[0], args.git[1], impl=args.impl, against=args.against, device=device,
                               max_examples=args.max_examples, case=args.case)
        print(found.render(), end="")
        if args.json:
            atomic_write_text(args.json, json.dumps(found.to_json(), indent=2) + "\n")
        return EXIT_FAIL if found.first_bad else EXIT_PASS
    from parity.bisect import localize, render
    case = _case_file(args.case_file, args.case, device) or (_cases([args.case], device)[0] if args.case else None)
    plan = CheckPlan.make(load_impl(args.impl, form=args.form, recipe=args.recipe),
                          load_impl(args.against) if args.against else None, device=device)
    with Progress(True, "bisect"):
        result = localize(plan, device=device, case=case, max_examples=args.max_examples, time_limit=args.timeout)
    print(render(result), end="")
    if args.json:
        atomic_write_text(args.json, json.dumps(result.to_json(), indent=2) + "\n")
    return {"pass": EXIT_PASS, "fail": EXIT_FAIL, "error": EXIT_CANNOT_RUN}[result.verdict]


def cmd_train(args) -> int:
    from parity.model import ModelError
    from parity.outputs import OutputLock
    from parity.train import TrainError, TrainPlan, run_training
    from parity.train_report import write_train_report

    device = _device(args.device)
    out = args.out or _default_report_dir()
    _writable_dir(out, "--out")
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
                result = run_training(plan, out_dir=out, progress=progress)
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
    return EXIT_PASS if judged.ok else EXIT_FAIL


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

    if not torch.cuda.is_available():  # before anything is printed or created
        raise CannotRun("no CUDA device is available: bench measures GPU kernels (there is no CPU benchmark)")
    impls = [load_impl(name) for name in args.impl or DEFAULT_IMPLS]
    presets = [PRESETS[name] for name in dict.fromkeys(args.preset or ["small"])]
    modes = {"both": (False, True), "off": (False,), "on": (True,)}[args.compile]
    out = args.out or _default_report_dir()
    names = "+".join(p.name for p in presets)
    print(f"fp8-parity bench: preset {names}, {sum(len(p.shapes) for p in presets)} shapes x {len(impls)} "
          f"implementations x {len(modes)} compile modes", file=sys.stderr)
    try:
        out.mkdir(parents=True, exist_ok=True)
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


def cmd_report(args) -> int:
    from parity.outputs import OutputLock
    from parity.report import verdict, write_report

    source = args.results
    partial = (source.name == PARTIAL_TABLE or
               (source.is_dir() and (source / PARTIAL_TABLE).is_file() and not (source / "results.csv.gz").exists()))
    table = source / PARTIAL_TABLE if partial and source.is_dir() else source
    frame = _read(table)
    home = table.parent
    out = args.out or home
    _writable_dir(out, "--out")
    judged = verdict(frame, candidate=args.candidate)
    headline = judged.headline
    if partial:
        info_path = home / PARTIAL_INFO
        info = json.loads(info_path.read_text()) if info_path.is_file() else {}
        headline = (f"INCOMPLETE: an interrupted sweep's table ({info.get('done', '?')} of {info.get('planned', '?')} "
                    f"cases; `fp8-parity sweep --out {home} --resume` finishes it). Among the cases that ran: "
                    f"{headline}")
        judged = dataclasses.replace(judged, headline=headline)
    with OutputLock(out):  # the table read is never rewritten: a report beside it re-renders only the rest
        write_report(frame, out, candidate=args.candidate, verdict=judged,
                     write_table=out.resolve() != home.resolve())
    print(headline)
    if judged.next_step:
        print(f"next: {judged.next_step}  ({judged.NEXT_STEP_WHY})")
    print(f"report: {out}/summary.md")
    if not judged.ok:
        return EXIT_FAIL
    return EXIT_INCOMPLETE if partial else EXIT_PASS


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

    from parity.outputs import atomic_write_text

    _writable_file(args.csv, "--csv")
    moves = diff_results(_read(args.a), _read(args.b), sqnr_tolerance_db=args.sqnr_tolerance)
    print(render_diff(moves))
    if args.csv:
        atomic_write_text(args.csv, moves.to_csv(index=False))
    return EXIT_PASS if moves.empty else EXIT_FAIL


def cmd_check(args) -> int:
    from parity.check import CheckPlan, render, rerun_command, run_check

    from parity.outputs import atomic_write_text

    device = _device(args.device)
    _writable_file(args.json, "--json")
    saved = _case_file(args.case_file, args.case, device)
    cases = [saved] if saved else _cases(args.case, device) if args.case else None
    candidate = load_impl(args.impl, form=args.form, recipe=args.recipe)
    reference = load_impl(args.against) if args.against else None
    plan = CheckPlan.make(candidate, reference, policy=args.policy, oracle=not args.no_oracle, device=device)
    extra = [*(["--form", args.form] if args.form else []), *(["--recipe", args.recipe] if args.recipe else []),
             *(["--policy", args.policy] if args.policy else [])]
    with Progress(not args.quiet, "cases", bar=False) as progress:
        result = run_check(plan, device=device, max_examples=args.max_examples, cases=cases, max_dim=args.max_dim,
                           seed=args.seed, rerun_command=rerun_command(args.impl, plan.reference.name, device, extra),
                           progress=progress, time_limit=args.timeout)
    print(render(result), end="")
    if args.json:
        atomic_write_text(args.json, json.dumps(result.to_json(), indent=2) + "\n")
    return {"pass": EXIT_PASS, "fail": EXIT_FAIL, "error": EXIT_CANNOT_RUN}[result.verdict]


def cmd_test(args) -> int:
    import pytest

    from parity.pytest_plugin import SHIPPED_SUITE
    if args.recipe:
        from parity.recipes import get_recipe
        get_recipe(args.recipe)  # a typo is a usage error here, with its "did you mean"
    if args.report is not None:
        _writable_dir(args.report, "--report")
    # a name that does not load is a usage error now, with its message, not after pytest has started
    load_impl(args.impl, recipe=args.recipe)
    if args.against:
        load_impl(args.against)
    extra = [a for a in args.pytest_args if a != "--"]
    argv = [str(SHIPPED_SUITE), "--fp8-impl", args.impl, "--fp8-device", args.device, "-p", "no:cacheprovider",
            *(["--fp8-against", args.against] if args.against else []),
            *(["--fp8-recipe", args.recipe] if args.recipe else []),
            *(["--fp8-case", args.case] if args.case else []),
            *(["--fp8-report", str(args.report)] if args.report else []), *extra]
    code = int(pytest.main(argv))
    # pytest: 0 passed, 1 tests failed, 2 interrupted, 3 internal error, 4 usage error, 5 no tests collected
    return {0: EXIT_PASS, 1: EXIT_FAIL, 2: EXIT_SIGNAL[signal.SIGINT], 3: EXIT_INTERNAL, 4: EXIT_USAGE,
            5: EXIT_CANNOT_RUN}.get(code, EXIT_INTERNAL)


COMMANDS = {"check": cmd_check, "test": cmd_test, "sweep": cmd_sweep, "bisect": cmd_bisect, "bench": cmd_bench,
            "throughput": cmd_throughput, "train": cmd_train,
            "report": cmd_report, "diff": cmd_diff}


def _raise_terminated(signum, frame):
    raise Terminated()


def main(argv: list[str] | None = None) -> int:
    from parity.outputs import OutputError
    parser = build_parser()
    args = parser.parse_args(argv)
    name = f"fp8-parity {args.command}"
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    named = [*(args.impl if isinstance(getattr(args, "impl", None), list) else [getattr(args, "impl", None)]),
             getattr(args, "against", None)]
    if args.command in RUNS_YOUR_CODE and any(name and name not in BUILTINS for name in named):
        from parity.worker import warm_up
        on_gpu = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
        # code under test runs in workers: their imports run beside this process's
        warm_up("cuda" if on_gpu else "cpu", RUNS_YOUR_CODE[args.command])
    try:
        return COMMANDS[args.command](args)
    except (ImplError, CaseError, UsageError, HistoryError, RecipeError, OutputError) as err:
        print(f"{name}: {err}", file=sys.stderr)
        return EXIT_USAGE
    except CannotRun as err:
        print(f"{name}: cannot run here: {err}", file=sys.stderr)
        return EXIT_CANNOT_RUN
    except KeyboardInterrupt as err:
        by = _interrupted_by(err)
        print(f"{name}: interrupted by {by.name}; nothing was judged", file=sys.stderr)
        return EXIT_SIGNAL[by]
    except Exception as err:  # noqa: BLE001 - a bug of fp8-parity itself: one line, the traceback on request
        if os.environ.get("FP8_PARITY_TRACEBACK"):
            raise
        print(f"{name}: internal error of fp8-parity: {type(err).__name__}: {err} (rerun with "
              f"FP8_PARITY_TRACEBACK=1 for the traceback, and report it)", file=sys.stderr)
        return EXIT_INTERNAL
    finally:
        signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
