"""Hostile implementations whose exception messages are enormous (issue 29, item 15): a user's
layer that raises with a tensor's repr, a log or a file's contents in its message. fp8-parity must
report the exception in one bounded line, never echo 50 MiB to the terminal, the JSON or the table.
"""


def fwd_raises_50_mib(input_2d, weight):
    """Raises RuntimeError whose message is 50 MiB on one line."""
    raise RuntimeError("x" * (50 * 2**20))


def fwd_raises_many_lines(input_2d, weight):
    """Raises ValueError whose message is 200,000 lines (the first line short)."""
    raise ValueError("first line of a long report\n" + "line\n" * 200_000)
