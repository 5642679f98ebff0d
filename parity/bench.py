"""`fp8-parity bench`: forward+backward time of a linear layer per implementation and shape,
eager and torch.compile'd, against the limit this GPU sets.

A preset is a description (BenchPreset: named (M, K, N) shapes, dtype, warm-up and timed
iterations); the measurements become one tidy DataFrame (COLUMNS: one row per preset x shape
x impl x compile mode), written by write_bench_report. Input, weight and grad_output are bf16,
as nanochat trains (the preset's `dtype`); a reference runs in its Impl.compute_dtype.

How one configuration is timed (time_fwd_bwd)
* CUDA events, not host clocks: kernels run asynchronously, so a host timer sees when work
  was queued, not when the GPU did it. Events recorded on the stream around each fwd+bwd
  bracket its GPU time, including gaps where the GPU waits for the CPU to launch (eager FP8
  pays those: its glue is many small kernels). One synchronize, at the end, adds no gaps.
* Cold inputs: an H200 has 60 MB of L2. Re-reading one 4096x768 input every iteration would
  time the amax/cast glue at cache speed, not at the HBM speed it meets in training, where
  other layers ran in between. So iteration i takes pair i % n of a pool of input/grad_output
  buffers whose *other* members alone exceed L2 (pool_size): a buffer is evicted before reuse.
* torch.autograd.grad(output, [input, *params], grad_output) returns the gradients instead of
  accumulating them into .grad: no impl pays an accumulation kernel, none keeps old gradients.
  The input requires grad, so every impl computes grad_input too.
* Median, p20 and p80 of `iters` iterations after `warmup`; peak memory is the rise of
  torch.cuda.max_memory_allocated over the timed loop (inputs and weight excluded).
* Compiled: torch.compile(module, dynamic=False) once per shape and impl, COMPILE_RUNS calls to
  compile forward and backward (`compile_s`), torch._dynamo.reset() around each configuration
  so no graph leaks into the next, and a raised recompile limit that fails rather than fall
  back to eager. A configuration that raises is a row with `error`, not a crash of the bench.

The roofline: limit_ms and fraction_of_limit
Three ceilings are measured at the start of the run (Ceilings): fp8 torch._scaled_mm and bf16
torch.mm TFLOP/s at 8192^3, and HBM bandwidth from a 1 GiB copy. fwd+bwd is 3 GEMMs, 6*M*K*N
flops; an FP8 recipe also moves its quantization glue. With h bytes per high-precision element
(2 for bf16), the fewest bytes of the tensorwise glue as these recipes structure it (glue_bytes):
    input [M,K], weight [N,K], grad_output [M,N]: each read h (amax), read h + write 1 (cast)
    weight^T, grad_output^T, input^T fp8 copies the SM90 layouts need: each read 1 + write 1
    total = (2h + 3) * (M*K + N*K + M*N) bytes           (7 * (MK + NK + MN) for bf16)
(the GEMMs' own operand reads and output writes are inside the GEMM time). limit_ms is this
work back to back at the measured peaks: 6*M*K*N / fp8 rate + glue_bytes / bandwidth for FP8
impls (rowwise too: its extra glue shows), 6*M*K*N / bf16 rate for bf16. fraction_of_limit =
limit_ms / median_ms: 1 is as fast as the recipe can be on this GPU, 0.5 twice too slow;
small shapes cannot fill the GPU, so their fraction is low by nature.

Time on an H200 (estimated, not yet measured; compilation dominates): ~1 s (bf16) to 5-10 s
(FP8, most for torchao rowwise) per compile with a cold Inductor cache, ~15-25 s per shape for
the four default impls in both modes; timing adds ~2 s per shape at warmup 5, iters 20. So
nanochat (9 shapes) ~3 min, llama (8) ~3 min, small (6) ~2 min: ~7 min for all three cold,
~3 min with a warm Inductor cache, under a minute with --compile off.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import pandas as pd
import torch
from matplotlib.figure import Figure
from torch import nn

from fp8_impl.matmul import E4M3
from parity import report
from parity.env import environment
from parity.impls import Impl
from parity.sweep import llama3_shapes, nanochat_shapes

DEFAULT_IMPLS = ("fp8_impl", "torchao:tensorwise", "torchao:rowwise", "bf16")
RATIO_REFERENCES = {"vs_torchao": "torchao:tensorwise", "vs_bf16": "bf16"}  # column -> impl
COLUMNS = ["preset", "shape", "M", "K", "N", "impl", "compiled", "median_ms", "p20_ms", "p80_ms", "tflops",
           "peak_mem_gb", "compile_s", "vs_torchao", "vs_bf16", "limit_ms", "fraction_of_limit", "error"]
DEFAULT_L2_BYTES = 60 * 2**20  # H200, when the driver does not report it
COMPILE_RUNS = 3  # fwd+bwd calls that compile the forward and backward graphs
CEILING_N, COPY_BYTES = 8192, 2**30
_DYNAMO_LIMITS = {key: value for key, value in {"recompile_limit": 64, "fail_on_recompile_limit_hit": True}.items()
                  if hasattr(torch._dynamo.config, key)}  # names of torch >= 2.7


class NoGPUError(RuntimeError):
    """There is no CUDA GPU with FP8 tensor cores here; `fp8-parity bench` exits 125."""


@dataclass(frozen=True)
class BenchPreset:
    """What to time: named layer shapes, their dtype, and how many iterations (warm-up, timed)."""

    name: str
    description: str
    shapes: tuple[tuple[str, int, int, int], ...]  # (label, M, K, N)
    dtype: torch.dtype = torch.bfloat16  # input, weight and grad_output
    warmup: int = 5
    iters: int = 20


def _with_tokens(M: int, named: Sequence[tuple[str, int, int]]) -> tuple[tuple[str, int, int, int], ...]:
    return tuple((label, M, K, N) for label, K, N in named)


_SMALL = dict.fromkeys([(4096, 768, 3072), (4096, 768, 768), (8192, 1024, 4096),  # + DESIGN.md's shapes
                        (32768, 1664, 6656), (32768, 1664, 1664), (16384, 8192, 8192), (4096, 768, 3072)])
PRESETS = {
    "nanochat": BenchPreset("nanochat", "nanochat d20/d26/d32 layers, 32768 tokens",
                            _with_tokens(32768, [*nanochat_shapes(20), *nanochat_shapes(26), *nanochat_shapes(32)])),
    "llama": BenchPreset("llama", "Llama 3 8B and 70B layers, 8192 tokens",
                         _with_tokens(8192, [*llama3_shapes("8b"), *llama3_shapes("70b")])),
    "small": BenchPreset("small", "GPT-2 small/medium layers and the shapes measured in DESIGN.md",
                         tuple((f"{M}x{K}x{N}", M, K, N) for M, K, N in _SMALL), warmup=10, iters=50),
}


@dataclass(frozen=True)
class Ceilings:
    """The machine's limits, measured in the run they are used in."""

    fp8_tflops: float  # torch._scaled_mm, 8192^3, e4m3 x e4m3 -> bf16, tensorwise scales, fast accumulation
    bf16_tflops: float  # torch.mm, 8192^3, bf16
    bandwidth_gbs: float  # 1 GiB device-to-device copy, bytes read + written

    def table(self) -> pd.DataFrame:
        n = f"{CEILING_N}x{CEILING_N}x{CEILING_N}"
        return pd.DataFrame({
            "ceiling": ["fp8 GEMM", "bf16 GEMM", "memory bandwidth"],
            "measured as": [f"torch._scaled_mm {n}, e4m3, tensorwise scales, use_fast_accum, bf16 out",
                            f"torch.mm {n}, bf16", f"{COPY_BYTES / 2**30:g} GiB device copy, read + written"],
            "value": [self.fp8_tflops, self.bf16_tflops, self.bandwidth_gbs], "unit": ["TFLOP/s", "TFLOP/s", "GB/s"]})


def require_gpu(device: str = "cuda") -> torch.device:
    """The CUDA device to benchmark on, or NoGPUError saying why there is none."""
    if not str(device).startswith("cuda"):
        raise NoGPUError(f"bench times GPU kernels; {device!r} is not a CUDA device")
    if not torch.cuda.is_available():
        raise NoGPUError("no CUDA device is available; bench times GPU kernels and has no CPU mode")
    if torch.version.hip is None and torch.cuda.get_device_capability(device) < (8, 9):
        raise NoGPUError(f"{torch.cuda.get_device_name(device)} has compute capability "
                         f"{torch.cuda.get_device_capability(device)}; FP8 GEMMs need >= (8, 9)")
    return torch.device(device)


def _event_times(step: Callable[[int], object], *, warmup: int, iters: int) -> list[float]:
    """Milliseconds of each of `iters` calls step(i) after `warmup` untimed ones (CUDA events)."""
    for i in range(warmup):
        step(i)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for i, (start, end) in enumerate(events):
        start.record()
        step(warmup + i)
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in events]


def time_fwd_bwd(module: nn.Module, inputs_pool: Sequence[torch.Tensor], grad_pool: Sequence[torch.Tensor], *,
                 warmup: int = 5, iters: int = 20) -> list[float]:
    """Milliseconds of each timed forward+backward of `module`; iteration i reads inputs_pool[i %
    len] (leaf tensors that require grad) and grad_pool[i % len]. Gradients of the input and of
    every trainable parameter are computed and dropped, never accumulated into .grad."""
    if not all(x.requires_grad for x in inputs_pool):
        raise ValueError("time_fwd_bwd: the inputs must require grad, so that grad_input is computed")
    params = [p for p in module.parameters() if p.requires_grad]

    def step(i: int) -> None:
        x = inputs_pool[i % len(inputs_pool)]
        torch.autograd.grad(module(x), [x, *params], grad_pool[i % len(grad_pool)])
    return _event_times(step, warmup=warmup, iters=iters)


def pool_size(set_bytes: int, l2_bytes: int) -> int:
    """Input/grad_output pairs to rotate over so that the others alone exceed L2: >= 2."""
    return max(2, math.ceil(l2_bytes / set_bytes) + 1)


def l2_cache_bytes(device: torch.device) -> int:
    return getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or DEFAULT_L2_BYTES


def make_pools(M: int, K: int, N: int, *, dtype: torch.dtype, device, l2_bytes: int):
    """(inputs [M,K] requiring grad, grad_outputs [M,N]): standard normal, pool_size pairs."""
    count = pool_size((M * K + M * N) * dtype.itemsize, l2_bytes)
    generator = torch.Generator(device).manual_seed(0)
    inputs = [torch.randn(M, K, dtype=dtype, device=device, generator=generator).requires_grad_()
              for _ in range(count)]
    return inputs, [torch.randn(M, N, dtype=dtype, device=device, generator=generator) for _ in range(count)]


def measure_ceilings(device, *, warmup: int = 5, iters: int = 20) -> Ceilings:
    """fp8 and bf16 GEMM TFLOP/s and copy bandwidth (GB/s), medians of CUDA-event timings."""
    def median_ms(fn: Callable[[], object]) -> float:
        return float(np.median(_event_times(lambda i: fn(), warmup=warmup, iters=iters)))
    n = CEILING_N
    a = torch.randn(n, n, device=device).to(E4M3)
    b = torch.randn(n, n, device=device).to(E4M3).t()  # column-major, as SM90 requires of B
    one = torch.ones((), device=device)  # tensorwise fp32 scales
    fp8_ms = median_ms(lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16,
                                                use_fast_accum=True))
    a16, b16 = a.to(torch.bfloat16), b.to(torch.bfloat16)
    bf16_ms = median_ms(lambda: torch.mm(a16, b16))
    src = torch.empty(COPY_BYTES, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_ms = median_ms(lambda: dst.copy_(src))
    return Ceilings(fp8_tflops=2 * n**3 / fp8_ms / 1e9, bf16_tflops=2 * n**3 / bf16_ms / 1e9,
                    bandwidth_gbs=2 * COPY_BYTES / copy_ms / 1e6)


def glue_bytes(M: int, K: int, N: int, *, hp_bytes: int = 2) -> int:
    """The fewest bytes the tensorwise quantization glue moves per fwd+bwd (module docstring)."""
    elements = M * K + N * K + M * N  # input, weight, grad_output
    amax_reads, casts, transposed_fp8_copies = hp_bytes * elements, (hp_bytes + 1) * elements, 2 * elements
    return amax_reads + casts + transposed_fp8_copies


def limit_ms(M: int, K: int, N: int, ceilings: Ceilings, *, fp8: bool, hp_bytes: int = 2) -> float:
    """The fastest fwd+bwd here (ms): 3 GEMMs at the fp8 (or bf16) rate + the fp8 glue at bandwidth."""
    if not fp8:
        return 6 * M * K * N / (ceilings.bf16_tflops * 1e9)
    return 6 * M * K * N / (ceilings.fp8_tflops * 1e9) + glue_bytes(M, K, N, hp_bytes=hp_bytes) / (
        ceilings.bandwidth_gbs * 1e6)


def _limit_of(impl: Impl, M: int, K: int, N: int, ceilings: Ceilings, dtype: torch.dtype) -> float:
    if impl.is_reference and impl.compute_dtype != torch.bfloat16:
        return math.nan  # no ceiling measured for fp64 and the like
    return limit_ms(M, K, N, ceilings, fp8=not impl.is_reference, hp_bytes=dtype.itemsize)


def add_ratios(frame: pd.DataFrame) -> pd.DataFrame:
    """vs_torchao, vs_bf16: time of that reference / time of the row, on the same preset, shape
    and compile mode (> 1: the row is faster); NaN where the reference did not run."""
    groups = [frame[key] for key in ("preset", "shape", "compiled")]
    for column, reference in RATIO_REFERENCES.items():
        reference_ms = frame["median_ms"].where(frame["impl"] == reference).groupby(groups).transform("first")
        frame = frame.assign(**{column: reference_ms / frame["median_ms"]})
    return frame


def _measure(impl: Impl, M: int, K: int, N: int, pools, *, compiled: bool, device, warmup: int, iters: int) -> dict:
    """Timing, throughput, memory and compile time of one configuration; `error` if it raised."""
    torch._dynamo.reset()
    phase, compile_s = "build", math.nan
    try:
        inputs, grads = pools
        dtype = impl.compute_dtype or inputs[0].dtype
        if dtype != inputs[0].dtype:
            inputs = [x.detach().to(dtype).requires_grad_() for x in inputs]
            grads = [g.to(dtype) for g in grads]
        torch.manual_seed(0)
        module, _, _ = impl.build(nn.Linear(K, N, bias=False, device=device, dtype=dtype))
        if compiled:
            phase, start = "compile", time.perf_counter()
            module = torch.compile(module, dynamic=False)
            time_fwd_bwd(module, inputs, grads, warmup=COMPILE_RUNS, iters=0)
            compile_s = time.perf_counter() - start
        phase = "run"
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        times = time_fwd_bwd(module, inputs, grads, warmup=warmup, iters=iters)
        peak_gb = (torch.cuda.max_memory_allocated(device) - base) / 1e9
    except Exception as err:  # noqa: BLE001 - any failure is this configuration's result
        return {"error": f"{phase}: {type(err).__name__}: {' '.join(str(err).split())}"[:500]}
    finally:
        torch._dynamo.reset()
    p20, median, p80 = np.percentile(times, [20, 50, 80])
    return dict(median_ms=median, p20_ms=p20, p80_ms=p80, tflops=6 * M * K * N / median / 1e9,
                peak_mem_gb=peak_gb, compile_s=compile_s, error=None)


def run_bench(presets: Sequence[BenchPreset], impls: Sequence[Impl], *, compile_modes: Sequence[bool] = (False, True),
              device: str = "cuda", warmup: int | None = None, iters: int | None = None,
              progress: Callable[[int, int, float], None] | None = None) -> pd.DataFrame:
    """Every preset shape x compile mode x implementation -> one tidy DataFrame (COLUMNS), with
    the environment and the ceilings in frame.attrs["env"]. `warmup`/`iters` override the presets'."""
    device = require_gpu(device)
    start = time.perf_counter()
    ceilings, l2_bytes = measure_ceilings(device), l2_cache_bytes(device)
    total, records = sum(len(p.shapes) for p in presets) * len(compile_modes) * len(impls), []
    runs = {p.name: dict(warmup=p.warmup if warmup is None else warmup, iters=p.iters if iters is None else iters)
            for p in presets}
    with torch._dynamo.config.patch(**_DYNAMO_LIMITS):
        for preset in presets:
            for label, M, K, N in preset.shapes:
                pools = make_pools(M, K, N, dtype=preset.dtype, device=device, l2_bytes=l2_bytes)
                for compiled in compile_modes:
                    for impl in impls:
                        limit = _limit_of(impl, M, K, N, ceilings, preset.dtype)
                        measured = _measure(impl, M, K, N, pools, compiled=compiled, device=device,
                                            **runs[preset.name])
                        records.append(dict(preset=preset.name, shape=label, M=M, K=K, N=N, impl=impl.name,
                                            compiled=compiled, limit_ms=limit, **measured))
                        if progress is not None:
                            progress(len(records), total, time.perf_counter() - start)
                del pools
                torch.cuda.empty_cache()
    frame = add_ratios(pd.DataFrame.from_records(records, columns=COLUMNS))
    frame["fraction_of_limit"] = frame["limit_ms"] / frame["median_ms"]
    frame.attrs["env"] = {**environment(device), **asdict(ceilings), "l2_bytes": l2_bytes,
                          "warmup+iters": ", ".join(f"{name} {r['warmup']}+{r['iters']}" for name, r in runs.items()),
                          "seconds": round(time.perf_counter() - start, 1)}
    return frame


# ---- the report ------------------------------------------------------------------------------------

def _geomean(values: pd.Series) -> str:
    values = values.dropna()
    return f"{math.exp(np.log(values).mean()):.2f}x" if len(values) else "n/a"


def bench_verdict(frame: pd.DataFrame, *, candidate: str | None = None) -> report.Verdict:
    """The headline: `candidate`'s (default: the first impl) geometric-mean speedups per mode;
    ok when every configuration ran, else one detail line per failure."""
    candidate = candidate or frame["impl"].iloc[0]
    mine = frame[(frame["impl"] == candidate) & frame["error"].isna()]
    modes = [f"{'compiled' if compiled else 'eager'} {_geomean(rows['vs_torchao'])} vs torchao:tensorwise, "
             f"{_geomean(rows['vs_bf16'])} vs bf16, median {rows['fraction_of_limit'].median():.0%} of the limit"
             for compiled, rows in mine.groupby("compiled")]
    failed = frame[frame["error"].notna()]
    headline = (f"{candidate} fwd+bwd over {mine['shape'].nunique()} shapes (geometric mean): "
                + ("; ".join(modes) or "no configuration ran")
                + (f"; {len(failed)} configurations failed" if len(failed) else ""))
    return report.Verdict(failed.empty, headline, [f"{row.shape} {row.impl} {'compiled' if row.compiled else 'eager'}: "
                                                   f"{row.error}" for row in failed.itertuples()])


def bench_tables(frame: pd.DataFrame) -> list[tuple[str, str | None, pd.DataFrame]]:
    """(heading, note, table) sections: per shape x mode, one column per implementation."""
    rows = frame.assign(mode=np.where(frame["compiled"], "compiled", "eager"))

    def by_shape(value: str) -> pd.DataFrame:
        table = rows.pivot_table(index=["shape", "mode"], columns="impl", values=value, sort=False, dropna=False)
        return table.reindex(columns=list(frame["impl"].unique()))
    sections = [
        ("Forward + backward, median ms", "CUDA events; inputs rotate over a pool larger than L2.",
         by_shape("median_ms")),
        ("Speedup vs torchao:tensorwise", "time of torchao:tensorwise / time of the impl; > 1 is faster.",
         by_shape("vs_torchao")),
        ("Speedup vs bf16", "time of bf16 nn.Linear / time of the impl; > 1 is faster.", by_shape("vs_bf16")),
        ("Fraction of the limit", "limit_ms / median_ms: 3 GEMMs at the measured peak + the fewest bytes of the "
         "tensorwise glue at the measured bandwidth (bf16: 3 GEMMs at the bf16 peak).", by_shape("fraction_of_limit")),
    ]
    env = frame.attrs.get("env", {})
    if all(key in env for key in Ceilings.__dataclass_fields__):
        ceilings = Ceilings(**{key: env[key] for key in Ceilings.__dataclass_fields__})
        sections.append(("Ceilings measured in this run", None, ceilings.table()))
    return sections


def plot_speedup(fig: Figure, frame: pd.DataFrame) -> None:
    """Speedup vs torchao:tensorwise per shape, one bar per implementation, eager and compiled."""
    modes, impls, shapes = (sorted(frame["compiled"].unique()), list(frame["impl"].unique()),
                            list(frame["shape"].unique()))
    fig.set_size_inches(4.5 * len(modes) + 2, 0.18 * len(shapes) * len(impls) + 1.5)
    axes = fig.subplots(1, len(modes), sharex=True, sharey=True, squeeze=False)[0]
    height, y = 0.8 / len(impls), np.arange(len(shapes))
    for ax, compiled in zip(axes, modes):
        speedup = frame[frame["compiled"] == compiled].set_index(["shape", "impl"])["vs_torchao"]
        for i, impl in enumerate(impls):
            ax.barh(y + i * height, [speedup.get((shape, impl), np.nan) for shape in shapes], height, label=impl,
                    color=f"C{i}")
        ax.axvline(1, color="black", lw=0.8)
        ax.set(title="compiled" if compiled else "eager", xlabel="speedup vs torchao:tensorwise (> 1: faster)")
        ax.grid(axis="x", alpha=0.3)
    axes[0].set_yticks(y + 0.4 - height / 2, shapes, fontsize=8)
    axes[0].invert_yaxis()
    fig.legend(*axes[0].get_legend_handles_labels(), loc="outside lower center", ncol=len(impls), fontsize=8)


def write_bench_report(frame: pd.DataFrame, out_dir: str | Path, *, title: str = "fp8-parity bench",
                       verdict: report.Verdict | None = None) -> list[Path]:
    """results.csv.gz, env.json, speedup_vs_torchao.png, summary.md and index.html in `out_dir`,
    through parity.report's one writer with the benchmark's own tables and verdict."""
    return report.write_report(frame, out_dir, title=title, verdict=verdict or bench_verdict(frame),
                               tables=bench_tables(frame), plots=False,
                               extra_plots={"speedup_vs_torchao.png": partial(plot_speedup, frame=frame)})
