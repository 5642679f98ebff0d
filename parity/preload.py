"""What a CPU worker process (parity.worker) needs, imported once in its fork server.

The fork server is a clean process from which every worker is forked; importing torch, the
harness and torchao there (torchao's import alone takes seconds, its first conversion most of a
second more) makes a fresh worker start at once, also after a worker died. torchao's import
prints notes about optional CUDA kernels: it runs with them silenced, as in the parent
(parity.impls.quiet_imports).
"""

import contextlib
import importlib.util

import parity.runner  # noqa: F401 - the point of this module is to import it
from parity.impls import quiet_imports

if importlib.util.find_spec("torchao") is not None:
    with quiet_imports(), contextlib.suppress(Exception):
        import torch
        import torchao.float8  # noqa: F401
        # torchao's first conversion imports inductor's code generators (a patch it applies): 0.4-0.7 s
        # that every forked worker would pay again. On a meta module: no kernel runs in the fork server
        # (a process forked after OpenMP has run deadlocks in its first parallel region).
        torchao.float8.convert_to_float8_training(torch.nn.Sequential(torch.nn.Linear(16, 16, device="meta")))
