"""A CUDA fault for the worker's tests (GPU only): a kernel that reads out of bounds.

On CUDA an out-of-bounds gather is a device-side assert: the kernel fails asynchronously, and the
process's CUDA context is unusable afterwards (every later kernel raises). The harness must report
it for the case that triggered it and run the next cases in a fresh process.
"""
import torch


def oob_gather_with_32_rows(input_2d, weight):
    """A plain matmul, except on a CUDA input of 32 rows: first a gather past the end of the input."""
    if input_2d.is_cuda and input_2d.shape[0] == 32:
        index = torch.full((input_2d.shape[0],), 10 ** 6, device=input_2d.device)
        input_2d = input_2d[index]
    return input_2d @ weight.t().to(input_2d.dtype)
