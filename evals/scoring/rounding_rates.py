"""How many elements of each GEMM result differ from the exact result correctly rounded (n_diff of the rows
against the recipe's exact emulation), for correct implementations and two bf16-accumulation bugs of the
held-out sets, on this device: groundwork for a statistical accumulation check (a measurement, not a test).

    python -m evals.scoring.rounding_rates --device cuda --shard I/N --out F.jsonl

Results: reports/reference-h200-accumulation/.
"""
import argparse
import json
import os

from evals.scoring import sets
from parity.impls import load_impl
from parity.check import CheckPlan
from parity.cases import Case
from parity.runner import run_case

IMPLS = [("fp8_impl", None), ("fp8_impl:rowwise", None), ("fp8_impl:rowwise_with_gw_hp", None),
         ("fp8_impl:blockwise", None), ("torchao:tensorwise", None), ("torchao:rowwise", None),
         ("torchao:blockwise", None),
         ("evals/heldout/set10/bw_conv.py", "blockwise"), ("evals/heldout/set10/bw_module.py", "blockwise"),
         ("evals/heldout/set09/bw_func_qdq.py", "blockwise"),
         ("evals/heldout/set09/bw_module_kblock.py", "blockwise"),
         ("evals/heldout/set09/bw_conv_bmm.py", "blockwise"),
         # bf16 partial sums per 128-block: inside the elementwise bound at small K on the H200
         ("evals/heldout/set10/bug_bw_conv_04.py", "blockwise"),
         ("evals/heldout/set09/bug_bw_08.py", "blockwise")]
SHAPES = [(128, 256, 128), (256, 256, 256), (256, 512, 384), (512, 1024, 256), (1024, 2048, 512)]
DISTS = ["normal", "heavy", "outlier100", "uniform"]


def impl_spec(path, recipe):
    """A built-in's name, or a held-out file's `path:attr` from its set's manifest (which names the file by
    its folder when the set was frozen, property_tests/heldoutN/)."""
    if recipe is None:
        return path
    folder, file = os.path.split(path)
    by_file = {e["impl"].split(":")[0].rsplit("/", 1)[1]: e["impl"] for e in sets.manifest(os.path.basename(folder))}
    return sets.impl_path(by_file[file])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda")
    p.add_argument("--shard", default="0/1", help="I/N: every N-th job from the I-th")
    p.add_argument("--out", required=True, help="JSON lines, one per GEMM result")
    a = p.parse_args()
    i, n = map(int, a.shard.split("/"))
    jobs = [(spec, rec, shape, dt, dist, seed) for (spec, rec) in IMPLS for shape in SHAPES for dt in ("bf16", "fp32")
            for dist in DISTS for seed in (0, 1)]
    jobs = jobs[i::n]
    plans = {}
    with open(a.out, "w") as f:
        for spec, rec, (M, K, N), dt, dist, seed in jobs:
            try:
                if spec not in plans:
                    plans[spec] = CheckPlan.make(load_impl(impl_spec(spec, rec), recipe=rec), device=a.device)
                plan = plans[spec]
                case = Case.from_id(f"M{M}K{K}N{N}|in:{dt}:C|w:{dt}:C|go:C|{dist}|seed{seed}")
                rows = run_case(case, plan.comparisons, device=a.device)
                for r in (row.record() for row in rows):
                    if r["policy"] == "accumulation" and not r["skipped"]:
                        f.write(json.dumps(dict(impl=spec, case=case.id, tensor=r["tensor"], n_diff=r["n_diff"],
                                                numel=r["numel"], bound_ratio=r["bound_ratio"], sqnr=r["sqnr_db"],
                                                ulp_max=r["ulp_max"], error=r["error"])) + "\n")
            except Exception as e:  # noqa: BLE001 - recorded, the next job runs
                f.write(json.dumps(dict(impl=spec, case=f"{M},{K},{N},{dt},{dist},{seed}", error=repr(e)[:300])) + "\n")
            f.flush()


if __name__ == "__main__":
    main()
