"""`fp8-parity train`: lockstep training parity, the first diverging GEMM, and its case file.

Measured on the 2-core CPU (torch 2.13, torchao 0.18, OMP_NUM_THREADS=1): tiny model (2 layers,
d_model 64), 50 steps of fp8_impl, torchao:tensorwise, bf16 and bf16 from another seed in lockstep
take about 13 s; fp8_impl and torchao stay bitwise equal in every GEMM at every step.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from parity.cli import EXIT_FAIL, EXIT_USAGE, main
from parity.data import read_case_file
from parity.model import GPTConfig, MarkovSource, ModelError
from parity.train import TrainPlan, run_training, write_train_report

FAULTS = Path(__file__).resolve().parent / "train_faults.py"
STALE_CACHE = f"{FAULTS}:stale_weight_cache"
SKIPS_A_LAYER = f"{FAULTS}:skips_a_layer"
CI_BUDGET_S = 60  # the number for tiny, 50 steps, on the 2-core CPU


def test_tiny_50_steps_fp8_impl_stays_bitwise_with_torchao_and_reports(tmp_path):
    start = time.perf_counter()
    result = run_training(TrainPlan("fp8_impl", steps=50, device="cpu"), out_dir=tmp_path)
    seconds = time.perf_counter() - start
    print(f"\ntiny, 50 steps, 4 runs in lockstep on the CPU: {seconds:.1f} s (CI budget {CI_BUDGET_S} s)")
    assert result.divergence is None and result.loss_differs_at is None, result.verdict
    candidate = result.frame[result.frame["role"] == "candidate"]
    assert candidate["bitwise"].all() and candidate["step"].nunique() == 50
    assert result.verdict.ok, result.verdict
    sampled = candidate[candidate["sampled"]]
    assert sampled["sqnr_db"].between(15, 40).all()  # tensorwise fp8 against float64: ~25-30 dB
    assert (sampled["a_underflow_pct"] >= 0).all() and (sampled["b_saturated_pct"] > 0).all()
    losses = candidate.drop_duplicates("step")["loss"]
    assert losses.iloc[-1] < losses.iloc[0] and losses.iloc[-1] > result.source.entropy_rate  # learns; above the floor
    written = {path.name for path in write_train_report(result, tmp_path)}
    assert {"results.csv.gz", "env.json", "summary.md", "index.html", "loss.png"} <= written
    summary = (tmp_path / "summary.md").read_text()
    assert "PASS" in summary and "bitwise equal in every GEMM" in summary


def test_stale_weight_cache_is_localized_and_its_case_file_round_trips(tmp_path, capsys):
    result = run_training(TrainPlan(STALE_CACHE, steps=3, sample_every=10), out_dir=tmp_path)
    divergence = result.divergence
    assert (divergence.step, divergence.layer, divergence.gemm) == (1, "blocks.0.attn.c_q", "output")
    assert not result.verdict.ok and "bisect" in result.verdict.next_step
    saved = read_case_file(str(divergence.case_file))
    assert len(saved["steps"]) == 2 and saved["meta"]["steps"] == [0, 1]  # the call before: the cache goes stale
    assert saved["steps"][1]["input"].dtype == torch.bfloat16 and saved["meta"]["tensors"][1]["input"]["stride"]

    case_file = str(divergence.case_file)
    assert main(["check", "--impl", STALE_CACHE, "--case-file", case_file, "--device", "cpu", "--quiet"]) == EXIT_FAIL
    assert "file:" in capsys.readouterr().out  # the rerun command names the file
    report = tmp_path / "bisect.json"
    assert main(["bisect", "--impl", STALE_CACHE, "--case-file", case_file, "--device", "cpu",
                 "--json", str(report)]) == EXIT_FAIL
    localized = json.loads(report.read_text())
    assert localized["first"] == "output" and localized["category"] == "stale_state", localized


def test_converter_that_skips_a_layer_is_localized_to_that_layer(tmp_path):
    from property_tests.train_faults import SKIPPED_LAYER
    result = run_training(TrainPlan(SKIPS_A_LAYER, steps=2, sample_every=10))
    divergence = result.divergence
    assert (divergence.step, divergence.layer, divergence.gemm) == (0, SKIPPED_LAYER, "output")
    assert "must be bitwise equal" in result.verdict.headline


@pytest.mark.parametrize(("fault", "says"), [
    ("raises_at_second_step", "raised at step 1: RuntimeError: planted: the second call raises"),
    ("exits_at_second_step", "raised at step 1: ProcessExit: os._exit(0) was called"),
])
def test_an_implementation_that_raises_or_exits_is_a_finding_with_its_step(tmp_path, capsys, fault, says):
    spec = SKIPS_A_LAYER.replace("skips_a_layer", fault)
    assert main(["train", "--impl", spec, "--steps", "3", "--model", "tiny", "--device", "cpu", "--out",
                 str(tmp_path / "report"), "--quiet"]) == 1
    out = capsys.readouterr().out
    assert says in out
    assert "FAIL" in (tmp_path / "report" / "summary.md").read_text()


def test_bad_input_is_a_clear_error(capsys, tmp_path):
    with pytest.raises(ModelError, match=r"d_model = 72 not a multiple of 16.*round it to a multiple of 16"):
        GPTConfig("odd", n_layer=2, d_model=72, n_head=2, vocab_size=64, seq_len=32, batch_size=8)
    assert main(["train", "--impl", "fp8_impl", "--model", "tinny", "--device", "cpu", "--out",
                 str(tmp_path / "a")]) == EXIT_USAGE
    assert "unknown model 'tinny': did you mean 'tiny'?" in capsys.readouterr().err
    # block scales need every dim a multiple of 128: the tiny model's 64 is not
    blockwise = ["train", "--impl", "emulated:blockwise", "--device", "cpu", "--out", str(tmp_path / "b")]
    assert main(blockwise) == EXIT_USAGE
    assert "not a multiple of 128" in capsys.readouterr().err
    assert main(["check", "--impl", "fp8_impl", "--case-file", str(tmp_path / "missing.pt"), "--device", "cpu"]) \
        == EXIT_USAGE
    assert "does not exist" in capsys.readouterr().err


def test_markov_source_entropy_rate_is_exact():
    source = MarkovSource.make(vocab_size=16, successors=3, seed=5)
    assert torch.allclose(source.stationary @ source.transition, source.stationary, atol=1e-12)
    assert (source.transition > 0).sum(1).eq(3).all()
    # the empirical conditional entropy of a long sample approaches the exact rate
    tokens = source.batch(64, 400, torch.Generator().manual_seed(0))
    logp = source.transition[tokens[:, :-1], tokens[:, 1:]].log()
    assert abs(-logp.mean().item() - source.entropy_rate) < 0.02
