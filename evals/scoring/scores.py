"""The scores the documentation cites, regenerated: the zoo and every held-out set on one device,
each set's results under evals/results/<device>/, and one page, docs/scores.md, from every results
folder present (cpu; cuda when a GPU run's folder is copied back).

    python -m evals.scoring.scores --device cpu                       the zoo and all 15 sets (an hour or more)
    python -m evals.scoring.scores --device cuda --sets set14 set15   only these: their results, then the page
    python -m evals.scoring.scores --render-only                      the page from the results present

The scoring is zoo_rates' and heldout_rates', run in this process. Each results file (zoo.json,
setNN.json) holds the command, its date, the git commit, the device, torch's version, the figures
and every row. A set is named setNN or by its old folder name (heldout15).
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from evals.scoring import sets

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "evals" / "results"
PAGE = REPO / "docs" / "scores.md"
HISTORY = "history"  # evals/results/history/: the run reports written before this page existed
ZOO = "zoo"
EVERYTHING = [ZOO, *sets.SETS]
GENERATED = ("evals/results", "docs/scores.md")  # what a run writes: not what makes its commit dirty


def commit() -> str:
    """HEAD's short hash, `+dirty` when the tree differs from it outside what a run writes."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True, cwd=REPO).stdout.strip()
    head = git("rev-parse", "--short=12", "HEAD") or "unknown"
    dirty = git("status", "--porcelain", "--", ".", *(f":!{path}" for path in GENERATED))
    return head + ("+dirty" if dirty else "")


def provenance(device: str, argv: list[str]) -> dict:
    """What produced a run's results: the command, when, from which commit, on what."""
    from parity.env import environment
    env = environment(device)
    return dict(command=shlex.join(["python", "-m", "evals.scoring.scores", *argv]),
                date=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), commit=commit(), device=device,
                torch=env["torch"], torchao=env["torchao"], machine=env["gpu"] or env["cpu"])


def score(name: str, device: str) -> dict:
    """The figures and rows of the zoo or one set on `device` (scored in this process)."""
    from evals.scoring import heldout_rates, zoo_rates
    start = time.perf_counter()
    if name == ZOO:
        rows = zoo_rates.rates(device)
        figures = zoo_rates.summarize(rows)
        print(zoo_rates.summary_text(figures, device), flush=True)
    else:
        rows = heldout_rates.score(name, device)
        figures = heldout_rates.summarize(rows, device)
        print(heldout_rates.summary_text(name, device, figures), flush=True)
    return dict(name=name, seconds=round(time.perf_counter() - start), figures=figures, rows=rows)


def run(device: str, names: list[str], argv: list[str]) -> None:
    """Score each of `names` on `device`, writing its results file as soon as it is done."""
    made = provenance(device, argv)
    folder = RESULTS / device
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        print(f"== {name} on {device}", flush=True)
        result = {**made, **score(name, device)}
        (folder / f"{name}.json").write_text(json.dumps(result, indent=1, default=str) + "\n")


# ---- the page -----------------------------------------------------------------------------------------------


def load_results() -> dict[str, dict[str, dict]]:
    """device -> name -> results, for every results folder under evals/results/ but the history."""
    found = {}
    for folder in sorted(path for path in RESULTS.iterdir() if path.is_dir() and path.name != HISTORY):
        results = {path.stem: json.loads(path.read_text()) for path in sorted(folder.glob("*.json"))}
        if results:
            found[folder.name] = results
    return found


def heading(result: dict) -> str:
    return (f"`{result['command']}` ({result['date']}, commit {result['commit']}, torch {result['torch']}, "
            f"{result['machine']})")


def heldout_table(results: list[dict], device: str) -> list[str]:
    """One row per set: detection, GEMM and class, operand, triggers, correct implementations passing, times."""
    lines = ["| set | check detects | bisect GEMM and class | operand | every trigger | correct implementations "
             "passing | bisect median / max (s) |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for result in results:
        figures, bugs = result["figures"], result["figures"]["bugs"]
        times = (f"{figures['bisect_median_s']:.1f} / {figures['bisect_max_s']:.1f} ({figures['slowest']})"
                 if "timed" in figures else "-")
        lines.append(f"| [{result['name']}](../evals/results/{device}/{result['name']}.json) | "
                     f"{figures['detected']}/{bugs} | {figures['correct']}/{bugs} | {figures['operand']}/{bugs} | "
                     f"{figures['triggers']}/{bugs} | {figures['clean_passing']}/{figures['clean']} | {times} |")
    return lines


def device_section(device: str, results: dict[str, dict]) -> list[str]:
    import pandas as pd
    lines = [f"## {device}", ""]
    scored = [results[name] for name in sets.SETS if name in results]
    missing = [name for name in sets.SETS if name not in results]
    lines += ["### Held-out sets", ""]
    if missing:
        lines += [f"**Partial: no results on {device} for {', '.join(missing)}.**", ""]
    runs: dict[tuple[str, str], list[dict]] = {}
    for result in scored:
        runs.setdefault((result["command"], result["date"]), []).append(result)
    for group in runs.values():
        lines += [f"#### {heading(group[0])}", "", *heldout_table(group, device), ""]
    lines += ["### The zoo", ""]
    if ZOO not in results:
        lines += [f"**Partial: no zoo results on {device}.**", ""]
        return lines
    zoo = results[ZOO]
    figures = zoo["figures"]
    lines += [f"#### {heading(zoo)}", "",
              f"check kills {figures['killed']}/{figures['judged']}; bisect localizes "
              f"{figures['localized']}/{figures['judged']}; torchao-style thresholds catch "
              f"{figures['torchao_style']}/{figures['mutants']}.", "",
              pd.DataFrame.from_records(zoo["rows"]).to_markdown(index=False), ""]
    return lines


def render() -> str:
    lines = [
        "# Scores", "",
        "Generated by `python -m evals.scoring.scores` from the results under `evals/results/<device>/`; do not "
        "edit by hand. Each section names the command that produced its figures and when. `--sets NAME ...` "
        "reruns only those (zoo, set01 .. set19) and re-renders; `--render-only` re-renders.", "",
        "- Held-out sets (`evals/heldout/setNN/`, frozen before their first run): per set, the buggy "
        "implementations check detects, those bisect names the right first GEMM and bug class of (operand and "
        "every trigger apart), the correct implementations that pass, and bisect's wall time per buggy entry "
        "(in one process, imports warm; `python -m evals.scoring.timings --bisect-set NAME` times fresh "
        "processes). Scoring rules: `evals/scoring/heldout_rates.py`. Set 1 was seen after its first run: "
        "its figures are training figures.",
        "- The zoo (`evals/zoo/mutants.py`): what check kills, what bisect localizes, and what a torchao-style "
        "SQNR test catches (`evals/scoring/zoo_rates.py`).",
        "- Earlier run reports, first runs and runs after fixes: "
        f"[evals/results/{HISTORY}/](../evals/results/{HISTORY}/).", ""]
    found = load_results()
    if not found:
        lines += ["No results yet: run `python -m evals.scoring.scores --device cpu`.", ""]
    for device, results in found.items():
        lines += device_section(device, results)
    return "\n".join(lines).rstrip() + "\n"


def names_of(requested: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """`zoo` and set names (setNN or the old heldoutN) as results names, in the order given, once each."""
    names = []
    for name in requested:
        try:
            resolved = ZOO if name == ZOO else sets.set_name(name)
        except sets.SetError as err:
            parser.error(f"--sets: {err} (or zoo)")
        if resolved not in names:
            names.append(resolved)
    return names


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m evals.scoring.scores", description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--sets", nargs="+", default=EVERYTHING, metavar="NAME",
                        help="zoo and/or sets (set01 .. set19, or heldout .. heldout15 for the first 15); "
                             "default: all of them")
    parser.add_argument("--render-only", action="store_true", help="only re-render docs/scores.md")
    args = parser.parse_args(argv)
    names = names_of(args.sets, parser)
    if not args.render_only:
        run(args.device, names, argv)
    PAGE.parent.mkdir(exist_ok=True)
    PAGE.write_text(render())
    print(f"wrote {PAGE.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
