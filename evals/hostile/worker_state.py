"""Implementations (function form, bf16 numbers) that raise oddly or change process state in forward: each is a
finding of the implementation, never an internal error of the harness (issue 29, items 13 and 16)."""
import torch


class NotAnException(BaseException):
    """Derives from BaseException, not Exception."""


class UnprintableError(Exception):
    def __str__(self):
        raise RuntimeError("this exception cannot be printed")


def _linear(input_2d, weight):
    return input_2d @ weight.t()


def raises_base_exception(input_2d, weight):
    raise NotAnException("derived from BaseException")


def raises_unprintable(input_2d, weight):
    raise UnprintableError()


def raises_50_mib_message(input_2d, weight):
    raise ValueError("x" * (50 << 20))


def sets_default_device_meta(input_2d, weight):
    torch.set_default_device("meta")
    return _linear(input_2d, weight)


def sets_threads(input_2d, weight):
    torch.set_num_threads(1 if torch.get_num_threads() != 1 else 2)
    return _linear(input_2d, weight)


def sets_deterministic(input_2d, weight):
    torch.use_deterministic_algorithms(True)
    return _linear(input_2d, weight)


def sets_anomaly(input_2d, weight):
    torch.autograd.set_detect_anomaly(True)
    return _linear(input_2d, weight)


_calls = [0]


def nan_from_37th_call(input_2d, weight):
    _calls[0] += 1
    output = _linear(input_2d, weight)
    return output * float("nan") if _calls[0] >= 37 else output
