"""Wall time of fp8-parity's simple answers: every --help and the usage errors (a benchmark, not a test).

    python -m evals.scoring.cli_latency [--repeat N] [--bar SECONDS] [--json PATH]

A question a user types by hand (what are the flags? what did I mistype?) should be answered at
once, not after importing torch (issue 28, item 7: `--help` took 3.4-11 s, a typo in a flag 11-15 s
under load). Each command runs as a user runs it: `python -m parity ...` in a fresh process from the
root of this checkout, its wall clock from start to exit. The runs are interleaved (every command
once, then every command again, --repeat times) so that a burst of load on a shared machine falls
on all the commands alike rather than on whichever happened to run then.

The table gives each command's median and slowest wall time, its exit code against the one
expected (0 for a --help, 2 for a usage error), and whether the median is under the bar (0.5 s:
an idle 2-core CPU machine answers in about 0.1 s when nothing heavy is imported). Exit 1 when a
median is over the bar or a command exits with another code than expected; --json PATH also
writes every run's seconds.

Each round also times a bare interpreter (`python -c pass`, not judged): the floor under every
figure, which the machine's load moves as much as it moves them (on 2 cores with four busy
processes beside it, a bare interpreter alone takes several tenths of a second).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the checkout whose `parity` is measured
BAR_S = 0.5
SUBCOMMANDS = ("check", "sweep", "bisect", "bench", "throughput", "train", "report", "diff", "test", "calibrate")


def commands() -> list[tuple[list[str], int]]:
    """(arguments after `python -m parity`, expected exit code): every --help, then the usage errors."""
    helps = [(["--help"], 0), *(([name, "--help"], 0) for name in SUBCOMMANDS)]
    usage_errors = [
        (["check", "--bogus"], 2),  # a flag that does not exist
        (["check", "--impl", "fp8_impl", "--max-examples", "-1"], 2),  # a value out of range
        (["check", "--impl", "fp8_imp"], 2),  # a built-in's name mistyped
        (["bogus"], 2),  # a subcommand that does not exist
        ([], 2),  # no subcommand at all
    ]
    return helps + usage_errors


def run_once(arguments: list[str], *, module: tuple[str, ...] = ("-m", "parity")) -> tuple[float, int, str]:
    """One fresh `python -m parity ARGUMENTS` (`module` replaces `-m parity`): (wall seconds, exit code, the last
    line of stderr)."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, *module, *arguments], cwd=ROOT, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True)
    seconds = time.perf_counter() - start
    return seconds, done.returncode, (done.stderr.strip().splitlines() or [""])[-1]


def measure(repeat: int) -> tuple[list[dict], list[float]]:
    """Every command `repeat` times, interleaved: one row per command, and a bare interpreter's seconds."""
    listed = commands()
    rows = [{"command": " ".join(["fp8-parity", *arguments]), "expected_exit": expected, "seconds": [], "exits": []}
            for arguments, expected in listed]
    bare = []
    for _ in range(repeat):
        bare.append(round(run_once([], module=("-c", "pass"))[0], 4))
        for (arguments, _expected), row in zip(listed, rows):
            seconds, code, last_line = run_once(arguments)
            row["seconds"].append(round(seconds, 4))
            row["exits"].append(code)
            row["last_stderr_line"] = last_line
    return rows, bare


def judge(rows: list[dict], bar: float) -> bool:
    """Add each row's median, max and verdict; whether every command met the bar with its exit code."""
    for row in rows:
        row["median_s"] = statistics.median(row["seconds"])
        row["max_s"] = max(row["seconds"])
        row["exit_as_expected"] = all(code == row["expected_exit"] for code in row["exits"])
        row["under_bar"] = row["median_s"] < bar
    return all(row["under_bar"] and row["exit_as_expected"] for row in rows)


def print_table(rows: list[dict], bar: float, repeat: int) -> None:
    print(f"| command | median s (of {repeat}) | max s | exit | under {bar:g} s |\n| --- | --- | --- | --- | --- |")
    for row in rows:
        exits = sorted(set(row["exits"]))
        shown = ", ".join(map(str, exits)) + ("" if row["exit_as_expected"] else f" (expected {row['expected_exit']}: "
                                                                                 f"{row['last_stderr_line']})")
        print(f"| `{row['command']}` | {row['median_s']:.2f} | {row['max_s']:.2f} | {shown} | "
              f"{'yes' if row['under_bar'] else 'NO'} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5, help="runs of each command (default 5)")
    parser.add_argument("--bar", type=float, default=BAR_S, help=f"seconds a median must stay under (default {BAR_S})")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write every run as JSON")
    args = parser.parse_args()
    if args.repeat < 1:
        parser.error(f"--repeat must be at least 1, got {args.repeat}")
    load_before = os.getloadavg()
    rows, bare = measure(args.repeat)
    passed = judge(rows, args.bar)
    print_table(rows, args.bar, args.repeat)
    load_after = os.getloadavg()
    # the machine's load says how far the figures carry: on a shared 2-core machine it moves them
    print(f"\nload average (1, 5, 15 min) before {', '.join(f'{x:.2f}' for x in load_before)}; after "
          f"{', '.join(f'{x:.2f}' for x in load_after)}; {os.cpu_count()} cores")
    print(f"a bare interpreter (python -c pass, not judged): median {statistics.median(bare):.2f} s, max "
          f"{max(bare):.2f} s")
    print(f"{sum(row['under_bar'] for row in rows)}/{len(rows)} medians under {args.bar:g} s; "
          f"{sum(row['exit_as_expected'] for row in rows)}/{len(rows)} exit codes as expected")
    if args.json:
        args.json.write_text(json.dumps({"bar_s": args.bar, "repeat": args.repeat, "load_before": load_before,
                                         "load_after": load_after, "passed": passed, "bare_interpreter_s": bare,
                                         "rows": rows}, indent=1) + "\n")
    sys.exit(0 if passed else 1)


if __name__ == "__main__":
    main()
