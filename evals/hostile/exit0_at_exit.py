"""Registers posix._exit(0) as an atexit hook at import, and computes twice the right output.

A process that imported this module and then judged it would print FAIL and still exit 0 when
the interpreter shuts down: the hook ends the process before the exit code is set. Only a process
that never imports it can report its failure with exit 1.
"""
import atexit
import posix

from hostile_import_marker import note  # a sibling: the loader puts this file's folder on sys.path

from fp8_impl.matmul import float8_matmul

note("exit0_at_exit.py")
atexit.register(posix._exit, 0)


def doubles_output(input_2d, weight):
    """2x fp8_impl's tensorwise float8_matmul: wrong at the first GEMM."""
    return 2 * float8_matmul(input_2d, weight)
