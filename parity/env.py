"""The environment a result was measured in: versions, device, git commit."""

from __future__ import annotations

import functools
import platform
import subprocess
from importlib.metadata import version

import torch

from parity import __version__


@functools.lru_cache(maxsize=None)
def _git_sha(cwd: str | None = None) -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True,
                             timeout=5, cwd=cwd)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


@functools.lru_cache(maxsize=None)
def torchao_version() -> str | None:
    try:
        return version("torchao")
    except Exception:  # noqa: BLE001 - not installed
        return None


def environment(device: torch.device | str = "cpu") -> dict:
    """A flat dict of what produced a result (attached to every results table)."""
    device = torch.device(device)
    on_gpu = device.type == "cuda" and torch.cuda.is_available()
    return dict(
        parity=__version__, torch=torch.__version__, torchao=torchao_version(),
        cuda=torch.version.cuda, hip=torch.version.hip, python=platform.python_version(),
        device=device.type,
        gpu=torch.cuda.get_device_name(device) if on_gpu else None,
        compute_capability=".".join(map(str, torch.cuda.get_device_capability(device))) if on_gpu else None,
        cpu=platform.processor() or platform.machine(), git_sha=_git_sha(),
    )
