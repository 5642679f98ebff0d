"""check and bisect on a frozen held-out set (evals/heldout/setNN/, written without reading the
harness): detection, GEMM, class, operand and triggers, against the manifest.

    python -m evals.scoring.heldout_rates [--set set15] [--device cuda] [--only NAME ...] [--json OUT]

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
`python -m evals.scoring.timings --bisect-set NAME` times the command itself in fresh processes.
`--set set02` scores the second set (the first, set01, was seen after its first run: its figures
after that are training figures). A set is named setNN or by its folder before the move (heldout,
heldout2, ..., heldout15: evals/scoring/sets.py); `python -m evals.scoring.scores` scores them all.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from evals.scoring import sets


# Sets 16 and 17 (MX, written in another vocabulary): their tokens with a harness equivalent, fixed before
# their first run. "data:zero block" / "data:zero grad_output": an all-zero MX block, which the harness's
# zero-rows (or all-zero) data holds; "dtype:float32": the weight's dtype (s16_b27); "K != N": the harness's
# label. Tokens the harness has no condition for ("data:inf", "rows not multiple of 128", "M,K,N=256") stay
# as written, so they count as not named.
ALIASES = {"data:zero block": "data:zero_rows", "data:zero grad_output": "data:zero_rows",
           "dtype:float32": "fp32 weight", "K != N": "only when K != N"}


def trigger_found(token: str, triggers: list[str]) -> bool:
    token = ALIASES.get(token, token)
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


# Set 18 names a GEMM's operand by its side ("A", "B"), as its writer's brief put it ("the A or B operand of that
# GEMM"); the harness names the tensor. The sides by GEMM (added after set 18's first run, which scored them as
# written: docs/evaluation.md gives both figures).
SIDES = {"output": ("input", "weight"), "grad_input": ("grad_output", "weight"),
         "grad_weight": ("grad_output", "input")}


def expected_operand(entry: dict) -> str | None:
    """The manifest's operand as the harness names it: a side A/B read by the entry's GEMM."""
    operand, gemm = entry["operand"], entry["gemm"]
    if operand in ("A", "B") and gemm in SIDES:
        return SIDES[gemm][0 if operand == "A" else 1]
    return operand


def evaluate(entry: dict, device: str) -> dict:
    from parity.bisect import localize
    from parity.check import CheckPlan, run_check
    from parity.impls import load_impl
    impl = load_impl(sets.impl_path(entry["impl"]), recipe=entry["recipe"])
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
        operand_ok=result.operand == expected_operand(entry),
        triggers_ok=all(trigger_found(t, result.trigger) for t in entry["trigger"]),
        method=result.method, seconds=round(time.perf_counter() - start, 1),
        # the result-stage mistake that named the class, where the GEMM's bits were computed again: how many of
        # its elements it reproduced bit for bit ("512/512": exactly; None: not reproducible, or not that stage)
        exact=None if result.reproduction is None else f"{result.reproduction.equal}/{result.reproduction.elements}",
        phases=" ".join(f"{phase}:{value:.1f}" for phase, value in result.seconds.items()))
    row["correct"] = row["gemm_ok"] and row["class_ok"]
    return row


def score(name: str, device: str, only: list[str] | None = None, shard: str = "0/1") -> list[dict]:
    """The rows of every entry of set `name` scored on `device` (its manifest's devices), printed as it goes."""
    device_key = "cuda" if device == "cuda" else "cpu"
    shard_index, shards = (int(part) for part in shard.split("/"))
    if shards > 1:  # N scorers side by side: each its share of the cores (parity.sharding says why)
        from parity.sharding import share_host_threads
        share_host_threads(shards)
    rows = []
    for index, entry in enumerate(sets.manifest(name)):
        if device_key in entry["devices"] and (only is None or entry["name"] in only) \
                and index % shards == shard_index:
            rows.append(evaluate(entry, device))
            print(json.dumps(rows[-1]), flush=True)  # as it goes: a run cut short keeps what it scored
    return rows


def summarize(rows: list[dict], device: str) -> dict:
    """The figures of a set's rows: what check detects, what bisect localizes, correct entries passing, times."""
    import pandas as pd
    table = pd.DataFrame.from_records(rows)
    bugs, clean = table[table["expected"].str.startswith("none") == False], table[table["expected"].str.startswith("none")]  # noqa: E712,E501
    figures = dict(bugs=len(bugs), detected=int((bugs["check"] == "fail").sum()), correct=int(bugs["correct"].sum()),
                   gemm=int(bugs["gemm_ok"].sum()), class_=int(bugs["class_ok"].sum()),
                   operand=int(bugs["operand_ok"].sum()), triggers=int(bugs["triggers_ok"].sum()),
                   clean=len(clean), clean_passing=int(clean["correct"].sum()),
                   bar_s=30.0 if device == "cuda" else 60.0)
    timed = bugs["seconds"].dropna()  # a failing entry's seconds are its bisect's
    if len(timed):
        figures.update(bisect_median_s=round(float(timed.median()), 1), bisect_max_s=round(float(timed.max()), 1),
                       slowest=bugs.loc[timed.idxmax(), "name"], timed=len(timed),
                       within_bar=int((timed <= figures["bar_s"]).sum()))
    return figures


def summary_text(label: str, device: str, figures: dict) -> str:
    """The lines the scorer prints under its table."""
    bugs = figures["bugs"]
    text = (f"\n{label} on {device}: check detects {figures['detected']}/{bugs}; bisect "
            f"GEMM and class right {figures['correct']}/{bugs} (GEMM {figures['gemm']}, class "
            f"{figures['class_']}, operand {figures['operand']}); every trigger named "
            f"{figures['triggers']}/{bugs}; correct implementations passing "
            f"{figures['clean_passing']}/{figures['clean']}")
    if "timed" in figures:
        text += (f"\nbisect wall time per failing entry (in this process, imports warm): median "
                 f"{figures['bisect_median_s']:.1f} s, max {figures['bisect_max_s']:.1f} s ({figures['slowest']}); "
                 f"bar {figures['bar_s']:.0f} s: {figures['within_bar']}/{figures['timed']} within")
    return text


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--set", default="set01", help="the set: set01 .. set15, or its old folder name (heldout15)")
    parser.add_argument("--only", nargs="*", default=None)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--shard", default="0/1", help="I/N: only the entries whose index is I modulo N")
    args = parser.parse_args(argv)
    try:
        sets.set_name(args.set)
    except sets.SetError as err:
        parser.error(f"--set: {err}")
    import pandas as pd
    rows = score(args.set, args.device, args.only, args.shard)
    table = pd.DataFrame.from_records(rows)
    print(table.to_markdown(index=False))
    print(summary_text(args.set, args.device, summarize(rows, args.device)))
    if args.json:
        args.json.write_text(table.to_json(orient="records", indent=1))


if __name__ == "__main__":
    main()
