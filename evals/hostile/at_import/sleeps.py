"""Sleeps at import for longer than anyone waits. Issue 29: no time limit (ended by an outside timeout)."""
import time

time.sleep(10_000)


def fp8_linear(input_2d, weight):
    return input_2d @ weight.t()
