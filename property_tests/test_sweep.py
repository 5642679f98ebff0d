"""`fp8-parity sweep`, `report` and `diff` end to end, and the sweep's case presets."""

from __future__ import annotations

import gzip

import pandas as pd
import pytest

from parity.cases import Case
from parity.cli import main
from parity.sweep import PRESETS, Preset, llama3_shapes, nanochat_shapes, sample_cases


def test_presets_name_real_layer_shapes():
    assert ("nanochat-d20 mlp.fc", 1280, 5120) in nanochat_shapes(20)
    assert ("llama3-70b mlp.down", 28672, 8192) in llama3_shapes("70b")
    quick = PRESETS["quick"].cases("cuda")
    assert len(quick) == len({case for _, case in quick}) > 100  # distinct cases
    assert all(case.M == 1024 for label, case in quick if label.startswith(("nanochat", "llama")))


def test_the_default_sweep_on_a_cpu_runs_small_cases_and_says_so():
    """A laptop's default: no full-width layers (their float64 references take minutes on two
    cores), 60 sampled cases up to 128 beside the edge cases; the description says it."""
    quick = PRESETS["quick"].cases("cpu")
    assert not [label for label, _ in quick if label not in ("edge case", "sampled")]
    assert len(quick) == len({case for _, case in quick}) <= 80
    assert max(max(case.M, case.K, case.N) for label, case in quick if label == "sampled") <= 128
    assert PRESETS["quick"].describe("cpu").startswith("no named layer shapes (on a CPU")
    assert "60 sampled cases with M, K, N up to 128" in PRESETS["quick"].describe("cpu")


def test_sample_is_deterministic():
    assert sample_cases(20, seed=3) == sample_cases(20, seed=3)
    assert len(set(sample_cases(20))) == 20


SMALL = Preset("quick", "one small named shape and a sample", (("small layer", 64, 32),), {"cpu": 32}, 2, 64)


def test_sweep_writes_a_report_and_reports_round_trip(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(PRESETS, "quick", SMALL)
    out = tmp_path / "sweep"
    code = main(["sweep", "--preset", "quick", "--samples", "2", "--device", "cpu", "--quiet", "--out", str(out),
                 "--impl", "fp8_impl", "--impl", "torchao:rowwise"])
    text = capsys.readouterr().out
    assert code == 0 and text.startswith("PASS: fp8_impl (tensorwise) is ")
    assert "bitwise equal to torchao:tensorwise in" in text.splitlines()[0]
    summary = (out / "summary.md").read_text()
    assert "PASS: fp8_impl" in summary.splitlines()[2] and "by named shape" in summary
    with gzip.open(out / "results.csv.gz", "rt") as f:
        table = pd.read_csv(f)
    assert set(table["impl"]) == {"fp8_impl", "torchao:rowwise"}
    # each against fp64, its recipe's reference implementation and its recipe's exact emulation
    assert set(zip(table["impl"], table["reference"])) == {
        ("fp8_impl", "fp64"), ("fp8_impl", "torchao:tensorwise"), ("fp8_impl", "emulated:tensorwise"),
        ("torchao:rowwise", "fp64"), ("torchao:rowwise", "emulated:rowwise")}
    assert set(table["recipe"]) == {"tensorwise", "rowwise"}
    assert {"small layer", "sampled", "edge case"} <= set(table["shape"])
    assert "· cases 1 named layer shapes at 32 tokens; edge cases; 2 sampled cases" in summary

    assert main(["report", str(out), "--out", str(tmp_path / "again")]) == 0
    assert (tmp_path / "again" / "index.html").exists()
    assert main(["diff", str(out), str(tmp_path / "again")]) == 0
    assert "No row moved beyond noise" in capsys.readouterr().out


def test_sweep_exits_1_when_the_candidate_loses_parity(tmp_path, capsys):
    code = main(["sweep", "--preset", "quick", "--samples", "0", "--device", "cpu", "--quiet", "--out",
                 str(tmp_path), "--impl", "evals/zoo/mutants.py:weight_scale_bf16"])
    out = capsys.readouterr().out
    assert code == 1 and out.startswith("FAIL")
    # a failing report says what to run next in its summary, before the tables: bisect on the smallest failing case
    command = "fp8-parity bisect --impl evals/zoo/mutants.py:weight_scale_bf16 --case 'M"
    assert out.splitlines()[1].startswith(f"next: {command}"), out
    summary = (tmp_path / "summary.md").read_text().rstrip().splitlines()
    nxt = next(i for i, line in enumerate(summary) if line.startswith("**What to run next:**"))
    first_table = next(i for i, line in enumerate(summary) if line.startswith("## "))
    assert summary[nxt].startswith(f"**What to run next:** `{command}") and nxt < first_table, summary[:nxt + 1]


def test_sharded_sweep_equals_one_worker():
    """`--gpus N` splits cases round-robin over N processes: same rows as one process (here 2 CPU workers)."""
    from parity.cases import Case
    from parity.impls import load_impl
    from parity.sweep import run_sweep, run_sweep_sharded, sweep_comparisons
    labelled = [("sampled", Case(lead=(16,), K=16 * k, N=32, seed=k)) for k in range(1, 4)]
    one = run_sweep(labelled, sweep_comparisons([load_impl("fp8_impl")], "cpu"), device="cpu")
    two = run_sweep_sharded(labelled, ["fp8_impl"], devices=["cpu", "cpu"])
    key = ["case_id", "reference", "tensor", "step"]
    one, two = one.sort_values(key).reset_index(drop=True), two.sort_values(key).reset_index(drop=True)
    assert two["gpu"].nunique() == 2 and len(one) == len(two)
    pd.testing.assert_series_equal(one["sqnr_db"], two["sqnr_db"])


AGREEMENT_CASES = [Case(lead=(32,), K=64, N=48, input_layout="T"), Case(lead=(128,), K=256, N=128, dist="outlier"),
                   Case(lead=(2, 64), K=128, N=256, bias=True, weight_dtype="fp32")]


@pytest.mark.parametrize("impl", ["fp8_impl", "fp8_impl:rowwise", "fp8_impl:rowwise_with_gw_hp", "fp8_impl:blockwise",
                                  "torchao:tensorwise", "torchao:rowwise", "torchao:rowwise_with_gw_hp", "bf16",
                                  "evals/zoo/mutants.py:weight_scale_bf16"])
def test_check_and_sweep_agree_on_every_builtin_pair(impl):
    """One verdict path: for every (implementation, reference) pair the sweep makes, `check` on the
    same cases reaches the same verdict, and the report's verdict is their conjunction."""
    from parity.check import CheckPlan, run_check
    from parity.impls import load_impl
    from parity.policy import evaluate
    from parity.report import verdict
    from parity.sweep import run_sweep, sweep_comparisons
    candidate = load_impl(impl)
    comparisons = sweep_comparisons([candidate], "cpu")
    frame = run_sweep([("sampled", case) for case in AGREEMENT_CASES], comparisons, device="cpu")
    verdicts = []
    for comparison in comparisons:
        rows = frame[frame["reference"] == comparison.reference.name]
        swept = not evaluate(rows, impls=[candidate.name])
        checked = run_check(CheckPlan.make(candidate, comparison.reference, oracle=False), cases=AGREEMENT_CASES)
        assert checked.verdict in ("pass", "fail") and (checked.verdict == "pass") == swept, (
            f"{impl} vs {comparison.reference.name}: check {checked.verdict}, sweep {'pass' if swept else 'fail'}")
        verdicts.append(swept)
    assert verdict(frame, candidate=candidate.name).ok == all(verdicts)
    assert all(verdicts) == (impl != "evals/zoo/mutants.py:weight_scale_bf16")


def test_the_cpu_layers_preset_runs_real_layer_shapes_on_a_cpu():
    """Issue 29, build 3: a documented preset covers real layer shapes on a CPU (past every case of check's
    search, M, K, N <= 256), at a token count equal to no K or N (two GEMMs of the same shapes cost the
    operand diagnosis twice the time)."""
    from parity.sweep import PRESETS
    named = [case for label, case in PRESETS["cpu-layers"].cases("cpu") if label not in ("edge case", "sampled")]
    assert len(named) == 12 and min(case.M for case in named) >= 512
    assert max(case.K for case in named) == max(case.N for case in named) == 2048
    assert all(case.M not in (case.K, case.N) for case in named)
