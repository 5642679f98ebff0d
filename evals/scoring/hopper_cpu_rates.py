"""Fast-accumulation bugs on a CPU that computes the H200's bits (`--cpu-gemm hopper`): detected by their numbers?

    python -m evals.scoring.hopper_cpu_rates [--sets set01 ...] [--max-examples 60]

The held-out entries labelled `accumulation` with the trigger "gpu only" (a fast-accumulation flag or
order that only a GPU's numbers show), of the recipes whose GEMMs are `_scaled_mm` calls on a CPU
(not blockwise), and the zoo's grad_input_fast_accum: `check` on the CPU with FP8_PARITY_CPU_SCALED_MM=hopper.
Each entry runs twice: `check` as a user runs it (its verdict and the kinds of violation of its minimal case:
the recorded call's use_fast_accum flag is the first to show), and against hopper:<recipe> alone ("numbers":
the search finds a case whose results are not the H200's bits, with no recorded flag to go by).
"""

from __future__ import annotations

import argparse
import json
import os
import time

from evals.scoring import sets

def entries(names: list[str]) -> list[dict]:
    found = [dict(set="zoo", name="grad_input_fast_accum", recipe="tensorwise",
                  impl="evals/zoo/mutants.py:grad_input_fast_accum")]
    for name in names:
        for entry in sets.manifest(name):
            if entry["category"] == "accumulation" and "gpu only" in entry["trigger"] and entry["recipe"] != "blockwise":
                found.append(dict(set=name, name=entry["name"], recipe=entry["recipe"],
                                  impl=sets.impl_path(entry["impl"])))
    return found


def evaluate(entry: dict, max_examples: int) -> dict:
    """check twice: as a user runs it (every reference; the recorded call's flag shows first), and against
    the Hopper oracle alone (does the bug show in the numbers at all?)."""
    from parity.check import CheckPlan, run_check
    from parity.impls import builtin_for_recipe, load_impl
    from parity.policy import Policy
    from parity.runner import Comparison
    start = time.perf_counter()
    candidate = load_impl(entry["impl"], recipe=entry["recipe"])
    full = run_check(CheckPlan.make(candidate, device="cpu"), device="cpu", max_examples=max_examples)
    model = load_impl(builtin_for_recipe("hopper", candidate.recipe))
    alone = run_check(CheckPlan(candidate, model, Policy.EXACT, [Comparison(candidate, model, Policy.EXACT)]),
                      device="cpu", max_examples=max_examples)
    kinds = sorted({str(v.kind.value) for v in full.violations})
    return {key: entry[key] for key in ("set", "name", "recipe")} | dict(
        verdict=full.verdict.value, kinds=kinds, numbers=alone.verdict.value == "fail",
        numbers_case=alone.minimal_case.id if alone.minimal_case else None,
        numbers_said=[v.message[:160] for v in alone.violations[:2]], seconds=round(time.perf_counter() - start, 1))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sets", nargs="+", default=sets.SETS)
    parser.add_argument("--max-examples", type=int, default=60)
    args = parser.parse_args(argv)
    os.environ["FP8_PARITY_CPU_SCALED_MM"] = "hopper"
    rows = []
    for entry in entries(args.sets):
        rows.append(evaluate(entry, args.max_examples))
        print(json.dumps(rows[-1]), flush=True)
    print(f"fast-accumulation bugs detected by their numbers on a CPU with --cpu-gemm hopper: "
          f"{sum(r['numbers'] for r in rows)}/{len(rows)}; detected at all: {sum(r['verdict'] == 'fail' for r in rows)}")


if __name__ == "__main__":
    main()
