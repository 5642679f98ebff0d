"""Layers that are wrong only at sizes a small search never draws (issue 29, item 9): `check` passed them
with no word that no case that large ran. Each is a plain matmul (bf16 recipe: its numbers are the
reference's) except past its size, where the output is scaled by 1.01: a bug a layer's tiling, a split of K
or a second block of rows could have.
"""

import torch


def _mm(input_2d, weight):
    return input_2d @ weight.t().to(input_2d.dtype)


def wrong_above_m512(input_2d, weight):
    """Right for M <= 512 tokens; the output 1% off beyond."""
    output = _mm(input_2d, weight)
    return output * 1.01 if input_2d.shape[0] > 512 else output


def wrong_above_k256(input_2d, weight):
    """Right for K <= 256; the output 1% off beyond."""
    output = _mm(input_2d, weight)
    return output * 1.01 if input_2d.shape[1] > 256 else output


def right(input_2d, weight):
    """Right at every size (the control: a layer-size case that passes)."""
    return torch.matmul(input_2d, weight.t().to(input_2d.dtype))
