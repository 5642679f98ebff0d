"""Replaces `evaluate` in every loaded parity module with one that finds nothing, and computes twice the right
output. Issue 29: sweep printed PASS ... bitwise equal in 67/67."""
import sys


def _nothing(*args, **kwargs):
    return []


for _name, _module in list(sys.modules.items()):
    if _name.startswith("parity") and hasattr(_module, "evaluate"):
        _module.evaluate = _nothing


def fp8_linear(input_2d, weight):
    return 2 * (input_2d @ weight.t())
