"""`fp8-parity train`: lockstep training parity, the first diverging GEMM, its case file, the report's
heatmaps, the training faults (each localized to its step, micro-batch, layer and GEMM), gradient
accumulation, activation checkpointing, your own model and data, and the d12 model for the H200.

Measured on the 2-core CPU (torch 2.13, torchao 0.18, OMP_NUM_THREADS=2): tiny model (2 layers,
d_model 64), 50 steps of fp8_impl, torchao:tensorwise, bf16 and bf16 from another seed in lockstep,
numerics every 10 steps, take about 10 s; fp8_impl and torchao stay bitwise equal in every GEMM at
every step. The faults' runs are 1-2 steps each. The d12 run is GPU-only (fp8_gpu).
"""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from parity.cli import EXIT_FAIL, EXIT_USAGE, main
from parity.data import read_case_file
from parity.model import GPT, GPTConfig, MarkovSource, ModelError, TokenFile, get_model_config
from parity.train import TrainError, TrainPlan, run_training
from parity.train_report import layer_step_grid, write_train_report

FAULTS = Path(__file__).resolve().parents[1] / "evals" / "zoo" / "train_faults.py"
STALE_CACHE = f"{FAULTS}:stale_weight_cache"
SKIPS_A_LAYER = f"{FAULTS}:skips_a_layer"
PREVIOUS_AMAX = f"{FAULTS}:scale_from_previous_amax"
AMAX_ONCE_PER_STEP = f"{FAULTS}:amax_once_per_step"
DELAYED = f"{FAULTS}:delayed_scaling"
RECOMPUTE_ADVANCES = f"{FAULTS}:recompute_advances_scale"
CI_BUDGET_S = 60  # the number for tiny, 50 steps, on the 2-core CPU
H200_BUDGET_S = 300  # the number for d12, 200 steps, on one H200
TINY_LAYERS = 13  # 2 blocks x (q, k, v, attention proj, MLP fc, MLP proj) + the head


def first(result) -> tuple:
    divergence = result.divergence
    return None if divergence is None else (divergence.step, divergence.micro, divergence.layer, divergence.gemm)


def test_tiny_50_steps_fp8_impl_stays_bitwise_with_torchao_and_reports(tmp_path):
    start = time.perf_counter()
    result = run_training(TrainPlan("fp8_impl", steps=50, device="cpu", sample_every=10), out_dir=tmp_path)
    seconds = time.perf_counter() - start
    print(f"\ntiny, 50 steps, 4 runs in lockstep on the CPU: {seconds:.1f} s (CI budget {CI_BUDGET_S} s)")
    assert result.divergence is None and result.loss_differs_at is None, result.verdict
    candidate = result.frame[result.frame["role"] == "candidate"]
    assert candidate["bitwise"].all() and candidate["step"].nunique() == 50
    assert result.verdict.ok, result.verdict
    sampled = candidate[candidate["sampled"]]
    assert sorted(sampled["step"].unique()) == [0, 10, 20, 30, 40, 49]  # every 10, and the last
    assert sampled["sqnr_db"].between(15, 40).all()  # tensorwise fp8 against float64: ~25-30 dB
    assert (sampled["a_underflow_pct"] >= 0).all() and (sampled["b_saturated_pct"] > 0).all()
    losses = candidate.drop_duplicates("step")["loss"]
    assert losses.iloc[-1] < losses.iloc[0] and losses.iloc[-1] > result.source.entropy_rate  # learns; above the floor

    # the heatmaps' grids: every converted layer (model order) x every sampled step
    sqnr = layer_step_grid(result, "sqnr_db", "grad_weight", worst="min")
    assert sqnr.shape == (TINY_LAYERS, 6) and list(sqnr.index) == result.layers and np.isfinite(sqnr).all().all()
    assert list(sqnr.index[:2]) == ["blocks.0.attn.c_q", "blocks.0.attn.c_k"] and sqnr.index[-1] == "lm_head"
    underflow = layer_step_grid(result, "a_underflow_pct", "grad_input", worst="max")  # grad_output in e5m2
    assert underflow.shape == (TINY_LAYERS, 6) and (underflow >= 0).all().all()

    # every step timed; a sampled step pays for the numerics, the others do not
    timing = result.timing
    assert len(timing) == 50 and (timing["seconds"] > 0).all()
    assert timing.loc[timing["sampled"], "numerics_s"].mean() > 2 * timing.loc[~timing["sampled"], "numerics_s"].mean()
    assert result.frame.attrs["env"]["seconds_per_step"] > 0

    written = {path.name for path in write_train_report(result, tmp_path)}
    assert {"results.csv.gz", "env.json", "summary.md", "index.html", "loss.png", "sqnr_heatmap.png",
            "underflow_heatmap.png"} <= written
    summary = (tmp_path / "summary.md").read_text()
    assert "PASS" in summary and "bitwise equal in every GEMM" in summary
    sections = [line for line in summary.splitlines() if line.startswith("## ")]
    assert sections[0] == "## First divergence from torchao:tensorwise" and "## Time" in sections
    assert summary.index("![sqnr_heatmap](sqnr_heatmap.png)") > summary.index("## First divergence")


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
    from evals.zoo.train_faults import SKIPPED_LAYER
    result = run_training(TrainPlan(SKIPS_A_LAYER, steps=2, sample_every=10))
    divergence = result.divergence
    assert (divergence.step, divergence.layer, divergence.gemm) == (0, SKIPPED_LAYER, "output")
    assert "must be bitwise equal" in result.verdict.headline


def test_scale_from_the_previous_amax_diverges_at_step_1_in_the_first_layer():
    # Step 0 has no history, so every operand takes its own amax: torchao's dynamic scaling,
    # bitwise. At step 1 the first layer's input (new tokens) and weight (one optimizer step
    # later) are cast with step 0's scales, so the first GEMM to run differs.
    result = run_training(TrainPlan(PREVIOUS_AMAX, steps=2, sample_every=10))
    assert first(result) == (1, 0, "blocks.0.attn.c_q", "output")
    candidate = result.frame[result.frame["role"] == "candidate"]
    assert candidate[candidate["step"] == 0]["bitwise"].all()  # exact while there is no history


def test_amax_once_per_step_is_exact_without_accumulation_and_localized_under_it(tmp_path):
    # One call per optimizer step: the cached amax is always the call's own.
    assert run_training(TrainPlan(AMAX_ONCE_PER_STEP, steps=2, sample_every=10)).divergence is None
    # Two micro-batches a step: the second is cast with the first's input amax.
    result = run_training(TrainPlan(AMAX_ONCE_PER_STEP, steps=1, grad_accum=2, sample_every=1), out_dir=tmp_path)
    assert first(result) == (0, 1, "blocks.0.attn.c_proj", "output")
    rows = result.frame[(result.frame["role"] == "candidate") & (result.frame["gemm"] == "output")]
    assert sorted(rows["micro"].unique()) == [0, 1] and rows[rows["micro"] == 0]["bitwise"].all()
    # Why attn.c_proj and not c_q, the first layer: c_q's input is the token embeddings normalized,
    # whose amax is the largest element of the embedding rows present, the same rows in both
    # micro-batches of 256 tokens over a vocabulary of 64. The attention output mixes each
    # sequence's context, so its amax differs between the micro-batches.
    amax = rows.set_index(["layer", "micro"])["a_amax"]
    assert amax["blocks.0.attn.c_q", 0] == amax["blocks.0.attn.c_q", 1]
    assert amax["blocks.0.attn.c_proj", 0] != amax["blocks.0.attn.c_proj", 1]
    saved = read_case_file(str(result.divergence.case_file))
    assert "micro1" in result.divergence.case_file.name and saved["meta"]["micro"] == 1
    assert "micro-batch 1 of 2" in result.verdict.headline


def test_a_recompute_that_advances_the_scale_is_localized_to_the_last_blocks_grad_weight():
    # Without checkpointing each step is one forward: advancing the history per call is per step.
    assert run_training(TrainPlan(RECOMPUTE_ADVANCES, against=DELAYED, steps=2, sample_every=10)).divergence is None
    result = run_training(TrainPlan(RECOMPUTE_ADVANCES, against=DELAYED, steps=2, sample_every=10, checkpoint=True))
    # Step 0: the forward and the recompute both scale by step 0's own amax. Step 1: the recompute
    # (in backward, last block first) scales the input by step 1's amax, the forward used step 0's.
    # The first backward GEMM fed by a recomputed input is the last block's last layer's grad_weight;
    # its grad_input (grad_output from outside the block, weight scaled dynamically) still agrees.
    assert first(result) == (1, 0, "blocks.1.mlp.c_proj", "grad_weight")
    candidate = result.frame[result.frame["role"] == "candidate"]
    step1 = candidate[candidate["step"] == 1].set_index(["layer", "gemm"])
    assert step1.loc[("blocks.1.mlp.c_proj", "grad_input"), "bitwise"]
    assert result.recompute_differs is not None and result.recompute_differs[0] == 1
    assert any("recompute" in line for line in result.verdict.details)


def test_checkpointing_and_accumulation_keep_fp8_impl_in_lockstep():
    # The probes under both: every micro-batch compared, the recompute's output GEMM bitwise its
    # forward's, numerics on the recomputed operands, and no difference fp8_impl did not make.
    result = run_training(TrainPlan("fp8_impl", steps=2, grad_accum=2, checkpoint=True, sample_every=1))
    assert result.divergence is None and result.loss_differs_at is None and result.recompute_differs is None
    frame = result.frame
    candidate = frame[frame["role"] == "candidate"]
    assert len(candidate) == 2 * 2 * TINY_LAYERS * 3 and candidate["bitwise"].all()
    outputs = frame[frame["gemm"] == "output"]
    # torch.utils.checkpoint stops a recompute once the last saved tensor is refilled: inside each
    # block's last layer (mlp.c_proj), whose recomputed output is then never made; the head is not
    # checkpointed. Every other layer's recomputed output GEMM is recorded, and is the forward's.
    unrecorded = outputs["layer"].str.endswith("mlp.c_proj") | (outputs["layer"] == "lm_head")
    assert outputs[unrecorded]["recompute_bitwise"].isna().all()
    recomputed = outputs[~unrecorded]["recompute_bitwise"]
    assert len(recomputed) == 4 * 2 * 2 * 10 and recomputed.notna().all() and recomputed.astype(bool).all()
    assert candidate["sqnr_db"].between(15, 40).all()


MODEL_FILE = '''
import torch
from torch import nn

class Bigram(nn.Module):
    """Embedding, a relu MLP, a head: token ids [B, T] -> logits [B, T, vocab]."""
    vocab_size, seq_len, batch_size = 64, 16, 4

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        self.up, self.down, self.head = nn.Linear(32, 64, bias=False), nn.Linear(64, 32, bias=False), \\
            nn.Linear(32, 64, bias=False)

    def forward(self, idx):
        x = self.embed(idx)
        return self.head(x + self.down(torch.relu(self.up(x)))).float()

def make_model():
    return Bigram()

def not_a_module():
    return {"model": None}

def no_vocab():
    model = Bigram()
    model.vocab_size = None
    return model

class SummedLogits(Bigram):
    def forward(self, idx):
        return super().forward(idx).sum(-1)  # [B, T]: the vocabulary summed away

def wrong_logits():
    return SummedLogits()

settings = 3
'''


def test_your_own_model_factory_trains_in_lockstep(tmp_path):
    path = tmp_path / "my_model.py"
    path.write_text(MODEL_FILE)
    result = run_training(TrainPlan("fp8_impl", model=f"{path}:make_model", steps=2, sample_every=1))
    assert result.divergence is None and result.crash is None, result.verdict
    assert result.layers == ["up", "down", "head"]
    assert result.source.vocab_size == 64 and result.plan.learning_rate == 1e-2
    candidate = result.frame[result.frame["role"] == "candidate"]
    assert candidate["bitwise"].all() and candidate["sqnr_db"].between(15, 40).all()
    # the noise run is the factory under seed + 1: other weights, so another loss
    losses = result.frame.drop_duplicates(["step", "role"]).set_index(["step", "role"])["loss"]
    assert losses[0, "baseline"] != losses[0, "baseline_seed"]


def test_your_own_model_errors_are_clear(tmp_path, capsys):
    path = tmp_path / "my_model.py"
    path.write_text(MODEL_FILE)
    broken = tmp_path / "broken.py"
    broken.write_text("import torch\nraise RuntimeError('no GPU here')\n")
    with pytest.raises(TrainError, match=r"model file .*missing\.py.* does not exist"):
        TrainPlan("fp8_impl", model=f"{tmp_path}/missing.py:make_model")
    # the factory's module is imported in the runs' workers: what is wrong with it shows when training starts
    with pytest.raises(ModelError, match=r"cannot import .*broken\.py.*RuntimeError: no GPU here"):
        run_training(TrainPlan("fp8_impl", model=f"{broken}:make_model", steps=1))
    with pytest.raises(ModelError, match=r"has no attribute 'make_modle'; did you mean \['make_model'"):
        run_training(TrainPlan("fp8_impl", model=f"{path}:make_modle", steps=1))
    with pytest.raises(ModelError, match=r"settings is a int, not callable"):
        run_training(TrainPlan("fp8_impl", model=f"{path}:settings", steps=1))
    with pytest.raises(ModelError, match=r"returned a dict, not an nn.Module"):
        run_training(TrainPlan("fp8_impl", model=f"{path}:not_a_module", steps=1))
    with pytest.raises(ModelError, match=r"has no attribute 'vocab_size': set model.vocab_size"):
        run_training(TrainPlan("fp8_impl", model=f"{path}:no_vocab", steps=1))
    with pytest.raises(TrainError, match=r"returned \(4, 16\) for token ids of shape \(4, 16\).*logits \[B, T, "):
        run_training(TrainPlan("fp8_impl", model=f"{path}:wrong_logits", steps=1))
    with pytest.raises(TrainError, match=r"--checkpoint wraps the blocks of the built-in GPT"):
        TrainPlan("fp8_impl", model=f"{path}:make_model", checkpoint=True)
    assert main(["train", "--impl", "fp8_impl", "--model", f"{path}:make_modle", "--device", "cpu", "--out",
                 str(tmp_path / "out")]) == EXIT_USAGE
    assert "did you mean ['make_model'" in capsys.readouterr().err


def test_a_token_file_trains_without_a_floor_and_bad_files_are_clear_errors(tmp_path):
    tokens = MarkovSource.make(64, 4, seed=3).batch(4, 600, torch.Generator().manual_seed(0))
    torch.save(tokens, tmp_path / "tokens.pt")
    result = run_training(TrainPlan("fp8_impl", steps=1, sample_every=1, data=str(tmp_path / "tokens.pt")))
    assert isinstance(result.source, TokenFile) and result.source.tokens.numel() == tokens.numel()
    assert result.divergence is None and any("no loss floor" in line for line in result.verdict.details)

    with pytest.raises(TrainError, match=r"--data '.*nothing\.pt' does not exist"):
        TrainPlan("fp8_impl", data=str(tmp_path / "nothing.pt"))
    np.save(tmp_path / "big.npy", np.array([1, 2, 64] * 100))
    with pytest.raises(ModelError, match=r"token ids reach 64, outside the model's vocabulary 0..63"):
        run_training(TrainPlan("fp8_impl", steps=1, data=str(tmp_path / "big.npy")))
    np.save(tmp_path / "floats.npy", np.ones(100))
    with pytest.raises(ModelError, match=r"holds float64 values, not integer token ids"):
        run_training(TrainPlan("fp8_impl", steps=1, data=str(tmp_path / "floats.npy")))
    (tmp_path / "text.txt").write_text("hello world " * 20)
    with pytest.raises(ModelError, match=r"byte values reach 119, .*\(bytes need 256: --model small\)"):
        run_training(TrainPlan("fp8_impl", steps=1, data=str(tmp_path / "text.txt")))
    (tmp_path / "short.pt").write_bytes(b"")
    torch.save(torch.arange(10), tmp_path / "short.pt")
    with pytest.raises(ModelError, match=r"has 10 tokens, fewer than one sequence of 33"):
        run_training(TrainPlan("fp8_impl", steps=1, data=str(tmp_path / "short.pt")))


def test_d12_is_nanochats_d12_with_every_dim_a_multiple_of_128():
    config = get_model_config("d12")
    assert (config.n_layer, config.d_model, config.n_head, config.d_model // config.n_head) == (12, 768, 6, 128)
    assert 8192 <= config.tokens_per_step <= 16384  # the brief's 8-16k tokens a step
    config.check_alignment(128)  # block-scaled recipes run on it too
    with torch.device("meta"):  # the shapes, without allocating 100M parameters
        model = GPT(config)
    matmul = sum(p.numel() for name, p in model.named_parameters() if name != "wte.weight")
    assert round(matmul / 1e6, 1) == 91.2  # the FLOP estimate in parity/model.py
    assert round(6 * matmul * config.tokens_per_step / 1e12, 1) == 9.0
    source = MarkovSource.make(config.vocab_size, config.successors, seed=0)  # sparse: ~1 s, kilobytes
    residual = torch.zeros_like(source.stationary).index_add_(
        0, source.next_tokens.reshape(-1), (source.stationary[:, None] * source.probabilities).reshape(-1))
    assert torch.allclose(residual, source.stationary, atol=1e-15, rtol=0)  # pi P = pi
    assert 0.5 < source.entropy_rate < math.log(config.successors)  # a floor far below ln(8192) = 9.0 nats


@pytest.mark.fp8_gpu
def test_d12_200_steps_on_one_gpu_are_bitwise_and_under_five_minutes(tmp_path):
    start = time.perf_counter()
    result = run_training(TrainPlan("fp8_impl", model="d12", steps=200, device="cuda"), out_dir=tmp_path)
    write_train_report(result, tmp_path)
    seconds = time.perf_counter() - start
    timing = result.timing
    print(f"\nd12, 200 steps, 4 runs in lockstep: {seconds:.0f} s ({timing['seconds'].mean():.3f} s per step; "
          f"sampled {timing.loc[timing['sampled'], 'seconds'].mean():.3f}, other "
          f"{timing.loc[~timing['sampled'], 'seconds'].mean():.3f}); {result.verdict.headline}")
    assert result.crash is None and result.divergence is None and result.loss_differs_at is None, result.verdict
    assert seconds < H200_BUDGET_S


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
    with pytest.raises(SystemExit):
        main(["train", "--impl", "fp8_impl", "--grad-accum", "0", "--device", "cpu"])
    assert "--grad-accum" in capsys.readouterr().err
    with pytest.raises(TrainError, match=r"grad_accum = 0 must be at least 1"):
        TrainPlan("fp8_impl", grad_accum=0)


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


def test_markov_source_entropy_rate_is_exact():
    source = MarkovSource.make(vocab_size=16, successors=3, seed=5)
    assert torch.allclose(source.stationary @ source.transition, source.stationary, atol=1e-12)
    assert (source.transition > 0).sum(1).eq(3).all()
    # the empirical conditional entropy of a long sample approaches the exact rate
    tokens = source.batch(64, 400, torch.Generator().manual_seed(0))
    logp = source.transition[tokens[:, :-1], tokens[:, 1:]].log()
    assert abs(-logp.mean().item() - source.entropy_rate) < 0.02
    # and the sampler's successor frequencies approach the law: 25.5k transitions, ~1600 from each
    # token, so a frequency's standard error is at most sqrt(0.25 / 1600) = 0.0125; 0.06 is ~5 of them
    pairs = tokens[:, :-1].reshape(-1) * 16 + tokens[:, 1:].reshape(-1)
    counts = torch.bincount(pairs, minlength=16 * 16).reshape(16, 16).to(torch.float64)
    empirical = counts / counts.sum(1, keepdim=True)
    assert (empirical - source.transition).abs().max() < 0.06


# ---- Ctrl-C and SIGTERM (a hang and a death: property_tests/test_hostile.py) -----------------------------

REPO = Path(__file__).resolve().parents[1]


def test_ctrl_c_stops_training_and_keeps_the_finished_steps_in_a_report_headed_incomplete(tmp_path):
    """SIGINT to `fp8-parity train` after its first step: exit 4 (not a pass, not a failure: cases are missing),
    the report of the steps that finished, headed INCOMPLETE, and no traceback."""
    out = tmp_path / "report"
    process = subprocess.Popen([sys.executable, "-m", "parity", "train", "--impl", "fp8_impl", "--steps", "1000",
                                "--sample-every", "1000", "--device", "cpu", "--out", str(out)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    err = []
    for line in process.stderr:  # no terminal: the progress writes a line when the first step is done
        err.append(line)
        if "] 1/1000 steps" in line:
            break
    sent = time.monotonic()
    process.send_signal(signal.SIGINT)
    stdout, rest = process.communicate(timeout=300)
    seconds = time.monotonic() - sent
    text = stdout + "".join(err) + rest
    print(f"\nSIGINT to exit, the report of the finished steps written: {seconds:.1f} s")
    assert process.returncode == 4, text
    assert stdout.startswith("INCOMPLETE: interrupted by SIGINT after ") and "Traceback" not in text, text
    steps = pd.read_csv(out / "results.csv.gz")["step"].nunique()
    assert 1 <= steps < 1000 and f"after {steps} of 1000 steps" in stdout
    assert "INCOMPLETE" in (out / "summary.md").read_text()


@pytest.mark.parametrize(("impl", "code", "says"), [
    ("fp8_impl", 4, "Among the steps that ran: PASS: fp8_impl trains 2 steps"),
    (STALE_CACHE, 1, "Among the steps that ran: FAIL: "),  # it diverges at step 1: a finding, interrupted or not
])
def test_sigterm_keeps_the_finished_steps_and_their_findings(tmp_path, monkeypatch, capsys, impl, code, says):
    from parity import train
    from parity.exits import Terminated
    step = train._Lockstep.step

    def terminated_at_the_third_step(self, index, micro_batches):
        if index == 2:
            raise Terminated()
        return step(self, index, micro_batches)

    monkeypatch.setattr(train._Lockstep, "step", terminated_at_the_third_step)
    assert main(["train", "--impl", impl, "--steps", "5", "--sample-every", "1", "--device", "cpu", "--out",
                 str(tmp_path), "--quiet"]) == code
    out = capsys.readouterr().out
    assert out.startswith("INCOMPLETE: interrupted by SIGTERM after 2 of 5 steps") and says in out, out
    assert pd.read_csv(tmp_path / "results.csv.gz")["step"].nunique() == 2



# ---- what a run's worker sends back --------------------------------------------------------------------------

def test_a_runs_replies_are_plain_data_the_restricted_unpickler_reads(tmp_path):
    """Every reply of parity.train_worker reads back through torch.load(weights_only=True), the restricted
    unpickler the process that judges decodes replies with: tensors, dicts, lists, str, int, float, bool, None.
    (Called here in this process: outside a worker the functions run the same.)"""
    from parity import train, train_worker
    plan = TrainPlan("fp8_impl", steps=2, checkpoint=True)
    setup = dict(role="candidate", impl=("fp8_impl", None, None), model="tiny", seed=0, device="cpu",
                 checkpoint=True, learning_rate=plan.learning_rate)
    _, micro_batches = train._micro_batches(plan, plan.config)
    replies = [train_worker.start_run(setup)]
    for step in range(2):
        trained = train_worker.micro_batch(micro_batches[step][0], where=f"step {step}", loss_scale=1.0,
                                           first_micro=True, keep_previous=True)
        replies += [trained, train_worker.measure(where=f"step {step}", results=True, recompute=True, sampled=True)]
        replies.append(train_worker.call_tensors("blocks.0.attn.c_q"))
        replies.append(train_worker.finish(where=f"step {step}", keep_previous=True))
    for index, reply in enumerate(replies):
        assert not {"crash", "usage"} & set(reply), reply
        torch.save(reply, tmp_path / f"{index}.pt")
        torch.load(tmp_path / f"{index}.pt", weights_only=True)
    built, trained0, measured0, tensors0, _, _, _, tensors1, _ = replies
    assert built["impl"]["name"] == "fp8_impl" and built["impl"]["default_against"] == "torchao:tensorwise"
    assert len(built["layers"]) == TINY_LAYERS and trained0["state_changes"] == []
    assert set(measured0["numerics"]["lm_head"]) == {"output", "grad_input", "grad_weight"}
    assert measured0["results"]["lm_head"][0][:2] == ["bfloat16", [8, 32, 64]]
    assert tensors0["previous"] is None and tensors1["previous"] is not None  # the call before: step 0's
    assert torch.equal(tensors1["previous"]["input"], tensors0["call"]["input"])
    assert not torch.equal(tensors1["previous"]["weight"], tensors1["call"]["weight"])  # an optimizer step between


def test_a_fingerprint_changes_with_any_bit_and_only_with_the_bits():
    from parity.train_worker import fingerprint
    values = torch.randn(64, 48).to(torch.bfloat16)
    assert fingerprint(values) == fingerprint(values.clone()) == fingerprint(values.t().contiguous().t())
    for index in (0, 1000, values.numel() - 1):  # the lowest mantissa bit of one element, anywhere
        changed = values.clone()
        changed.view(-1).view(torch.int16)[index] ^= 1
        assert fingerprint(changed) != fingerprint(values)
    swapped = values.clone().view(-1)
    swapped[[0, 1]] = swapped[[1, 0]]
    assert values.view(-1)[0] == values.view(-1)[1] or fingerprint(swapped.view(64, 48)) != fingerprint(values)
    assert fingerprint(values.float())[:2] == ["float32", [64, 48]] and fingerprint(values.reshape(48, 64)) != \
        fingerprint(values)
    fp8 = values.to(torch.float8_e4m3fn)
    assert fingerprint(fp8) == fingerprint(fp8.clone()) and fingerprint(None) is None
