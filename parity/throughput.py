"""How fast the harness itself runs: small-shape cases per second of the check pipeline.

One "case" is what `fp8-parity check` does per example: forward and backward of the
candidate (with its _scaled_mm calls recorded), of the torchao reference and of the exact
emulation, the metrics of every tensor against both, the accumulation bound and the
policy's judgement. Small shapes (M, K, N from 16 to 128) make the cost per case mostly
Python and kernel launches, so several worker processes (one CUDA context each, sharing
the GPU) multiply the throughput until the host's cores run out.

    fp8-parity throughput --device cuda --workers 8
"""

from __future__ import annotations

import time

import torch
import torch.multiprocessing as mp

from parity.cases import Case, Dist, Layout
from parity.check import CheckPlan
from parity.impls import load_impl
from parity.runner import run_case

DIMS = (16, 32, 48, 64, 96, 128)


def small_cases(count: int) -> list[Case]:
    """A deterministic mix of small cases: shapes, layouts, dtypes and distributions vary."""
    layouts, dists = list(Layout), [Dist.NORMAL, Dist.UNIFORM, Dist.HEAVY, Dist.OUTLIER, Dist.NEGATIVE]
    return [Case(lead=(DIMS[i % 6],), K=DIMS[(i // 6) % 6], N=DIMS[(i // 36) % 6], input_layout=layouts[i % 4],
                 weight_layout=layouts[(i // 4) % 4], input_dtype=("bf16", "fp32")[i % 2], bias=bool(i % 3 == 0),
                 dist=dists[i % 5], seed=i) for i in range(count)]


def _run_share(cases, impl: str, against: str, device: str, timings: dict | None = None) -> float:
    plan = CheckPlan.make(load_impl(impl), load_impl(against))
    for case in cases[:3]:  # warm-up: first calls pay for lazy initialization
        plan.judge(run_case(case, plan.comparisons, device=device))
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    start = time.perf_counter()
    for case in cases:
        plan.judge(run_case(case, plan.comparisons, device=device, timings=timings))
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - start


def _worker(index: int, shares, impl: str, against: str, device: str, barrier, results) -> None:
    torch.set_num_threads(1)
    share = shares[index]
    _run_share(share[:3], impl, against, device)  # warm up this process before the clock starts
    barrier.wait()
    results.put((index, len(share), _run_share(share, impl, against, device)))


def measure(*, device: str, workers: int = 1, cases: int = 300, impl: str = "fp8_impl",
            against: str = "torchao:tensorwise") -> dict:
    """Cases per second over `cases` small cases split across `workers` processes (wall clock from
    a common start to the last worker's end), plus the host time per phase of one process."""
    all_cases = small_cases(cases)
    timings: dict[str, float] = {}
    if workers <= 1:
        seconds = _run_share(all_cases, impl, against, device, timings)
    else:
        context = mp.get_context("spawn")
        barrier, results = context.Barrier(workers + 1), context.Queue()
        shares = [all_cases[i::workers] for i in range(workers)]
        processes = [context.Process(target=_worker, args=(i, shares, impl, against, device, barrier, results))
                     for i in range(workers)]
        for p in processes:
            p.start()
        barrier.wait()
        start = time.perf_counter()
        done = [results.get(timeout=600) for _ in processes]
        seconds = time.perf_counter() - start
        for p in processes:
            p.join()
        if sum(n for _, n, _ in done) != len(all_cases):
            raise RuntimeError(f"throughput: the workers ran {sum(n for _, n, _ in done)} of {len(all_cases)} cases")
    total = sum(timings.values())
    return dict(device=device, workers=workers, cases=len(all_cases), seconds=round(seconds, 3),
                cases_per_second=round(len(all_cases) / seconds, 1),
                phase_share={k: round(v / total, 3) for k, v in timings.items()} if total else {})
