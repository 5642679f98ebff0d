"""parity.bench: presets, the roofline byte model, speedup ratios, the report; one GPU run."""

from __future__ import annotations

import dataclasses
import gzip
import math

import numpy as np
import pandas as pd
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from parity.bench import (COLUMNS, PRESETS, Ceilings, NoGPUError, add_ratios, bench_verdict, glue_bytes, limit_ms,
                          pool_size, require_gpu, run_bench, write_bench_report)
from parity.impls import load_impl
from parity.recipes import RECIPES

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
CEILINGS = Ceilings(fp8_tflops=1000.0, bf16_tflops=500.0, bandwidth_gbs=4000.0)


def test_presets_hold_the_layer_shapes():
    nanochat, llama, small = (PRESETS[name].shapes for name in ("nanochat", "llama", "small"))
    assert nanochat[:3] == (("nanochat-d20 attn.qkvo", 32768, 1280, 1280), ("nanochat-d20 mlp.fc", 32768, 1280, 5120),
                            ("nanochat-d20 mlp.proj", 32768, 5120, 1280))
    assert ("nanochat-d32 mlp.fc", 32768, 2048, 8192) in nanochat and len(nanochat) == 9
    assert ("llama3-8b attn.kv", 8192, 4096, 1024) in llama and ("llama3-70b mlp.down", 8192, 28672, 8192) in llama
    assert len(llama) == 8
    assert [shape[1:] for shape in small] == [(4096, 768, 3072), (4096, 768, 768), (8192, 1024, 4096),
                                              (32768, 1664, 6656), (32768, 1664, 1664), (16384, 8192, 8192)]
    assert all(p.dtype == torch.bfloat16 for p in PRESETS.values())
    with pytest.raises(dataclasses.FrozenInstanceError):
        PRESETS["small"].iters = 1


def test_glue_bytes_and_limit_by_hand():
    M, K, N = 4096, 768, 3072
    MK, NK, MN = 3_145_728, 2_359_296, 12_582_912
    per_operand = 2 + 2 + 1 + 1  # bf16 read for amax, bf16 read for the cast, fp8 written row- and column-major
    assert glue_bytes(M, K, N) == per_operand * (MK + NK + MN) == 108_527_616
    assert glue_bytes(M, K, N, hp_bytes=4) == 10 * (MK + NK + MN)  # fp32 high precision
    flops = 6 * M * K * N  # 57_982_058_496
    assert limit_ms(M, K, N, CEILINGS) == pytest.approx(flops / 1e15 * 1e3 + 108_527_616 / 4e12 * 1e3)
    assert limit_ms(M, K, N, CEILINGS) == pytest.approx(0.0579821 + 0.0271319, rel=1e-6)
    assert limit_ms(M, K, N, CEILINGS, recipe=RECIPES["bf16"]) == pytest.approx(0.1159641, rel=1e-6)


def test_glue_and_flops_of_every_recipe_by_hand():
    """rowwise and blockwise cast each operand along two axes, but from one read: the same bytes as
    tensorwise. rowwise_with_gw_hp keeps input and grad_output in bf16 for grad_weight (one fp8 copy
    each) and runs that GEMM at the bf16 rate."""
    M, K, N = 4096, 768, 3072
    MK, NK, MN = M * K, N * K, M * N
    for name in ("rowwise", "blockwise"):
        assert glue_bytes(M, K, N, recipe=RECIPES[name]) == 6 * (MK + NK + MN)
        assert RECIPES[name].flops(M, K, N) == (6 * M * K * N, 0)
    gw_hp = RECIPES["rowwise_with_gw_hp"]
    assert glue_bytes(M, K, N, recipe=gw_hp) == 5 * MK + 6 * NK + 5 * MN
    assert gw_hp.flops(M, K, N) == (4 * M * K * N, 2 * M * K * N)
    assert limit_ms(M, K, N, CEILINGS, recipe=gw_hp) == pytest.approx(
        4 * M * K * N / 1e15 * 1e3 + 2 * M * K * N / 5e14 * 1e3 + (5 * MK + 6 * NK + 5 * MN) / 4e12 * 1e3)


def test_pool_rotation_exceeds_l2():
    l2 = 60 * 2**20
    assert pool_size(4 * l2, l2) == 2  # one large pair already exceeds L2: two alternate
    set_bytes = (4096 * 768 + 4096 * 768) * 2  # 4096x768x768 in bf16: 12.6 MB per pair
    count = pool_size(set_bytes, l2)
    assert (count - 1) * set_bytes >= l2 > (count - 2) * set_bytes


def bench_frame(times: dict, shapes=("a", "b"), *, gpu_share: float = 0.5) -> pd.DataFrame:
    """A hand-made bench table: times[(impl, compiled)] is the median ms on every shape (None: raised);
    the GPU time is gpu_share of it and the host time 0.6 ms (host-bound when above the GPU time)."""
    rows = [dict(preset="small", shape=shape, M=4096, K=768, N=3072, impl=impl, compiled=compiled, median_ms=ms,
                 recipe="bf16" if impl == "bf16" else impl.split(":")[-1] if impl.startswith("torchao:")
                 else "tensorwise",
                 p20_ms=ms and 0.9 * ms, p80_ms=ms and 1.1 * ms, gpu_ms=ms and gpu_share * ms, host_ms=ms and 0.6,
                 bound=ms and ("host" if 0.6 > gpu_share * ms else "gpu"), tflops=ms and 58 / ms,
                 peak_mem_gb=ms and 0.1, compile_s=1.0 if compiled else math.nan, limit_ms=0.09,
                 error=None if ms else "compile: boom")
            for shape in shapes for (impl, compiled), ms in times.items()]
    frame = pd.DataFrame.from_records(rows, columns=COLUMNS)
    frame = add_ratios(frame)
    return frame.assign(fraction_of_limit=frame["limit_ms"] / frame["gpu_ms"])


def test_ratio_columns_on_a_hand_made_frame():
    frame = bench_frame({("fp8_impl", False): 2.0, ("torchao:tensorwise", False): 3.0, ("bf16", False): 1.0,
                         ("fp8_impl", True): 1.0, ("torchao:tensorwise", True): 1.5, ("bf16", True): None})
    by = frame.set_index(["shape", "impl", "compiled"])
    assert by.loc[("a", "fp8_impl", False), "vs_torchao"] == 1.5
    assert by.loc[("a", "fp8_impl", False), "vs_bf16"] == 0.5
    assert by.loc[("b", "torchao:tensorwise", True), "vs_torchao"] == 1.0
    assert math.isnan(by.loc[("a", "fp8_impl", True), "vs_bf16"])  # compiled bf16 raised: no ratio
    assert math.isnan(by.loc[("a", "bf16", True), "vs_torchao"])  # the failed row has no time


@given(st.lists(st.floats(0.01, 100.0), min_size=3, max_size=3))
def test_ratios_are_time_quotients(times):
    frame = bench_frame(dict(zip([("x", True), ("torchao:tensorwise", True), ("bf16", True)], times)), shapes=("a",))
    x = frame.set_index("impl")
    assert x.loc["x", "vs_torchao"] == pytest.approx(times[1] / times[0])
    assert x.loc["x", "vs_bf16"] == pytest.approx(times[2] / times[0])
    assert x.loc["torchao:tensorwise", "vs_torchao"] == x.loc["bf16", "vs_bf16"] == 1.0
    assert x.loc["x", "gpu_vs_torchao"] == pytest.approx(times[1] / times[0])  # GPU times share the 0.5 factor


def test_ratios_compare_each_recipe_with_torchaos_implementation_of_it():
    frame = bench_frame({("fp8_impl", True): 1.0, ("torchao:tensorwise", True): 1.5, ("fp8_impl:rowwise", True): 2.0,
                         ("torchao:rowwise", True): 2.5, ("bf16", True): 3.0}, shapes=("a",))
    frame.loc[frame["impl"] == "fp8_impl:rowwise", "recipe"] = "rowwise"
    by = add_ratios(frame).set_index("impl")
    assert by.loc["fp8_impl", "vs_torchao"] == 1.5 and by.loc["fp8_impl:rowwise", "vs_torchao"] == 1.25
    assert by.loc["fp8_impl:rowwise", "vs_bf16"] == 1.5 and math.isnan(by.loc["bf16", "vs_torchao"])


def test_gpu_ratios_come_from_the_gpu_times():
    frame = bench_frame({("fp8_impl", True): 1.0, ("torchao:tensorwise", True): 1.0, ("bf16", True): 1.0})
    frame.loc[frame["impl"] == "torchao:tensorwise", "gpu_ms"] = 0.8  # same wall time, more GPU work
    frame = add_ratios(frame)
    mine = frame[frame["impl"] == "fp8_impl"].iloc[0]
    assert mine["vs_torchao"] == 1.0 and mine["gpu_vs_torchao"] == pytest.approx(1.6)


def test_bench_report_writes_its_files(tmp_path):
    frame = bench_frame({("fp8_impl", False): 2.0, ("torchao:tensorwise", False): 3.0, ("bf16", False): 1.0,
                         ("fp8_impl", True): 1.0, ("torchao:tensorwise", True): 1.25, ("bf16", True): None})
    frame.attrs["env"] = {"gpu": "test GPU", **dataclasses.asdict(CEILINGS)}
    written = write_bench_report(frame, tmp_path, title="tiny bench")
    assert {p.name for p in written} == {"results.csv.gz", "env.json", "speedup_vs_torchao.png",
                                         "gpu_speedup_vs_torchao.png", "summary.md", "index.html"}
    assert all(p.exists() for p in written)
    assert (tmp_path / "speedup_vs_torchao.png").read_bytes().startswith(PNG_SIGNATURE)
    summary = (tmp_path / "summary.md").read_text()
    assert summary.startswith("# tiny bench")
    assert ("fp8_impl fwd+bwd over 2 shapes (geometric mean): eager: wall 1.50x (min 1.50x) vs torchao:tensorwise, "
            "0.50x vs bf16; GPU 1.50x (min 1.50x) vs torchao:tensorwise, 0.50x vs bf16") in summary
    assert "compiled: wall 1.25x (min 1.25x) vs torchao:tensorwise, n/a vs bf16" in summary
    assert "2/2 host-bound" in summary  # compiled fp8_impl: 0.5 ms GPU < 0.6 ms host
    assert "2 configurations failed" in summary and "a bf16 compiled: compile: boom" in summary
    for heading in ("Speedup vs torchao's implementation of the same recipe (wall)",
                    "Speedup vs torchao's implementation of the same recipe (GPU)",
                    "Forward + backward, ms of GPU work", "Host ms to launch one step", "Fraction of the limit",
                    "Ceilings measured in this run"):
        assert f"## {heading}" in summary
    assert 'class="headline fail"' in (tmp_path / "index.html").read_text()  # a configuration failed
    with gzip.open(tmp_path / "results.csv.gz", "rt") as f:
        back = pd.read_csv(f)
    assert list(back.columns) == COLUMNS and len(back) == len(frame)
    assert bench_verdict(frame.dropna(subset=["median_ms"])).ok


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without a GPU")
def test_bench_without_a_gpu_raises_a_clear_error():
    with pytest.raises(NoGPUError, match="CUDA"):
        run_bench([PRESETS["small"]], [load_impl("bf16")])


def test_bench_refuses_a_cpu_device():
    with pytest.raises(NoGPUError, match="not a CUDA device"):
        require_gpu("cpu")


@pytest.mark.fp8_gpu
def test_small_preset_eager_rows_are_positive_and_complete():
    frame = run_bench([PRESETS["small"]], [load_impl("fp8_impl"), load_impl("bf16")], compile_modes=(False,),
                      warmup=1, iters=3)
    assert list(frame.columns) == COLUMNS and len(frame) == 2 * len(PRESETS["small"].shapes)
    assert frame["error"].isna().all(), frame["error"].dropna().tolist()
    assert frame["gpu_error"].isna().all(), frame["gpu_error"].dropna().tolist()
    measured = frame[["median_ms", "p20_ms", "p80_ms", "gpu_ms", "host_ms", "tflops", "peak_mem_gb", "limit_ms",
                      "fraction_of_limit"]]
    assert (measured.to_numpy() > 0).all() and np.isfinite(measured.to_numpy()).all()
    assert (frame["p20_ms"] <= frame["median_ms"]).all() and (frame["median_ms"] <= frame["p80_ms"]).all()
    assert (frame["fraction_of_limit"] < 1.5).all()  # the limit is a limit, up to timing noise
    # A step's kernels cannot take longer than the step (wall). 25%: the two are separate measurements of
    # 3 iterations each, and clocks may change between them; a double count of the kernels would be 2x.
    assert (frame["gpu_ms"] <= 1.25 * frame["median_ms"]).all(), frame[["shape", "impl", "gpu_ms", "median_ms"]]
    assert (frame.loc[frame["impl"] == "bf16", "vs_bf16"] == 1.0).all() and frame["vs_torchao"].isna().all()
    env = frame.attrs["env"]
    assert env["fp8_tflops"] > env["bf16_tflops"] > 0 and env["bandwidth_gbs"] > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU answer")
def test_cli_without_gpu_exits_125(capsys):
    from parity.cli import main
    assert main(["bench", "--compile", "off"]) == 125
    assert "cannot run here" in capsys.readouterr().err


def test_timing_interleaves_the_implementations(monkeypatch):
    """Each impl warms up once, then ROUNDS blocks alternate in a rotating order; a failed one drops out."""
    import parity.bench as bench
    calls = []

    def fake_time(module, inputs, grads, *, warmup, iters, min_warmup_s, host_ms):
        calls.append((module, iters))
        if module == "crashes" and iters:
            raise RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED")
        host_ms.append(0.5)
        return [1.0] * iters
    monkeypatch.setattr(bench, "time_fwd_bwd", fake_time)
    for name, fn in (("memory_allocated", lambda device: 0), ("reset_peak_memory_stats", lambda device: None),
                     ("max_memory_allocated", lambda device: 0)):
        monkeypatch.setattr(torch.cuda, name, fn)
    configs = [bench._Config(load_impl("bf16"), module=name) for name in ("A", "crashes", "B")]
    configs.append(bench._Config(load_impl("bf16"), error="compile: boom"))
    bench._time_interleaved(configs, device="cpu", warmup=3, iters=12)
    assert calls[:3] == [("A", 0), ("crashes", 0), ("B", 0)]  # warm-ups
    # 12 = 3 + 3 + 2 + 2 + 2; the order rotates by one each block (over all four, the failed one skipped)
    assert calls[3:] == [("crashes", 3), ("B", 3), ("A", 3), ("B", 3), ("A", 3), ("A", 2), ("B", 2),
                         ("A", 2), ("B", 2), ("B", 2), ("A", 2)]
    assert bench.ROUNDS == 5 and len(configs[0].times) == 12 and len(configs[0].host) == 6
    assert configs[1].error == "run: RuntimeError: CUBLAS_STATUS_NOT_SUPPORTED"
    assert configs[3].error == "compile: boom" and not configs[3].times


def test_gpu_time_passes_run_in_opposite_orders(monkeypatch):
    """Two half-length passes, the second reversed, each measurement after the same idle; the mean is the time."""
    import parity.bench as bench
    calls, idle = [], []
    monkeypatch.setattr(bench, "kernel_ms_per_step",
                        lambda module, inputs, grads, *, steps: calls.append((module, steps)) or len(calls))
    monkeypatch.setattr(bench.time, "sleep", idle.append)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    configs = [bench._Config(load_impl("bf16"), module=name) for name in ("A", "B", "C")]
    configs[1].error = "compile: boom"
    bench._measure_gpu(configs, device="cpu", iters=50)
    assert calls == [("A", 25), ("C", 25), ("C", 25), ("A", 25)] and idle == [bench.SETTLE_S] * 4
    assert configs[0].gpu == [1, 4] and configs[2].gpu == [2, 3] and not configs[1].gpu
    configs[0].times, configs[0].host = [3.0, 3.0], [1.0]
    row = bench._result(configs[0], 16, 16, 16)
    assert row["gpu_ms"] == 2.5 and row["median_ms"] == 3.0 and row["bound"] == "gpu"
