"""Detection and localization rates on the mutant zoo, beside torchao-style SQNR thresholds.

    python -m evals.scoring.zoo_rates [--device cuda]

For every mutant: does `fp8-parity check` kill it, does `fp8-parity bisect` name its GEMM,
operand, class and trigger, and does a torchao-style accuracy test catch it (output SQNR
>= 18 dB and grad_weight SQNR >= 17 dB against a bf16 nn.Linear(16, 32) on a 16x16 input,
as torchao's own float8 tests assert)? `python -m evals.scoring.scores` puts its table in docs/scores.md.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

from parity.bisect import localize
from parity.check import CheckPlan, run_check
from parity.impls import load_impl
from parity.metrics import sqnr_db
from evals.zoo.mutants import MUTANTS, Mutant

TORCHAO_OUTPUT_DB, TORCHAO_GRAD_WEIGHT_DB = 18.0, 17.0


def torchao_style_catches(mutant: Mutant, device: str = "cpu", seed: int = 0) -> bool:
    """One toy-shape accuracy test, as torchao writes them: Linear(16, 32), a 16x16 bf16 input,
    the FP8 layer's output and grad_weight against the bf16 layer's, by SQNR (blockwise mutants:
    Linear(128, 256) on a 128x128 input, the smallest shape that recipe takes)."""
    size = max(16, load_impl(mutant.spec, recipe=mutant.recipe).recipe.alignment)
    torch.manual_seed(seed)
    reference = nn.Linear(size, 2 * size, dtype=torch.bfloat16, device=device)
    candidate_linear = nn.Linear(size, 2 * size, dtype=torch.bfloat16, device=device)
    candidate_linear.load_state_dict(reference.state_dict())
    try:
        candidate, _, _ = load_impl(mutant.spec, recipe=mutant.recipe).build(candidate_linear)
        x = torch.randn(size, size, dtype=torch.bfloat16, device=device)
        out_ref, out = reference(x), candidate(x.clone())
        out_ref.sum().backward()
        out.sum().backward()
    except Exception:  # noqa: BLE001 - a crash is caught by any test
        return True
    return not (sqnr_db(out.float(), out_ref.float()) >= TORCHAO_OUTPUT_DB and
                sqnr_db(candidate_linear.weight.grad.float(), reference.weight.grad.float()) >= TORCHAO_GRAD_WEIGHT_DB)


def rates(device: str = "cpu") -> list[dict]:
    rows = []
    for mutant in MUTANTS:
        if mutant.gpu_only and device != "cuda":
            rows.append(dict(mutant=mutant.name, recipe=mutant.recipe, category=mutant.category,
                             check="n/a (GPU only)", bisect="n/a (GPU only)",
                             torchao_style=torchao_style_catches(mutant, device)))
            continue
        plan = CheckPlan.make(load_impl(mutant.spec, recipe=mutant.recipe), device=device)
        checked = run_check(plan, device=device, max_examples=60)
        result = localize(plan, device=device, max_examples=60)
        localized = (result.category == mutant.category and sorted(result.gemm) == sorted(mutant.gemms)
                     and result.operand == mutant.operand
                     and (mutant.trigger is None or any(mutant.trigger in t for t in result.trigger)))
        rows.append(dict(mutant=mutant.name, recipe=mutant.recipe, category=mutant.category,
                         check=checked.verdict == "fail", cases_to_kill=checked.cases_run, bisect=localized,
                         bisect_said=f"{result.category} / {','.join(result.gemm)} / {result.operand} / "
                                     f"{'; '.join(result.trigger) or '-'}",
                         torchao_style=torchao_style_catches(mutant, device)))
    return rows


def summarize(rows: list[dict]) -> dict:
    """The zoo's figures: mutants check kills and bisect localizes (of those this device runs), and the
    mutants a torchao-style accuracy test catches (of all)."""
    judged = [row for row in rows if row["check"] != "n/a (GPU only)"]
    return dict(judged=len(judged), killed=sum(bool(row["check"]) for row in judged),
                localized=sum(bool(row["bisect"]) for row in judged),
                torchao_style=sum(bool(row["torchao_style"]) for row in rows), mutants=len(rows))


def summary_text(figures: dict, device: str) -> str:
    """The line the scorer prints under its table."""
    return (f"\ncheck kills {figures['killed']}/{figures['judged']}; bisect localizes "
            f"{figures['localized']}/{figures['judged']}; torchao-style thresholds catch "
            f"{figures['torchao_style']}/{figures['mutants']} (on {device})")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    import pandas as pd
    rows = rates(args.device)
    print(pd.DataFrame.from_records(rows).to_markdown(index=False))
    print(summary_text(summarize(rows), args.device))


if __name__ == "__main__":
    main()
