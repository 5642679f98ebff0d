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
* Median, p20 and p80 of `iters` iterations after `warmup` (and at least WARMUP_S seconds of
  warm-up, so that an idle GPU has raised its clocks); peak memory is the rise of
  torch.cuda.max_memory_allocated over the timed loop (inputs and weight excluded).

Two times per row, because a single layer can be host-bound
* median_ms (wall): as a training loop launches it, one step after another. When the host
  needs longer to launch a step than the GPU needs to run it, the GPU waits and this is the
  host's time. It is, for compiled FP8 layers near 1 ms: measured on the H200 machine (16 vCPU
  VM), launching one compiled fwd+bwd takes 0.9-1.9 ms (cuLaunchKernel ~20 us, the AOTAutograd
  runtime, the autograd engine), the kernels of the host-bound rows 0.05-1.3 ms; torchao's and
  fp8_impl's host paths are the same torch code (Inductor emits the same program for both), so
  their wall ratio there measures the host's noise: their launch times differed by 0.71x-1.34x.
* gpu_ms (GPU): the durations of the step's kernels, memsets and copies as the profiler
  (CUPTI) records them, summed (two passes in opposite orders, _measure_gpu): the GPU work of
  the layer without launch gaps, what it costs inside a model whose other layers keep the GPU
  busy. (Replaying the steps as a CUDA graph was tried first and dropped: on the H200 replays
  of GEMM-heavy steps ran up to 16% slower than the same steps launched eagerly, bf16
  included, so they did not time the kernels the loop runs.) host_ms is the host time to
  queue one step (an upper bound on GPU-bound rows, whose launch queue may fill); `bound`
  says which of the two sets the wall time. fraction_of_limit uses gpu_ms: the limit is the
  GPU's.
* Compiled: torch.compile(module, dynamic=False) once per shape and impl, COMPILE_RUNS calls to
  compile forward and backward (`compile_s`), torch._dynamo.reset() around each shape x mode
  so no graph leaks into the next, and a raised recompile limit that fails rather than fall
  back to eager. A configuration that raises is a row with `error`, not a crash of the bench.
* Interleaved: the impls of one shape x mode are built side by side and timed in ROUNDS
  blocks whose order rotates (A B C, B C A, ...), so a drift of clocks or host load over the
  seconds of a run falls on every impl alike and the ratios, computed inside the run, stay fair.

The roofline: limit_ms and fraction_of_limit
Three ceilings are measured at the start of the run (Ceilings): fp8 torch._scaled_mm and bf16
torch.mm TFLOP/s at 8192^3, and HBM bandwidth from a 1 GiB copy. fwd+bwd is 3 GEMMs, 6*M*K*N
flops; an FP8 recipe also moves its quantization glue. With h bytes per high-precision element
(2 for bf16), the fewest bytes of the tensorwise glue (glue_bytes):
    input [M,K], weight [N,K], grad_output [M,N]: each read h (amax), then read h again and
    write 1 + 1 (the cast writes both fp8 layouts the SM90 GEMMs need, row- and column-major,
    from one read; each of the three operands is needed in both)
    total = (2h + 2) * (M*K + N*K + M*N) bytes           (6 * (MK + NK + MN) for bf16)
(Inductor generates exactly this for compiled fp8_impl and torchao; eager fp8_impl makes a
separate transposed copy, one more read of 1 byte per element.)
(the GEMMs' own operand reads and output writes are inside the GEMM time). limit_ms is this
work back to back at the measured peaks: 6*M*K*N / fp8 rate + glue_bytes / bandwidth for FP8
impls (rowwise too: its extra glue shows), 6*M*K*N / bf16 rate for bf16. fraction_of_limit =
limit_ms / gpu_ms: 1 is as fast as the recipe can be on this GPU, 0.5 twice too slow;
small shapes cannot fill the GPU, so their fraction is low by nature. The GEMM rate is measured
at one shape (8192^3), and cuBLAS runs a few others faster: measured up to 1.07 (Llama shapes).

Time on an H200 (measured, fresh machine, cold Inductor cache, fp8_impl + torchao tensorwise +
bf16, warmup 10, iters 50, both modes): small (6 shapes) 98 s, nanochat (9) 124 s, llama (8)
130 s; compilation is most of it.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
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
from parity.folder_manifest import write_files
from parity.impls import Impl
from parity.names import BENCH_DEFAULT_IMPLS, BENCH_PRESET_DESCRIPTIONS
from parity.recipes import DEFAULT_RECIPE, Recipe
from parity.sweep import llama3_shapes, nanochat_shapes

DEFAULT_IMPLS = BENCH_DEFAULT_IMPLS  # in parity.names, with the presets' descriptions: the parser lists them
TIME_COLUMNS = {"median_ms": "", "gpu_ms": "gpu_"}  # time column -> prefix of its ratio columns
COLUMNS = ["preset", "shape", "M", "K", "N", "impl", "recipe", "compiled", "median_ms", "p20_ms", "p80_ms", "gpu_ms",
           "host_ms", "bound", "tflops", "peak_mem_gb", "compile_s", "vs_torchao", "vs_bf16", "gpu_vs_torchao",
           "gpu_vs_bf16", "limit_ms", "fraction_of_limit", "error", "gpu_error"]
ROUNDS = 5  # interleaved timing blocks per configuration (_time_interleaved)
SETTLE_S = 0.2  # idle seconds before each GPU-time measurement (_measure_gpu)
WARMUP_S = 0.1  # seconds of warm-up at least: an idle H200 sits at 345 MHz and needs tens of ms to clock up
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


_SMALL = dict.fromkeys([(4096, 768, 3072), (4096, 768, 768), (8192, 1024, 4096),  # + shapes measured before (README)
                        (32768, 1664, 6656), (32768, 1664, 1664), (16384, 8192, 8192), (4096, 768, 3072)])
_DESCRIPTIONS = BENCH_PRESET_DESCRIPTIONS  # (in parity.names: the parser lists them without importing torch)
PRESETS = {
    "nanochat": BenchPreset("nanochat", _DESCRIPTIONS["nanochat"],
                            _with_tokens(32768, [*nanochat_shapes(20), *nanochat_shapes(26), *nanochat_shapes(32)])),
    "llama": BenchPreset("llama", _DESCRIPTIONS["llama"],
                         _with_tokens(8192, [*llama3_shapes("8b"), *llama3_shapes("70b")])),
    "small": BenchPreset("small", _DESCRIPTIONS["small"],
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


def _warm_up(step: Callable[[int], object], *, warmup: int, min_seconds: float = 0.0) -> int:
    """Call step(i) `warmup` times, and more until `min_seconds` of GPU work have passed; returns the count."""
    torch.cuda.synchronize()
    start, i = time.perf_counter(), 0
    while i < warmup or (time.perf_counter() - start < min_seconds and i < 10_000):
        step(i)
        i += 1
        if i >= warmup:
            torch.cuda.synchronize()
    return i


def _event_times(step: Callable[[int], object], *, warmup: int, iters: int, min_warmup_s: float = 0.0,
                 host_ms: list | None = None) -> list[float]:
    """Milliseconds of each of `iters` calls step(i) after `warmup` untimed ones (CUDA events).
    If `host_ms` is a list, the host time per call of the timed loop (before the final
    synchronize) is appended to it."""
    first = _warm_up(step, warmup=warmup, min_seconds=min_warmup_s) if warmup or min_warmup_s else 0
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    host_start = time.perf_counter()
    for i, (start, end) in enumerate(events):
        start.record()
        step(first + i)
        end.record()
    if host_ms is not None and iters:
        host_ms.append((time.perf_counter() - host_start) * 1e3 / iters)
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in events]


def _fwd_bwd_step(module: nn.Module, inputs_pool: Sequence[torch.Tensor], grad_pool: Sequence[torch.Tensor]):
    """step(i): forward+backward on pool pair i % len; returns (grad_input, *grad_params)."""
    if not all(x.requires_grad for x in inputs_pool):
        raise ValueError("time_fwd_bwd: the inputs must require grad, so that grad_input is computed")
    if len(inputs_pool) != len(grad_pool):
        raise ValueError(f"time_fwd_bwd: {len(inputs_pool)} inputs but {len(grad_pool)} grad_outputs; pair them")
    params = [p for p in module.parameters() if p.requires_grad]

    def step(i: int):
        x = inputs_pool[i % len(inputs_pool)]
        return torch.autograd.grad(module(x), [x, *params], grad_pool[i % len(grad_pool)])
    return step


def time_fwd_bwd(module: nn.Module, inputs_pool: Sequence[torch.Tensor], grad_pool: Sequence[torch.Tensor], *,
                 warmup: int = 5, iters: int = 20, min_warmup_s: float = 0.0,
                 host_ms: list | None = None) -> list[float]:
    """Milliseconds of each timed forward+backward of `module`; iteration i reads inputs_pool[i %
    len] (leaf tensors that require grad) and grad_pool[i % len]. Gradients of the input and of
    every trainable parameter are computed and dropped, never accumulated into .grad."""
    return _event_times(_fwd_bwd_step(module, inputs_pool, grad_pool), warmup=warmup, iters=iters,
                        min_warmup_s=min_warmup_s, host_ms=host_ms)


def kernel_ms_per_step(module: nn.Module, inputs_pool: Sequence[torch.Tensor], grad_pool: Sequence[torch.Tensor],
                       *, steps: int = 20) -> float:
    """GPU milliseconds per forward+backward with the host out of the way: the durations of every
    kernel, memset and copy of `steps` steps, as the profiler (CUPTI) records them, summed and
    divided by `steps`. Launch gaps do not count; the kernels are the ones the timed loop runs."""
    step = _fwd_bwd_step(module, inputs_pool, grad_pool)
    _warm_up(step, warmup=2)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        for i in range(steps):
            step(i)
        torch.cuda.synchronize()
    device_us = sum(event.self_device_time_total for event in profile.key_averages()
                    if event.device_type == torch.autograd.DeviceType.CUDA)
    if not device_us:
        raise RuntimeError("the profiler recorded no GPU activity (is CUPTI available?)")
    return device_us / steps / 1e3


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
        return float(np.median(_event_times(lambda i: fn(), warmup=warmup, iters=iters, min_warmup_s=WARMUP_S)))
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


def glue_bytes(M: int, K: int, N: int, *, hp_bytes: int = 2, recipe: Recipe = DEFAULT_RECIPE) -> int:
    """The fewest bytes a recipe's quantization glue moves per fwd+bwd (Recipe.glue_bytes: for
    tensorwise (2h + 2) bytes per element of input, weight and grad_output)."""
    return recipe.glue_bytes(M, K, N, hp_bytes=hp_bytes)


def limit_ms(M: int, K: int, N: int, ceilings: Ceilings, *, recipe: Recipe = DEFAULT_RECIPE,
             hp_bytes: int = 2) -> float:
    """The fastest fwd+bwd here (ms): the recipe's FP8 GEMMs at the fp8 rate, its high-precision
    GEMMs at the bf16 rate, its quantization glue at the measured bandwidth."""
    fp8_flops, hp_flops = recipe.flops(M, K, N)
    return (fp8_flops / (ceilings.fp8_tflops * 1e9) + hp_flops / (ceilings.bf16_tflops * 1e9)
            + glue_bytes(M, K, N, hp_bytes=hp_bytes, recipe=recipe) / (ceilings.bandwidth_gbs * 1e6))


def _limit_of(impl: Impl, M: int, K: int, N: int, ceilings: Ceilings, dtype: torch.dtype) -> float:
    if impl.is_reference and impl.compute_dtype != torch.bfloat16:
        return math.nan  # no ceiling measured for fp64 and the like
    return limit_ms(M, K, N, ceilings, recipe=impl.recipe, hp_bytes=dtype.itemsize)


def add_ratios(frame: pd.DataFrame) -> pd.DataFrame:
    """vs_torchao, vs_bf16 (wall) and gpu_vs_torchao, gpu_vs_bf16 (GPU work): time of that
    reference / time of the row, on the same preset, shape and compile mode (> 1: the row is
    faster). The torchao reference of a row is torchao's implementation of the row's recipe
    (torchao:tensorwise for a tensorwise row, torchao:rowwise for a rowwise one, ...); NaN where
    either did not run."""
    groups = [frame[key] for key in ("preset", "shape", "compiled")]
    torchao_of = "torchao:" + frame["recipe"].astype(str)
    for time_column, prefix in TIME_COLUMNS.items():
        by_impl = {impl: frame[time_column].where(frame["impl"] == impl).groupby(groups).transform("first")
                   for impl in frame["impl"].unique()}
        nan = pd.Series(math.nan, index=frame.index)
        torchao_ms = pd.concat([by_impl.get(name, nan).loc[[i]] for i, name in torchao_of.items()]) \
            if len(frame) else nan
        frame = frame.assign(**{prefix + "vs_torchao": torchao_ms / frame[time_column],
                                prefix + "vs_bf16": by_impl.get("bf16", nan) / frame[time_column]})
    return frame


@dataclass
class _Config:
    """One implementation built (and compiled) at one shape, and what its timing gathered."""

    impl: Impl
    module: nn.Module | None = None
    inputs: list = field(default_factory=list)
    grads: list = field(default_factory=list)
    compile_s: float = math.nan
    error: str | None = None
    times: list = field(default_factory=list)
    host: list = field(default_factory=list)
    peak_gb: float = 0.0
    gpu: list = field(default_factory=list)  # ms of kernels per step, one entry per pass
    gpu_error: str | None = None


def _prepare(impl: Impl, K: int, N: int, pools, *, compiled: bool, device) -> _Config:
    """Build `impl` for a K->N layer, in its compute dtype, and compile it (COMPILE_RUNS calls)."""
    config, phase = _Config(impl), "build"
    try:
        inputs, grads = pools
        dtype = impl.compute_dtype or inputs[0].dtype
        if dtype != inputs[0].dtype:
            inputs = [x.detach().to(dtype).requires_grad_() for x in inputs]
            grads = [g.to(dtype) for g in grads]
        config.inputs, config.grads = inputs, grads
        torch.manual_seed(0)
        config.module, _, _ = impl.build(nn.Linear(K, N, bias=False, device=device, dtype=dtype))
        if compiled:
            phase, start = "compile", time.perf_counter()
            config.module = torch.compile(config.module, dynamic=False)
            time_fwd_bwd(config.module, inputs, grads, warmup=COMPILE_RUNS, iters=0)
            config.compile_s = time.perf_counter() - start
    except Exception as err:  # noqa: BLE001 - any failure is this configuration's result
        config.error = f"{phase}: {_describe(err)}"
    return config


def _time_interleaved(configs: Sequence[_Config], *, device, warmup: int, iters: int) -> None:
    """Event timings of every configuration, in ROUNDS interleaved blocks whose order rotates
    (A B C, B C A, C A B, ...), so that a drift of the GPU clock or of the host's speed, and
    the state the previous block leaves the GPU in, fall on all of them alike."""
    blocks = [size for size in (iters // ROUNDS + (r < iters % ROUNDS) for r in range(ROUNDS)) if size]
    for block, size in enumerate([0, *blocks]):  # block 0: each one's warm-up
        for config in _rotated(configs, block):
            if config.error is not None:
                continue
            try:
                base = torch.cuda.memory_allocated(device)
                torch.cuda.reset_peak_memory_stats(device)
                config.times += time_fwd_bwd(config.module, config.inputs, config.grads, iters=size,
                                             warmup=warmup if block == 0 else 1,
                                             min_warmup_s=WARMUP_S if block == 0 else 0.0, host_ms=config.host)
                config.peak_gb = max(config.peak_gb, (torch.cuda.max_memory_allocated(device) - base) / 1e9)
            except Exception as err:  # noqa: BLE001
                config.error = f"run: {_describe(err)}"


def _rotated(configs: Sequence[_Config], by: int) -> list[_Config]:
    by %= max(1, len(configs))
    return [*configs[by:], *configs[:by]]


def _measure_gpu(configs: Sequence[_Config], *, device, iters: int) -> None:
    """GPU (kernel) time of every configuration, in two passes of iters/2 steps, the second in
    reverse order, each measurement after SETTLE_S idle. Measured on the H200 in one fixed order
    right after the event timings, the first configuration's kernels ran 3-18% slower than its
    own event timings said (a GPU at its power limit) and the others' 1-6% faster: the order
    and the idle before each measurement must not pick a winner."""
    steps = max(1, iters // 2)
    for order in (list(configs), list(configs)[::-1]):
        for config in order:
            if config.error is not None or config.gpu_error is not None:
                continue
            try:
                torch.cuda.synchronize(device)
                time.sleep(SETTLE_S)
                config.gpu.append(kernel_ms_per_step(config.module, config.inputs, config.grads, steps=steps))
            except Exception as err:  # noqa: BLE001 - a profiler failure costs the GPU-time column only
                torch.cuda.synchronize(device)
                config.gpu_error = _describe(err)


def _result(config: _Config, M: int, K: int, N: int) -> dict:
    """The row of one configuration: its event times, its GPU (kernel) time, or its error."""
    if config.error is not None:
        return {"error": config.error}
    gpu_ms = float(np.mean(config.gpu)) if config.gpu and config.gpu_error is None else math.nan
    p20, median, p80 = np.percentile(config.times, [20, 50, 80])
    host_ms = float(np.median(config.host)) if config.host else math.nan
    return dict(median_ms=median, p20_ms=p20, p80_ms=p80, gpu_ms=gpu_ms, host_ms=host_ms,
                bound=None if math.isnan(gpu_ms) else ("host" if host_ms > gpu_ms else "gpu"),
                tflops=6 * M * K * N / median / 1e9, peak_mem_gb=config.peak_gb, compile_s=config.compile_s,
                error=None, gpu_error=config.gpu_error)


def _describe(err: Exception) -> str:
    return f"{type(err).__name__}: {' '.join(str(err).split())}"[:500]


def run_bench(presets: Sequence[BenchPreset], impls: Sequence[Impl], *, compile_modes: Sequence[bool] = (False, True),
              device: str = "cuda", warmup: int | None = None, iters: int | None = None,
              progress: Callable[[int, int, float], None] | None = None,
              checkpoint: Path | None = None) -> pd.DataFrame:
    """Every preset shape x compile mode x implementation -> one tidy DataFrame (COLUMNS), with
    the environment and the ceilings in frame.attrs["env"]. `warmup`/`iters` override the presets'.
    `checkpoint`: a CSV rewritten (through a temporary file) after every shape and mode, so a run
    cut short keeps the rows it measured."""
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
                    torch._dynamo.reset()  # nothing compiled for another shape or mode is reused
                    configs = [_prepare(impl, K, N, pools, compiled=compiled, device=device) for impl in impls]
                    _time_interleaved(configs, device=device, **runs[preset.name])
                    _measure_gpu(configs, device=device, iters=runs[preset.name]["iters"])
                    for config in configs:
                        measured = _result(config, M, K, N)
                        records.append(dict(preset=preset.name, shape=label, M=M, K=K, N=N, impl=config.impl.name,
                                            recipe=config.impl.recipe.name, compiled=compiled, **measured,
                                            limit_ms=_limit_of(config.impl, M, K, N, ceilings, preset.dtype)))
                    del configs
                    torch._dynamo.reset()
                    if checkpoint is not None:  # whole or not at all, and listed as fp8-parity's in its folder
                        table = add_ratios(pd.DataFrame.from_records(records, columns=COLUMNS))
                        write_files(checkpoint.parent, {checkpoint.name: table.to_csv(index=False).encode()})
                    if progress is not None:
                        progress(len(records), total, time.perf_counter() - start)
                del pools
                torch.cuda.empty_cache()
    frame = add_ratios(pd.DataFrame.from_records(records, columns=COLUMNS))
    frame["fraction_of_limit"] = frame["limit_ms"] / frame["gpu_ms"]
    frame.attrs["env"] = {**environment(device), **asdict(ceilings), "l2_bytes": l2_bytes,
                          "warmup+iters": ", ".join(f"{name} {r['warmup']}+{r['iters']}" for name, r in runs.items()),
                          "seconds": round(time.perf_counter() - start, 1)}
    return frame


# ---- the report ------------------------------------------------------------------------------------

def _geomean(values: pd.Series) -> str:
    values = values.dropna()
    return f"{math.exp(np.log(values).mean()):.2f}x" if len(values) else "n/a"


def _speedups(rows: pd.DataFrame, prefix: str) -> str:
    """'1.04x (min 0.81x) vs torchao:rowwise, 1.11x vs bf16' for one time column's ratios."""
    worst = rows[prefix + "vs_torchao"].min()
    worst = f" (min {worst:.2f}x)" if not math.isnan(worst) else ""
    return (f"{_geomean(rows[prefix + 'vs_torchao'])}{worst} vs torchao:{rows['recipe'].iloc[0]}, "
            f"{_geomean(rows[prefix + 'vs_bf16'])} vs bf16")


def bench_verdict(frame: pd.DataFrame, *, candidate: str | None = None) -> report.Verdict:
    """The headline: `candidate`'s (default: the first impl) geometric-mean speedups per mode, by
    wall time and by GPU time; ok when every configuration ran, else one line per failure."""
    candidate = candidate or frame["impl"].iloc[0]
    mine = frame[(frame["impl"] == candidate) & frame["error"].isna()]
    modes = [f"{'compiled' if compiled else 'eager'}: wall {_speedups(rows, '')}; GPU {_speedups(rows, 'gpu_')}; "
             f"median {rows['fraction_of_limit'].median():.0%} of the limit; "
             f"{(rows['bound'] == 'host').sum()}/{len(rows)} host-bound"
             for compiled, rows in mine.groupby("compiled")]
    failed = frame[frame["error"].notna()]
    headline = (f"{candidate} fwd+bwd over {mine['shape'].nunique()} shapes (geometric mean): "
                + (" | ".join(modes) or "no configuration ran")
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
        ("Forward + backward, median ms (wall)", "CUDA events around each step as a training loop launches it; "
         "inputs rotate over a pool larger than L2. Host-bound rows time the host.", by_shape("median_ms")),
        ("Forward + backward, ms of GPU work", "the kernels of one step, summed from a profile (CUPTI): the time "
         "without launch gaps.", by_shape("gpu_ms")),
        ("Host ms to launch one step", "above the GPU time: the row is host-bound (`bound`).", by_shape("host_ms")),
        ("Speedup vs torchao's implementation of the same recipe (wall)",
         "time of torchao:RECIPE / time of the impl; > 1 is faster.", by_shape("vs_torchao")),
        ("Speedup vs torchao's implementation of the same recipe (GPU)", "the same from the GPU work.",
         by_shape("gpu_vs_torchao")),
        ("Speedup vs bf16 (wall)", "time of bf16 nn.Linear / time of the impl; > 1 is faster.", by_shape("vs_bf16")),
        ("Speedup vs bf16 (GPU)", "the same from the GPU work.", by_shape("gpu_vs_bf16")),
        ("Fraction of the limit", "limit_ms / gpu_ms: the recipe's FP8 GEMMs at the measured fp8 peak, its "
         "high-precision ones at the bf16 peak, + the fewest bytes of its quantization glue at the measured "
         "bandwidth (bf16: 3 GEMMs at the bf16 peak).", by_shape("fraction_of_limit")),
    ]
    gpu_errors = frame[frame["gpu_error"].notna() & frame["error"].isna()]
    if len(gpu_errors):
        sections.append(("GPU-time failures", "these rows have no GPU time",
                         gpu_errors[["shape", "impl", "compiled", "gpu_error"]].reset_index(drop=True)))
    env = frame.attrs.get("env", {})
    if all(key in env for key in Ceilings.__dataclass_fields__):
        ceilings = Ceilings(**{key: env[key] for key in Ceilings.__dataclass_fields__})
        sections.append(("Ceilings measured in this run", None, ceilings.table()))
    return sections


def plot_speedup(fig: Figure, frame: pd.DataFrame, *, column: str = "vs_torchao", what: str = "wall") -> None:
    """Speedup vs torchao's implementation of the same recipe per shape (`column`: by wall or GPU
    time), one bar per implementation, eager and compiled."""
    modes, impls, shapes = (sorted(frame["compiled"].unique()), list(frame["impl"].unique()),
                            list(frame["shape"].unique()))
    fig.set_size_inches(4.5 * len(modes) + 2, 0.18 * len(shapes) * len(impls) + 1.5)
    axes = fig.subplots(1, len(modes), sharey=True, squeeze=False)[0]  # own x scale: compiled ratios sit near 1
    height, y = 0.8 / len(impls), np.arange(len(shapes))
    for ax, compiled in zip(axes, modes):
        speedup = frame[frame["compiled"] == compiled].set_index(["shape", "impl"])[column]
        for i, impl in enumerate(impls):
            ax.barh(y + i * height, [speedup.get((shape, impl), np.nan) for shape in shapes], height, label=impl,
                    color=f"C{i}")
        ax.axvline(1, color="black", lw=0.8)
        ax.set(title=f"{'compiled' if compiled else 'eager'} ({what} time)",
               xlabel="speedup vs torchao, same recipe (> 1: faster)")
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
                               extra_plots={"speedup_vs_torchao.png": partial(plot_speedup, frame=frame),
                                            "gpu_speedup_vs_torchao.png": partial(plot_speedup, frame=frame,
                                                                                  column="gpu_vs_torchao", what="GPU")})
