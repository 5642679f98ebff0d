"""Wall time of the default commands on this machine, against their bars (a benchmark, not a test).

    python -m evals.scoring.timings [--suite] [--device cpu|cuda] [--repeat N]

Each command runs as a user runs it: a fresh process (imports included), its wall clock from
start to exit, the median of --repeat runs. The bars are for an idle 2-core CPU machine:

    fp8-parity sweep --device D --quiet --out TMP       60 s
    fp8-parity check --impl fp8_impl --device D --quiet  30 s
    fp8-parity bisect --impl <a zoo mutant> --device D   60 s (30 s on an H200)
    python -m pytest -q             (with --suite)       300 s

With --bisect-set NAME (a held-out set under evals/heldout/: set15, or heldout15), `fp8-parity bisect` of every
buggy entry of that set, each in a fresh process: the median and the slowest against the bar.
A command that fails (an exit code other than the one expected) is reported as such, not timed.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time

from evals.scoring import sets


def commands(device: str, out: str, suite: bool) -> list[tuple[str, list[str], int, float]]:
    """(name, argv, expected exit code, bar in seconds)."""
    parity = [sys.executable, "-m", "parity"]
    listed = [
        # --force: each repeat writes over the report of the one before (refused otherwise)
        ("default sweep", [*parity, "sweep", "--device", device, "--quiet", "--out", out, "--force"], 0, 60.0),
        ("default check", [*parity, "check", "--impl", "fp8_impl", "--device", device, "--quiet"], 0, 30.0),
        ("bisect of a mutant", [*parity, "bisect", "--impl", "evals/zoo/mutants.py:weight_scale_bf16",
                                "--device", device], 1, 30.0 if device == "cuda" else 60.0),
    ]
    if suite:
        listed.append(("test suite", [sys.executable, "-m", "pytest", "-q", "-p", "no:randomly"], 0, 300.0))
    return listed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--suite", action="store_true", help="also time the whole test suite")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--bisect-set", default=None, help="time bisect on every buggy entry of this held-out set")
    parser.add_argument("--only", nargs="*", default=None, help="with --bisect-set: only these entries")
    args = parser.parse_args()
    if args.bisect_set:
        try:
            sets.set_name(args.bisect_set)
        except sets.SetError as err:
            parser.error(f"--bisect-set: {err}")
        time_bisects(args.bisect_set, args.device, args.only)
        return
    print(f"| command | seconds (median of {args.repeat}) | bar | within |\n| --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as tmp:
        for name, argv, expected, bar in commands(args.device, f"{tmp}/sweep", args.suite):
            seconds = []
            for _ in range(args.repeat):
                start = time.perf_counter()
                done = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                seconds.append(time.perf_counter() - start)
                if done.returncode != expected:
                    print(f"| `{' '.join(argv[1:])}` | exit {done.returncode}, expected {expected}: "
                          f"{done.stderr.strip().splitlines()[-1:] or ''} | {bar:.0f} | no |", flush=True)
                    break
            else:
                median = statistics.median(seconds)
                print(f"| {name}: `{' '.join(argv[2:])}` | {median:.1f} | {bar:.0f} | "
                      f"{'yes' if median <= bar else 'NO'} |", flush=True)


def time_bisects(name: str, device: str, only: list[str] | None = None) -> None:
    """`fp8-parity bisect` on each buggy entry of a held-out set, as a user runs it (a fresh process)."""
    import json
    from pathlib import Path
    manifest = sets.manifest(name)
    bar = 30.0 if device == "cuda" else 60.0
    seconds = {}
    print("| entry | seconds | exit | phases (s) | outside the phases (s) |\n| --- | --- | --- | --- | --- |")
    for entry in manifest:
        if entry["category"] == "none" or device not in entry["devices"] or (only and entry["name"] not in only):
            continue
        with tempfile.TemporaryDirectory() as tmp:
            argv = [sys.executable, "-m", "parity", "bisect", "--impl", sets.impl_path(entry["impl"]), "--recipe",
                    entry["recipe"], "--device", device, "--json", f"{tmp}/bisect.json"]
            start = time.perf_counter()
            done = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            seconds[entry["name"]] = time.perf_counter() - start
            try:  # the phases bisect itself measured; the rest of the wall time is imports and workers' starts
                phases = json.loads(Path(f"{tmp}/bisect.json").read_text()).get("seconds", {})
            except (OSError, ValueError):
                phases = {}
        outside = seconds[entry["name"]] - sum(phases.values())  # the interpreter, imports, workers' starts, exit
        print(f"| {entry['name']} | {seconds[entry['name']]:.1f} | {done.returncode} | "
              f"{' '.join(f'{k}:{v:.1f}' for k, v in phases.items())} | {outside:.1f} |", flush=True)
    slowest = max(seconds, key=seconds.get)
    print(f"\nbisect on {name} ({device}, {len(seconds)} entries, fresh processes): median "
          f"{statistics.median(seconds.values()):.1f} s, max {seconds[slowest]:.1f} s ({slowest}); bar {bar:.0f} s: "
          f"{sum(v <= bar for v in seconds.values())}/{len(seconds)} within")


if __name__ == "__main__":
    main()
