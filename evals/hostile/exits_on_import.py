"""Calls sys.exit(0) at import time (module level), before `matmul` can be used."""
import sys

import torch  # noqa: F401 - imported as a real implementation would


def matmul(input_2d, weight):
    """A plain matmul; never reachable, since importing this file exits."""
    return input_2d @ weight.t().to(input_2d.dtype)


sys.exit(0)
