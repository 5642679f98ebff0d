"""Planted bugs that today's accumulation bound passes and the exact (Hopper) oracle alone fails.

    python -m evals.scoring.exact_gain --device cuda [--sets set01 ...] [--categories accumulation precision]
                                       [--max-examples 40] [--shard I/N] [--json OUT]

Each planted bug of the held-out sets (of the given bug classes; every class with --categories all)
and of the zoo is checked twice, each time against one reference alone, as issue 27 asks:

    bound   against emulated:<recipe> with the accumulation policy: what a GPU run judged by before
            the exact oracle (the float64 emulation within the accumulation bound)
    exact   against hopper:<recipe> with the exact policy: bit for bit wherever the calibration vouches
            for the call, the bound elsewhere

An entry counts when `bound` passes and `exact` fails: a bug only the exact oracle catches. On a CPU run
with --cpu-gemm hopper semantics (FP8_PARITY_CPU_SCALED_MM=hopper) both see the H200's numbers; on a GPU
they see the GPU's own. Correct entries (class none) are left out: both must pass them (heldout_rates says so).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from evals.scoring import sets

ZOO = Path(__file__).resolve().parents[1] / "zoo" / "mutants.py"


def zoo_entries() -> list[dict]:
    from evals.zoo.mutants import MUTANTS  # the zoo's own list of planted bugs
    return [dict(set="zoo", name=mutant.name, recipe=mutant.recipe, impl=f"{ZOO}:{mutant.name}",
                 category=mutant.category) for mutant in MUTANTS]


def entries(names: list[str], categories: list[str], device: str) -> list[dict]:
    found = zoo_entries()
    key = "cuda" if device == "cuda" else "cpu"
    for name in names:
        for entry in sets.manifest(name):
            if entry["category"] == "none" or key not in entry["devices"]:
                continue
            if "all" in categories or entry["category"] in categories:
                found.append(dict(set=name, name=entry["name"], recipe=entry["recipe"],
                                  impl=sets.impl_path(entry["impl"]), category=entry["category"]))
    return found


def _alone(candidate, reference, policy, device: str, max_examples: int):
    from parity.check import CheckPlan, run_check
    from parity.runner import Comparison
    plan = CheckPlan(candidate, reference, policy, [Comparison(candidate, reference, policy)])
    return run_check(plan, device=device, max_examples=max_examples)


def evaluate(entry: dict, device: str, max_examples: int) -> dict:
    from parity.impls import builtin_for_recipe, load_impl
    from parity.policy import Policy
    start = time.perf_counter()
    row = {key: entry[key] for key in ("set", "name", "recipe", "category")}
    try:
        candidate = load_impl(entry["impl"], recipe=entry["recipe"])
    except Exception as err:  # noqa: BLE001 - an entry that cannot load is a row that says so
        return row | dict(bound="load error", exact=None, error=str(err)[:200])
    emulated = load_impl(builtin_for_recipe("emulated", candidate.recipe))
    bound = _alone(candidate, emulated, Policy.ACCUMULATION, device, max_examples)
    row |= dict(bound=bound.verdict.value, bound_case=bound.minimal_case.id if bound.minimal_case else None)
    if bound.verdict.value == "pass":
        model = load_impl(builtin_for_recipe("hopper", candidate.recipe))
        exact = _alone(candidate, model, Policy.EXACT, device, max_examples)
        row |= dict(exact=exact.verdict.value, exact_case=exact.minimal_case.id if exact.minimal_case else None,
                    exact_said=[v.message[:200] for v in exact.violations[:2]])
    return row | dict(seconds=round(time.perf_counter() - start, 1))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--sets", nargs="+", default=sets.SETS)
    parser.add_argument("--categories", nargs="+", default=["accumulation", "precision"])
    parser.add_argument("--max-examples", type=int, default=40)
    parser.add_argument("--shard", default="0/1", help="I/N: only the entries whose index is I modulo N")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    index, shards = (int(part) for part in args.shard.split("/"))
    if shards > 1:
        from parity.sharding import share_host_threads
        share_host_threads(shards)
    rows = []
    for number, entry in enumerate(entries(args.sets, args.categories, args.device)):
        if number % shards == index:
            rows.append(evaluate(entry, args.device, args.max_examples))
            print(json.dumps(rows[-1]), flush=True)
    gained = [r for r in rows if r["bound"] == "pass" and r.get("exact") == "fail"]
    print(f"planted bugs checked: {len(rows)}; passed the bound: {sum(r['bound'] == 'pass' for r in rows)}; "
          f"of those failed by the exact oracle alone: {len(gained)} ({', '.join(r['name'] for r in gained)})")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
