"""Hostile code for `fp8-parity train`: implementations (function form, fp8_impl's tensorwise
float8_matmul, bitwise torchao's) that misbehave at a given call of the run, and a `--model`
factory that exits the process. `manifest.json` lists them with "command": "train".

On the tiny model a forward calls the implementation 13 times (12 block layers and the head), so
call 40 is the first layer's forward of step 3 (0-based) and call 20 is in step 1.

At import this module notes its process id (hostile_import_marker): property_tests/test_hostile.py
asserts that the process that judges never imported it.
"""
import os
import posix
import time

import torch
from hostile_import_marker import note  # a sibling: the loader puts this file's folder on sys.path

from fp8_impl.matmul import float8_matmul

note("train.py")

_calls = {"count": 0}


def _call() -> int:
    """The number of this call of the implementation in this process (1 for the first)."""
    _calls["count"] += 1
    return _calls["count"]


def posix_exit0_at_call_40(input_2d, weight):
    """Right numbers until its 40th call, where it ends the process with code 0 through posix._exit,
    which no os._exit patch sees: a process that judged here would exit 0, a pass."""
    if _call() == 40:
        posix._exit(0)
    return float8_matmul(input_2d, weight)


def sleeps_from_call_20(input_2d, weight):
    """Right numbers until its 20th call (step 1 on the tiny model), where it sleeps forever."""
    if _call() >= 20:
        time.sleep(10**9)
    return float8_matmul(input_2d, weight)


def reseeds_every_call(input_2d, weight):
    """Right numbers, but reseeds torch's global generator at every call (dropout masks would repeat)."""
    torch.manual_seed(1234)
    return float8_matmul(input_2d, weight)


def default_dtype_at_call_40(input_2d, weight):
    """Right numbers, but sets the default dtype to float64 at its 40th call (step 3), never restored."""
    if _call() == 40:
        torch.set_default_dtype(torch.float64)
    return float8_matmul(input_2d, weight)


def model_exits_while_building():
    """A --model factory that ends the process with code 0 instead of returning a model."""
    os._exit(0)
