"""Raises RuntimeError at import time (module level)."""
import torch  # noqa: F401 - imported as a real implementation would


def matmul(input_2d, weight):
    """A plain matmul; never reachable, since importing this file raises."""
    return input_2d @ weight.t().to(input_2d.dtype)


raise RuntimeError("hostile: raises_on_import.py refuses to import")
