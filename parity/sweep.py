"""`fp8-parity sweep`: many implementations on a grid of named layer shapes plus a hypothesis
sample of the case space, each against float64, against the reference implementation of its
recipe (torchao's) and against its recipe's exact emulation, collected into one results table.

A preset is a description: which named shapes (nanochat and Llama 3 layers), how many tokens
on each device (float64 references of a 32768-token layer do not fit a CPU's time), how many
sampled cases and how large. The sample is drawn by hypothesis with derandomize=True, so a
preset gives the same cases on every run and machine.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import pandas as pd
import torch
import torch.multiprocessing as mp
from hypothesis import HealthCheck, Phase, given, settings

from parity.cases import Case, Dist, Layout, edge_cases
from parity.env import environment
from parity.exits import raise_if_stopped
from parity.impls import Impl, builtin_for_recipe, default_reference, hopper_reference, load_impl
from parity.names import SWEEP_DEFAULT_IMPLS, SWEEP_PRESET_DESCRIPTIONS
from parity.policy import Policy, default_policy
from parity.rows import frame as rows_frame
from parity.rows import rows_from_frame
from parity.runner import Comparison, isolation, run_case_isolated
from parity.sharding import merge_frames, shard, share_host_threads
from parity.strategies import cases as case_strategy

DEFAULT_IMPLS = SWEEP_DEFAULT_IMPLS  # in parity.names, with the presets' descriptions: the parser lists them


def sweep_comparisons(impls: Sequence[Impl], device_type: str, *, accuracy_only: bool = False) -> list[Comparison]:
    """Each implementation against fp64 (accuracy), the reference implementation of its recipe on
    this device (parity), its recipe's exact emulation (the accumulation bound and the operands of
    its GEMM calls) and, where results are Hopper's bits, its recipe's Hopper model (policy exact),
    each judged by its default policy; only against fp64 with
    `accuracy_only` (an accuracy table of large layers, where the float64 emulation costs most)."""
    fp64 = load_impl("fp64")
    comparisons = []
    for impl in impls:
        references = [fp64]
        if impl.recipe.is_fp8 and not accuracy_only:
            references.append(default_reference(impl, device_type))
            if not impl.exact:
                references.append(load_impl(builtin_for_recipe("emulated", impl.recipe)))
            model = hopper_reference(impl, device_type)
            if model is not None:  # the GPU's own bits, where calibrated (policy exact)
                references.append(model)
        for reference in dict.fromkeys(r.name for r in references if r.name != impl.name):
            ref = next(r for r in references if r.name == reference)
            comparisons.append(Comparison(impl, ref, default_policy(impl, ref)))
    return comparisons


def nanochat_shapes(depth: int) -> list[tuple[str, int, int]]:
    """nanochat's transformer at `depth`: model dim 64 x depth, attention projections, MLP 4x."""
    dim = 64 * depth
    return [(f"nanochat-d{depth} attn.qkvo", dim, dim), (f"nanochat-d{depth} mlp.fc", dim, 4 * dim),
            (f"nanochat-d{depth} mlp.proj", 4 * dim, dim)]


def llama3_shapes(size: str) -> list[tuple[str, int, int]]:
    """Llama 3 layer shapes (8B: dim 4096, FFN 14336; 70B: dim 8192, FFN 28672; 8 KV heads of 128)."""
    dim, ffn = {"8b": (4096, 14336), "70b": (8192, 28672)}[size]
    return [(f"llama3-{size} attn.qo", dim, dim), (f"llama3-{size} attn.kv", dim, 1024),
            (f"llama3-{size} mlp.up", dim, ffn), (f"llama3-{size} mlp.down", ffn, dim)]


@dataclass(frozen=True)
class CpuLimits:
    """What a preset runs on a CPU instead, where a full-width layer's float64 references and
    metrics take tens of seconds per case (llama3-8b attn.qo at 64 tokens: about a minute on two
    cores). The cases that find layout, dtype, state and data bugs are small ones."""

    named: bool = False  # run the named layer shapes?
    samples: int | None = None  # sampled cases (None: the preset's)
    max_dim: int | None = None  # largest K, N, M of the sample (None: the preset's)


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    named_shapes: tuple[tuple[str, int, int], ...]  # (label, K, N)
    tokens: dict  # device type -> M for the named shapes
    samples: int  # hypothesis-sampled cases
    max_dim: int  # largest K, N, M of the sample
    variants: tuple[dict, ...] = ({},)  # Case fields each named shape is also run with
    cpu: CpuLimits | None = None  # on a CPU: fewer, smaller cases (None: the same as on a GPU)

    def _limits(self, device_type: str) -> tuple[bool, int, int]:
        limits = self.cpu if device_type == "cpu" else None
        if limits is None:
            return True, self.samples, self.max_dim
        return limits.named, self.samples if limits.samples is None else limits.samples, \
            limits.max_dim or self.max_dim

    def describe(self, device_type: str) -> str:
        """Which cases run on this device, and why (for the report)."""
        named, samples, max_dim = self._limits(device_type)
        shapes = (f"{len(self.named_shapes) * len(self.variants)} named layer shapes at "
                  f"{self.tokens.get(device_type, self.tokens['cpu'])} tokens" if named else
                  "no named layer shapes (on a CPU their float64 references take minutes: they run on a GPU, "
                  "or here with --preset nanochat or llama)")
        return f"{shapes}; edge cases; {samples} sampled cases with M, K, N up to {max_dim}"

    def cases(self, device_type: str, *, seed: int = 0, alignment: int = 16) -> list[tuple[str, Case]]:
        """(label, case) for every named shape x variant, then the edge cases and the hypothesis
        sample. With `alignment` > 16 (a block-scaled recipe among the implementations) the named
        shapes' tokens round up to it, and the edge cases and a sixth of the sample come twice:
        at 16 and at that alignment, so every recipe has cases it can take."""
        run_named, samples, max_dim = self._limits(device_type)
        M = -(-self.tokens.get(device_type, self.tokens["cpu"]) // alignment) * alignment
        named = [(label, Case(lead=(M,), K=K, N=N, seed=seed).replace(**variant))
                 for label, K, N in self.named_shapes for variant in self.variants] if run_named else []
        sampled = [("edge case", case) for case in edge_cases(seed=seed)]
        sampled += [("sampled", case) for case in sample_cases(samples, max_dim=max_dim, seed=seed)]
        if alignment > 16:
            sampled += [("edge case", case) for case in edge_cases(seed=seed, alignment=alignment)]
            sampled += [("sampled", case) for case in sample_cases(max(1, samples // 6), seed=seed,
                                                                   max_dim=max(max_dim, 2 * alignment),
                                                                   alignment=alignment)]
        return named + list(dict.fromkeys(sampled))


_VARIANTS = ({}, {"input_layout": Layout.TRANSPOSED}, {"input_dtype": "fp32", "weight_dtype": "fp32", "bias": True},
             {"dist": Dist.OUTLIER})
_DESCRIPTIONS = SWEEP_PRESET_DESCRIPTIONS  # (in parity.names: the parser lists them without importing torch)
PRESETS = {
    "quick": Preset("quick", _DESCRIPTIONS["quick"],
                    (*nanochat_shapes(20), *llama3_shapes("8b")[:2]), {"cpu": 64, "cuda": 1024}, 120, 256,
                    cpu=CpuLimits(named=False, samples=60, max_dim=128)),
    "full": Preset("full", _DESCRIPTIONS["full"],
                   (*nanochat_shapes(20), *nanochat_shapes(26), *nanochat_shapes(32), *llama3_shapes("8b"),
                    *llama3_shapes("70b")), {"cpu": 64, "cuda": 2048}, 1000, 1024, _VARIANTS),
    "nanochat": Preset("nanochat", _DESCRIPTIONS["nanochat"], (
        *nanochat_shapes(20), *nanochat_shapes(26), *nanochat_shapes(32)), {"cpu": 128, "cuda": 8192}, 60, 512,
        _VARIANTS),
    "llama": Preset("llama", _DESCRIPTIONS["llama"],
                    (*llama3_shapes("8b"), *llama3_shapes("70b")), {"cpu": 32, "cuda": 4096}, 60, 512, _VARIANTS),
    "outliers": Preset("outliers", _DESCRIPTIONS["outliers"],
                       (*nanochat_shapes(20), *llama3_shapes("8b"), *llama3_shapes("70b")),
                       {"cpu": 128, "cuda": 4096}, 0, 256,
                       ({}, {"dist": Dist.OUTLIER}, {"dist": Dist.OUTLIER_ROW})),
    # the named shapes of a real (small) model at sizes past every case of check's search and the quick preset
    # (M, K, N <= 256): bugs that show only past a size; on a GPU the same layers at 4096 tokens. 768 tokens on
    # a CPU, not 512: with M equal to K or N two GEMMs' calls have the same shapes, and telling them apart
    # costs the operand diagnosis more than the case (52 s against 28 s for M768K2048N512 at a load of 13)
    "cpu-layers": Preset("cpu-layers", _DESCRIPTIONS["cpu-layers"], tuple(nanochat_shapes(8)),
                         {"cpu": 768, "cuda": 4096}, 20, 256, _VARIANTS),
}


def sample_cases(count: int, *, max_dim: int = 256, seed: int = 0, alignment: int = 16) -> list[Case]:
    """`count` distinct cases drawn by hypothesis (derandomized: the same list every time)."""
    drawn: list[Case] = []
    if count <= 0:
        return drawn

    @settings(max_examples=count, derandomize=True, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(case=case_strategy(max_dim=max_dim, max_tokens=max_dim, alignment=alignment))
    def collect(case):
        drawn.append(case.replace(seed=case.seed + seed))

    collect()
    unique = list(dict.fromkeys(drawn))
    return unique[:count]


def case_work(case: Case) -> int:
    """The work of a case, for the ETA: multiply-adds of its GEMMs, M*K*N per GEMM and step (each
    of the three GEMMs of a step has M*K*N, and every case runs the same implementations and
    references, so the common factors cancel in a share of the work)."""
    return case.M * case.K * case.N * case.steps


class SweepInterrupted(Exception):
    """A sweep stopped by Ctrl-C or SIGTERM: `frame` holds the cases that finished."""

    def __init__(self, frame: pd.DataFrame, cause: KeyboardInterrupt):
        super().__init__(f"interrupted after {frame.attrs['done']} of {frame.attrs['planned']} cases")
        self.frame, self.cause = frame, cause


CHECKPOINT_SECONDS = 15.0  # how often run_sweep hands its rows so far to `checkpoint`


def run_sweep(labelled_cases: Sequence[tuple[str, Case]], comparisons: Sequence[Comparison], *,
              device: str, progress: Callable[..., None] | None = None,
              isolate: bool | None = None,
              time_limit: float | None = None, done: pd.DataFrame | None = None,
              checkpoint: Callable[[pd.DataFrame], None] | None = None) -> pd.DataFrame:
    """All cases -> one tidy DataFrame (column `shape` holds the named shape or 'sampled').

    Each case runs in a worker process (`isolate`; by default when any implementation is not a
    built-in: parity.runner.isolation) within `time_limit` seconds, so
    an implementation that dies or hangs is a finding of its case and the sweep goes on. `done`
    holds the rows of an interrupted sweep: its cases are not run again. `checkpoint(frame)` gets
    the rows so far every CHECKPOINT_SECONDS. A Ctrl-C or SIGTERM stops the sweep at once (the
    running case is dropped) and raises SweepInterrupted with the rows of the finished cases.
    `progress(done, total, elapsed, work=(work_done, work_planned))` follows every case: cases
    done and planned (a resumed sweep's included), seconds, and the work of this run's cases
    (case_work) done and planned, from which parity.cli.Progress estimates the time left.
    The frame's attrs: env, done and planned (cases)."""
    rows = [] if done is None else rows_from_frame(done)
    finished = {(row.shape, row.case_id) for row in rows}
    todo = [(label, case) for label, case in labelled_cases if (label, case.id) not in finished]
    work_planned, work_done = sum(case_work(case) for _, case in todo), 0
    start = last_checkpoint = time.perf_counter()

    def frame_of(count: int) -> pd.DataFrame:
        frame = rows_frame(rows)
        frame.attrs["env"] = environment(device)
        frame.attrs["env"]["seconds"] = round(time.perf_counter() - start, 1)
        frame.attrs.update(done=len(labelled_cases) - len(todo) + count, planned=len(labelled_cases))
        return frame

    count = 0  # cases of `todo` whose rows are all in `rows`
    try:
        with isolation(comparisons, device, isolate) as runner:
            for label, case in todo:
                raise_if_stopped()  # a Ctrl-C or SIGTERM whose exception was lost stops the sweep here (parity.exits)
                ran = run_case_isolated(case, comparisons, device=device, runner=runner, time_limit=time_limit)
                rows.extend(row.but(shape=label) for row in ran)  # one step: an interrupt never leaves half a case
                count += 1
                work_done += case_work(case)
                if device == "cuda" and runner is None:
                    torch.cuda.empty_cache()  # large named shapes would otherwise pile up cached blocks
                if progress is not None:
                    progress(len(labelled_cases) - len(todo) + count, len(labelled_cases), time.perf_counter() - start,
                             work=(work_done, work_planned))
                if checkpoint is not None and time.perf_counter() - last_checkpoint > CHECKPOINT_SECONDS:
                    checkpoint(frame_of(count))
                    last_checkpoint = time.perf_counter()
    except KeyboardInterrupt as cause:
        raise SweepInterrupted(frame_of(count), cause) from None
    return frame_of(count)


def named_shape_table(frame: pd.DataFrame, *, candidate: str = "fp8_impl") -> pd.DataFrame:
    """Per named shape and tensor: the candidate's SQNR vs fp64 and its bitwise parity with the
    implementation of its recipe it was compared with."""
    named = frame[(frame["shape"] != "sampled") & (frame["shape"] != "edge case") & (frame["impl"] == candidate)]
    named = named[named["skipped"].fillna("") == ""]
    if named.empty:
        return pd.DataFrame()
    sqnr = named[named["reference"] == "fp64"].groupby(["shape", "tensor"], sort=False)["sqnr_db"].median()
    parity = named[named["policy"] == Policy.BITWISE.value].groupby(["shape", "tensor"], sort=False)["bitwise"]
    return pd.DataFrame({"median SQNR vs fp64 (dB)": sqnr.round(2),
                         "bitwise parity with its recipe's reference (%)": parity.mean().mul(100).round(1)}
                        ).reset_index()


def accuracy_by_recipe(frame: pd.DataFrame) -> pd.DataFrame:
    """Median SQNR against fp64 of each implementation (its recipe) and tensor on the preset's named
    layer shapes, one column per data distribution: which recipe keeps its accuracy on outliers."""
    named = frame[~frame["shape"].isin(["sampled", "edge case"]) & (frame["reference"] == "fp64")
                  & frame["skipped"].fillna("").eq("") & frame["error"].isna()]
    if named.empty:
        return pd.DataFrame()
    table = named.groupby(["impl", "recipe", "tensor", "dist"], sort=False)["sqnr_db"].median().unstack("dist")
    return table.round(2).reset_index()


def _sweep_worker(index: int, devices: list[str], labelled_cases, impl_names, out_dir: str) -> None:
    """One process of a sharded sweep: its share of the cases on its device, to a pickle."""
    device = devices[index]
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    share_host_threads(len(devices))
    comparisons = sweep_comparisons([load_impl(n) for n in impl_names], torch.device(device).type)
    frame = run_sweep(shard(labelled_cases, index, len(devices)), comparisons, device=device)
    frame.to_pickle(f"{out_dir}/shard{index}.pkl")


def run_sweep_sharded(labelled_cases: Sequence[tuple[str, Case]], impl_names: Sequence[str], *,
                      devices: Sequence[str]) -> pd.DataFrame:
    """The sweep split round-robin over `devices` (one process each), merged into one table.

    Implementations travel by name (a function loaded from a file does not pickle), and each
    worker builds its own; the merged table has a column `gpu` naming the device of each row.
    """
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_sweep_worker, args=(list(devices), list(labelled_cases), list(impl_names), out_dir),
                           nprocs=len(devices), join=True, start_method="spawn")
        frames = {f"{device}#{i}": pd.read_pickle(f"{out_dir}/shard{i}.pkl") for i, device in enumerate(devices)}
    return merge_frames(frames)
