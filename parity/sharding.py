"""Spreading work over several GPUs: one GPU per pytest-xdist worker, sweep cases split over GPUs.

`pytest -n N` (pytest-xdist) starts N worker processes; `worker_device` pins worker gwK to
GPU K mod gpu_count (the conftest fixture `xdist_device` uses it), `shard` splits a sweep's
cases over GPUs round-robin (`fp8-parity sweep --gpus N`), and `merge_frames` joins the
per-GPU result tables into one. On one GPU or the CPU everything degrades to one device
without changing results.
"""

from __future__ import annotations

import os
from typing import Mapping, Sequence

import pandas as pd
import torch


def xdist_worker_id(config) -> str | None:
    """This process's pytest-xdist worker id ("gw0", "gw1", ...), or None outside xdist.

    Works with or without xdist installed: a worker's config carries `workerinput`, and
    xdist also exports PYTEST_XDIST_WORKER to its workers.
    """
    workerinput = getattr(config, "workerinput", None)
    if workerinput is not None:
        return workerinput["workerid"]
    return os.environ.get("PYTEST_XDIST_WORKER")


def worker_device(worker_id: str | None, *, gpu_count: int | None = None) -> str:
    """The device of an xdist worker: "cuda:{N % gpu_count}" for worker "gwN", "cpu" with no GPU.

    worker_id None or "master" (plain pytest, or xdist's controller) counts as worker 0.
    gpu_count defaults to torch.cuda.device_count().
    """
    if gpu_count is None:
        gpu_count = torch.cuda.device_count()
    if worker_id in (None, "master"):
        index = 0
    elif worker_id.startswith("gw") and worker_id[2:].isdigit():
        index = int(worker_id[2:])
    else:
        raise ValueError(f"not a pytest-xdist worker id: {worker_id!r} (expected 'gw0', 'gw1', ..., 'master' or None)")
    return f"cuda:{index % gpu_count}" if gpu_count > 0 else "cpu"


def shard(items: Sequence, index: int, count: int) -> list:
    """Round-robin share `index` of `count` (items index, index + count, ...): every item in exactly one share."""
    if count < 1 or not 0 <= index < count:
        raise ValueError(f"shard index must be in [0, count) with count >= 1, got index={index}, count={count}")
    return list(items[index::count])


def merge_frames(frames: Mapping[str, pd.DataFrame]) -> pd.DataFrame:
    """Concatenate per-device result tables {"cuda:0": frame, ...} into one, in the mapping's order.

    The result keeps the first frame's attrs["env"], with env["gpus"] listing the devices
    merged; each row gets a column `gpu` naming the device that produced it.
    """
    if not frames:
        raise ValueError("merge_frames needs at least one frame")
    merged = pd.concat([frame.assign(gpu=gpu) for gpu, frame in frames.items()], ignore_index=True)
    first = next(iter(frames.values()))
    merged.attrs = {"env": {**first.attrs.get("env", {}), "gpus": list(frames)}}
    return merged


def share_host_threads(processes: int) -> int:
    """Give this process its share of the host's cores for torch's intra-op threads, when `processes`
    harness processes share the machine (xdist workers, sweep shards, ranks, sharded scorers), and
    return it. torch's default is one thread per core in every process: eight scorers on the H200
    machine's 16 cores made no progress in 200 s that way; with 2 threads each they scored a
    held-out set in 127 s (2026-12-02). Workers take their parent's count with each task."""
    threads = max(1, (os.cpu_count() or 1) // max(1, processes))
    torch.set_num_threads(threads)
    return threads


def xdist_processes() -> int:
    """How many pytest-xdist workers run side by side (1 outside xdist)."""
    try:
        return max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    except ValueError:
        return 1


def xdist_device(request) -> str:
    """This pytest worker's device: under `pytest -n N`, worker gwK gets cuda:{K % GPUs} (cpu
    without GPUs); plain pytest counts as worker 0. Works with or without pytest-xdist.
    conftest.py registers it as the session fixture `xdist_device`."""
    device = worker_device(xdist_worker_id(request.config))
    if device.startswith("cuda"):
        torch.cuda.set_device(device)  # plain "cuda" tensors of this worker land on its GPU too
    return device

