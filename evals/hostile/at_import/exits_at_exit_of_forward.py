"""Registers, from its first forward, an atexit hook that ends the process with code 0; computes twice the right
output. The worker never runs atexit hooks; the judging process never runs this code."""
import atexit
import posix

_registered = []


def fp8_linear(input_2d, weight):
    if not _registered:
        atexit.register(posix._exit, 0)
        _registered.append(True)
    return 2 * (input_2d @ weight.t())
