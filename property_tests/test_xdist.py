"""Spreading the suite over GPUs: xdist worker -> device, round-robin case shards, merged tables."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from parity.sharding import merge_frames, shard, worker_device, xdist_worker_id

REPO_ROOT = Path(__file__).resolve().parents[1]

# The repository's conftest.py registers parity.sharding.xdist_device the same way.
FIXTURE_CODE = '''
import pytest

from parity import sharding

xdist_device = pytest.fixture(scope="session", name="xdist_device")(sharding.xdist_device)
'''

# Four tests, so that each of two workers gets some; each records who ran it, on what device.
PROBE_TESTS = '''
import json, os, pytest, torch
from parity.sharding import worker_device, xdist_worker_id

@pytest.mark.parametrize("index", range(4))
def test_probe(index, xdist_device, request):
    worker = xdist_worker_id(request.config)
    record = dict(worker=worker, device=xdist_device, device_of_2_gpus=worker_device(worker, gpu_count=2),
                  threads=torch.get_num_threads())
    with open(os.path.join(os.environ["PROBE_DIR"], f"{index}.json"), "w") as f:
        json.dump(record, f)
'''


@pytest.mark.parametrize(("worker_id", "gpu_count", "expected"), [
    (None, 2, "cuda:0"), ("master", 2, "cuda:0"), ("gw0", 2, "cuda:0"), ("gw1", 2, "cuda:1"),
    ("gw2", 2, "cuda:0"), ("gw13", 8, "cuda:5"), ("gw1", 1, "cuda:0"), ("gw3", 0, "cpu"), (None, 0, "cpu"),
])
def test_worker_device(worker_id, gpu_count, expected):
    assert worker_device(worker_id, gpu_count=gpu_count) == expected


def test_worker_device_counts_the_visible_gpus():
    expected = "cuda:1" if torch.cuda.device_count() > 1 else "cuda:0" if torch.cuda.device_count() else "cpu"
    assert worker_device("gw1") == expected


@pytest.mark.parametrize("worker_id", ["gw", "w1", "gw-1", "1"])
def test_worker_device_rejects_other_ids(worker_id):
    with pytest.raises(ValueError, match="not a pytest-xdist worker id"):
        worker_device(worker_id, gpu_count=2)


def test_xdist_worker_id_prefers_workerinput(monkeypatch):
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw7")
    assert xdist_worker_id(SimpleNamespace(workerinput={"workerid": "gw3"})) == "gw3"
    assert xdist_worker_id(SimpleNamespace()) == "gw7"
    monkeypatch.delenv("PYTEST_XDIST_WORKER")
    assert xdist_worker_id(SimpleNamespace()) is None


@given(n_items=st.integers(0, 40), count=st.integers(1, 9))
def test_shards_cover_every_item_once(n_items, count):
    items = [f"case{i}" for i in range(n_items)]
    shards = [shard(items, index, count) for index in range(count)]
    assert sorted(item for part in shards for item in part) == sorted(items)
    assert max(map(len, shards)) - min(map(len, shards)) <= 1  # balanced
    assert shards == [shard(items, index, count) for index in range(count)]  # deterministic
    assert all(part == items[index::count] for index, part in enumerate(shards))  # round-robin


@pytest.mark.parametrize(("index", "count"), [(2, 2), (-1, 2), (0, 0)])
def test_shard_rejects_bad_index(index, count):
    with pytest.raises(ValueError, match="shard index"):
        shard([1, 2, 3], index, count)


def test_merge_frames_keeps_first_env_and_records_gpus():
    first, second = pd.DataFrame({"case_id": ["a", "b"]}), pd.DataFrame({"case_id": ["c"]})
    first.attrs["env"], second.attrs["env"] = {"torch": "2.13", "gpu": "H200"}, {"torch": "other"}
    merged = merge_frames({"cuda:0": first, "cuda:1": second})
    assert merged["case_id"].tolist() == ["a", "b", "c"]
    assert merged["gpu"].tolist() == ["cuda:0", "cuda:0", "cuda:1"]
    assert merged.attrs["env"] == {"torch": "2.13", "gpu": "H200", "gpus": ["cuda:0", "cuda:1"]}
    assert "gpus" not in first.attrs["env"]  # the inputs are left alone


def test_merge_frames_needs_a_frame():
    with pytest.raises(ValueError, match="at least one frame"):
        merge_frames({})


def _run_probe(tmp_path: Path, *pytest_args: str) -> list[dict]:
    """Run the probe tests with the offered fixture in a fresh pytest; return what each test recorded."""
    (tmp_path / "conftest.py").write_text(FIXTURE_CODE)
    (tmp_path / "test_probe.py").write_text(PROBE_TESTS)
    probe_dir = tmp_path / "records"
    probe_dir.mkdir()
    env = dict(os.environ, PROBE_DIR=str(probe_dir), PYTHONPATH=str(REPO_ROOT), CUDA_VISIBLE_DEVICES="")
    env.pop("PYTEST_XDIST_WORKER", None)  # this suite may itself run under xdist
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *pytest_args],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    return [json.loads(path.read_text()) for path in sorted(probe_dir.glob("*.json"))]


def test_fixture_without_xdist_is_worker_0(tmp_path):
    records = _run_probe(tmp_path, "-p", "no:xdist")
    threads = {record.pop("threads") for record in records}
    assert records == [dict(worker=None, device="cpu", device_of_2_gpus="cuda:0")] * 4
    assert len(threads) == 1  # torch's own default: nothing shares the host


@pytest.mark.skipif(importlib.util.find_spec("xdist") is None, reason="pytest-xdist is not installed")
def test_fixture_pins_each_xdist_worker(tmp_path):
    records = _run_probe(tmp_path, "-n", "2")
    assert len(records) == 4
    assert {r["worker"] for r in records} == {"gw0", "gw1"}  # both workers ran tests
    for record in records:
        assert record["device"] == "cpu"  # CUDA_VISIBLE_DEVICES="" hides any GPU
        assert record["device_of_2_gpus"] == f"cuda:{record['worker'][2:]}"
        assert record["threads"] == max(1, (os.cpu_count() or 1) // 2)  # two workers share the host's cores


def test_a_worker_computes_with_its_parents_host_threads():
    """The oracles' float64 GEMMs run in the worker: it takes the parent's thread count with each task
    (torch's default of one per core in every process starved eight sharded scorers on the H200 machine)."""
    from parity.worker import Worker
    before = torch.get_num_threads()
    runner = Worker("cpu")
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            assert runner.call(torch.get_num_threads, time_limit=60) == threads
    finally:
        torch.set_num_threads(before)
        runner.close()
