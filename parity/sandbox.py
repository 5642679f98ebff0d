"""What the code under test may not do to the process it runs in, and how the harness notices.

An implementation runs beside its references in one process (a worker, parity.worker). Two
things it could do there would corrupt the verdict rather than merely fail:

- exit the process (sys.exit, os._exit) with code 0: a run cut short would read as a pass.
  sys.exit raises SystemExit, which the runner catches; `exits_raise` turns os._exit, which
  skips every handler, into an exception too.
- change global state: a default dtype of float64, a monkeypatched torch._scaled_mm or
  F.linear, grad mode switched off, a global module hook or saved-tensors hook, TF32 switched
  on. The references and every later case would then run under the implementation's rules; a
  patched _scaled_mm even makes a reference agree with a wrong candidate. `GlobalState`
  snapshots what can be changed, and `changes_since` restores it and names what changed (a
  finding of the implementation: "changed global state: default dtype float32 -> float64").
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.modules import module as nn_module


class ProcessExit(SystemExit):
    """The code under test called os._exit: raised instead, so the process (and the verdict) survives."""


@contextlib.contextmanager
def exits_raise():
    """os._exit raises ProcessExit while the code under test runs."""
    real = os._exit

    def _exit(code=0):
        raise ProcessExit(f"os._exit({code}) was called")
    os._exit = _exit
    try:
        yield
    finally:
        os._exit = real


# Functions an implementation might replace to "fix" a kernel for everyone: (owner, attribute).
PATCHABLE = [(torch, "_scaled_mm"), (torch, "matmul"), (torch, "mm"), (torch, "addmm"), (torch.Tensor, "__matmul__"),
             (torch.Tensor, "matmul"), (F, "linear"), *([(F, "scaled_mm")] if hasattr(F, "scaled_mm") else [])]
MODULE_HOOKS = [name for name in ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                                  "_global_backward_pre_hooks") if hasattr(nn_module, name)]
BACKEND_FLAGS = [("TF32 matmuls", torch.backends.cuda.matmul, "allow_tf32"),
                 ("TF32 convolutions", torch.backends.cudnn, "allow_tf32"),
                 ("reduced-precision bf16 reductions", torch.backends.cuda.matmul,
                  "allow_bf16_reduced_precision_reduction"),
                 ("reduced-precision fp16 reductions", torch.backends.cuda.matmul,
                  "allow_fp16_reduced_precision_reduction")]


def _flushes_denormals() -> bool:
    # on the CPU whatever the default device is (an implementation may set it to "meta")
    return bool(torch.tensor([1e-40], device="cpu").mul(1.0).eq(0).item())


def _default_device() -> str:
    try:
        return str(torch.get_default_device())
    except Exception:  # noqa: BLE001 - a setting left unreadable counts as changed
        return "unreadable"


def _restore_default_device(device: str) -> None:
    with contextlib.suppress(Exception):
        torch.set_default_device(None if device == "cpu" else device)


def _determinism() -> tuple[bool, bool]:
    return torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()


def _matmul_precision() -> str:
    try:
        return torch.get_float32_matmul_precision()
    except Exception:  # noqa: BLE001 - a setting left unreadable counts as changed
        return "unreadable"


@dataclass
class GlobalState:
    """The process-wide settings an implementation could change, as they were at `capture()`."""

    default_dtype: torch.dtype
    grad_enabled: bool
    matmul_precision: str
    flush_denormal: bool
    flags: dict
    functions: dict
    hooks: dict
    saved_tensors_hooks: object
    seed: int  # what the global CPU generator was last seeded with (drawing from it does not change this)
    rng_state: torch.Tensor
    # torch's host threads, deterministic algorithms (and warn-only), anomaly detection, the default device:
    # each changes what later code computes or how fast (issue 29: each passed unnoticed)
    threads: int = 0
    determinism: tuple = (False, False)
    anomaly: bool = False
    default_device: str = "cpu"

    @classmethod
    def capture(cls) -> "GlobalState":
        return cls(torch.get_default_dtype(), torch.is_grad_enabled(), _matmul_precision(), _flushes_denormals(),
                   {label: getattr(owner, name) for label, owner, name in BACKEND_FLAGS},
                   {(owner, name): owner.__dict__.get(name, getattr(owner, name)) for owner, name in PATCHABLE},
                   {name: dict(getattr(nn_module, name)) for name in MODULE_HOOKS},
                   torch._C._autograd._top_saved_tensors_default_hooks(False),
                   torch.initial_seed(), torch.get_rng_state(), torch.get_num_threads(), _determinism(),
                   torch.is_anomaly_enabled(), _default_device())

    def changes_since(self) -> list[str]:
        """What differs from this snapshot now, each restored; [] when nothing changed."""
        changed = []
        if _default_device() != self.default_device:
            changed.append(f"default device {self.default_device} -> {_default_device()}")
            _restore_default_device(self.default_device)
        if torch.get_num_threads() != self.threads:
            changed.append(f"torch's host threads {self.threads} -> {torch.get_num_threads()}")
            torch.set_num_threads(self.threads)
        if _determinism() != self.determinism:
            changed.append(f"deterministic algorithms (enabled, warn only) {self.determinism} -> {_determinism()}")
            torch.use_deterministic_algorithms(self.determinism[0], warn_only=self.determinism[1])
        if torch.is_anomaly_enabled() != self.anomaly:
            changed.append(f"anomaly detection {'on' if self.anomaly else 'off'} -> "
                           f"{'on' if torch.is_anomaly_enabled() else 'off'}")
            torch.autograd.set_detect_anomaly(self.anomaly)
        if torch.get_default_dtype() != self.default_dtype:
            changed.append(f"default dtype {self.default_dtype} -> {torch.get_default_dtype()}")
            torch.set_default_dtype(self.default_dtype)
        if torch.is_grad_enabled() != self.grad_enabled:
            changed.append(f"grad mode {'on' if self.grad_enabled else 'off'} -> "
                           f"{'on' if torch.is_grad_enabled() else 'off'}")
            torch.set_grad_enabled(self.grad_enabled)
        if _matmul_precision() != self.matmul_precision:
            changed.append(f"float32 matmul precision {self.matmul_precision} -> {_matmul_precision()}")
            with contextlib.suppress(Exception):
                torch.set_float32_matmul_precision(self.matmul_precision)
        if _flushes_denormals() != self.flush_denormal:
            changed.append(f"flush denormals {self.flush_denormal} -> {not self.flush_denormal}")
            torch.set_flush_denormal(self.flush_denormal)
        for label, owner, name in BACKEND_FLAGS:
            if getattr(owner, name) != self.flags[label]:
                changed.append(f"{label} {self.flags[label]} -> {getattr(owner, name)}")
                setattr(owner, name, self.flags[label])
        for (owner, name), original in self.functions.items():
            if owner.__dict__.get(name, getattr(owner, name)) is not original:
                changed.append(f"{getattr(owner, '__name__', owner)}.{name} replaced")
                setattr(owner, name, original)
        for name, before in self.hooks.items():
            hooks = getattr(nn_module, name)
            if dict(hooks) != before:
                changed.append(f"global module hooks ({name}: {len(before)} -> {len(hooks)})")
                for key in [k for k in hooks if k not in before]:
                    del hooks[key]
        if torch._C._autograd._top_saved_tensors_default_hooks(False) != self.saved_tensors_hooks:
            changed.append("a saved-tensors hook left installed")
            while torch._C._autograd._top_saved_tensors_default_hooks(False) not in (None, self.saved_tensors_hooks):
                torch._C._autograd._pop_saved_tensors_default_hooks()
        if torch.initial_seed() != self.seed:  # a reseed (training's dropout masks would repeat), not a draw
            changed.append(f"the global random generator reseeded (seed {self.seed} -> {torch.initial_seed()})")
            torch.set_rng_state(self.rng_state)
        return changed
