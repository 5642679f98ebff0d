"""Registers posix._exit(0) to run at interpreter exit, and computes twice the right output. Issue 29:
check printed FAIL and still exited 0 (the atexit hook ran in the process that gave the verdict)."""
import atexit
import posix

atexit.register(posix._exit, 0)


def fp8_linear(input_2d, weight):
    return 2 * (input_2d @ weight.t())
