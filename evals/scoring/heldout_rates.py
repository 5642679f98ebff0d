"""check and bisect on the held-out set (property_tests/heldout/, frozen, written without reading the
harness): detection, GEMM, class, operand and triggers, against the manifest.

    python -m property_tests.heldout_rates [--device cuda] [--only NAME ...] [--markdown]

Scoring, fixed before the first run: an entry's GEMM is right when bisect's first GEMM is the
manifest's `gemm` (the first GEMM whose result is wrong); its class when bisect's category is the
manifest's `category`; every manifest trigger must be among bisect's triggers (token -> label:
"non-contiguous X" -> "only with non-contiguous X", "K == N", "N-D input", "fp32 input" ->
"only with fp32 input", "second call" -> "only from the second call", "bias" -> "only with a bias",
"data:X" -> "only with X data" or "or with X data" (data:zero_rows also accepts an all-zero tensor,
data:outlier any ratio), "gpu only" -> "only on the GPU"; a dtype token also as "or with fp32 input":
since the runs after sets 12 and 13's first runs, bisect names a second dtype that triggers the same
failure). A correct entry must pass check and leave bisect nothing to localize. Entries whose devices
do not include this device are not scored here.
Each row also times bisect (its check, which is the entry's check verdict, and the localization, in
this process with imports warm);
`python -m property_tests.timings --bisect-set NAME` times the command itself in fresh processes.
`--set heldout2` scores the second set (the first, property_tests/heldout, was seen after its first
run: its figures after that are training figures).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

SETS = Path(__file__).resolve().parent


def trigger_found(token: str, triggers: list[str]) -> bool:
    labels = {
        "non-contiguous input": "only with non-contiguous input", "non-contiguous weight":
        "only with non-contiguous weight", "non-contiguous grad_output": "only with non-contiguous grad_output",
        "K == N": "only when K == N", "N-D input": "only with N-D input", "fp32 input": "only with fp32 input",
        "fp16 input": "only with fp16 input", "fp32 weight": "only with fp32 weight",
        "second call": "only from the second call", "bias": "only with a bias", "gpu only": "only on the GPU",
    }
    if token.startswith("data:"):  # "only with X data", and "or with X data" for each further distribution
        dist = token[5:]
        accepted = {"zero_rows": ("zero_rows", "zeros"), "outlier": ("outlier",)}.get(dist, (dist,))
        return any(t.endswith(" data") and t.startswith(("only with ", "or with ")) and
                   t.split(" with ", 1)[1][:-5].startswith(accepted) for t in triggers)
    if token.endswith((" input", " weight")) and not token.startswith("non-contiguous"):  # a dtype: "or with" too
        return any(t.startswith((labels[token], labels[token].replace("only with", "or with"))) for t in triggers)
    return any(t.startswith(labels.get(token, token)) for t in triggers)


def evaluate(entry: dict, device: str) -> dict:
    from parity.bisect import localize
    from parity.check import CheckPlan, run_check
    from parity.impls import load_impl
    impl = load_impl(str(SETS.parent / entry["impl"]), recipe=entry["recipe"])
    plan = CheckPlan.make(impl, device=device)
    start = time.perf_counter()
    row = dict(name=entry["name"], recipe=entry["recipe"], expected=f"{entry['category']} / {entry['gemm']} / "
               f"{entry['operand']} / {', '.join(entry['trigger']) or '-'}")
    if entry["category"] == "none":
        checked = run_check(plan, device=device, max_examples=60)
        row.update(check=checked.verdict, correct=checked.verdict == "pass", said="-",
                   seconds=round(time.perf_counter() - start, 1))
        return row
    # bisect as a user runs it: its own check (the same search as `check`: its verdict is check's), then
    # the localization
    try:
        result = localize(plan, device=device, max_examples=60)
    except Exception as err:  # noqa: BLE001 - a crash of the harness scores as a miss, and says so
        row.update(check="harness error", said=f"harness error: {type(err).__name__}: {err}", gemm_ok=False,
                   class_ok=False, operand_ok=False, triggers_ok=False, method=None, correct=False,
                   seconds=round(time.perf_counter() - start, 1))
        return row
    row.update(
        check=result.verdict,
        said=f"{result.category} / {result.first} / {result.operand} / {'; '.join(result.trigger) or '-'}",
        gemm_ok=result.first == entry["gemm"], class_ok=result.category == entry["category"],
        operand_ok=result.operand == entry["operand"],
        triggers_ok=all(trigger_found(t, result.trigger) for t in entry["trigger"]),
        method=result.method, seconds=round(time.perf_counter() - start, 1),
        phases=" ".join(f"{phase}:{value:.1f}" for phase, value in result.seconds.items()))
    row["correct"] = row["gemm_ok"] and row["class_ok"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--set", default="heldout", help="the folder of the set (heldout, heldout2)")
    parser.add_argument("--only", nargs="*", default=None)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--shard", default="0/1", help="I/N: only the entries whose index is I modulo N")
    args = parser.parse_args()
    import pandas as pd
    manifest = json.loads((SETS / args.set / "manifest.json").read_text())
    device_key = "cuda" if args.device == "cuda" else "cpu"
    shard, shards = (int(part) for part in args.shard.split("/"))
    rows = []
    for index, entry in enumerate(manifest):
        if device_key in entry["devices"] and (args.only is None or entry["name"] in args.only) \
                and index % shards == shard:
            rows.append(evaluate(entry, args.device))
            print(json.dumps(rows[-1]), flush=True)  # as it goes: a run cut short keeps what it scored
    table = pd.DataFrame.from_records(rows)
    print(table.to_markdown(index=False))
    bugs, clean = table[table["expected"].str.startswith("none") == False], table[table["expected"].str.startswith("none")]  # noqa: E712,E501
    print(f"\n{args.set} on {args.device}: check detects {int((bugs['check'] == 'fail').sum())}/{len(bugs)}; bisect "
          f"GEMM and class right {int(bugs['correct'].sum())}/{len(bugs)} (GEMM {int(bugs['gemm_ok'].sum())}, class "
          f"{int(bugs['class_ok'].sum())}, operand {int(bugs['operand_ok'].sum())}); every trigger named "
          f"{int(bugs['triggers_ok'].sum())}/{len(bugs)}; correct implementations passing "
          f"{int(clean['correct'].sum())}/{len(clean)}")
    timed = bugs["seconds"].dropna()  # a failing entry's seconds are its bisect's
    if len(timed):
        bar = 30.0 if args.device == "cuda" else 60.0
        print(f"bisect wall time per failing entry (in this process, imports warm): median {timed.median():.1f} s, "
              f"max {timed.max():.1f} s ({bugs.loc[timed.idxmax(), 'name']}); bar {bar:.0f} s: "
              f"{int((timed <= bar).sum())}/{len(timed)} within")
    if args.json:
        args.json.write_text(table.to_json(orient="records", indent=1))


if __name__ == "__main__":
    main()
