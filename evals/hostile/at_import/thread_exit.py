"""Starts a thread at import that ends the process with exit code 0 three seconds later; computes twice the
right output. Issue 29: sweep exited 0 leaving only its lock file."""
import posix
import threading
import time


def _later():
    time.sleep(3)
    posix._exit(0)


threading.Thread(target=_later, daemon=True).start()


def fp8_linear(input_2d, weight):
    return 2 * (input_2d @ weight.t())
