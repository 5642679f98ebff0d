"""Changes global state at import, before any snapshot of a run: float64 default dtype, flushed denormals,
a reseeded generator. Issue 29: unnoticed (the snapshot came later)."""
import torch

torch.set_default_dtype(torch.float64)
torch.set_flush_denormal(True)
torch.manual_seed(1234)


def fp8_linear(input_2d, weight):
    return input_2d @ weight.t()
