"""Hostile and broken implementations for fp8-parity's loader/runner (a "hostile corpus").

Every top-level function or class here misbehaves on purpose: it exits, crashes, hangs, spams,
breaks the form contract, mutates its arguments, or corrupts torch's global state. None of it
is meant to be robust. `manifest.json` (next to this file) says what each one does and when.

Where a real product is needed, it is plain `input_2d @ weight.t()` (numerics are not the point).
Names: fwd_* misbehave in forward, bwd_* in backward, ret_* return something wrong.
"""
import ctypes
import os
import sys
import time

import torch
from torch import nn


def _mm(input_2d, weight):
    return input_2d @ weight.t().to(input_2d.dtype)


class _BackwardAction(torch.autograd.Function):
    """A plain matmul whose backward first runs `action()` (which is where it misbehaves)."""

    @staticmethod
    def forward(ctx, input_2d, weight, action):
        ctx.save_for_backward(input_2d, weight)
        ctx.action = action
        return _mm(input_2d, weight)

    @staticmethod
    def backward(ctx, grad_output):
        ctx.action()
        input_2d, weight = ctx.saved_tensors
        grad_input = grad_output @ weight.to(grad_output.dtype)
        grad_weight = (grad_output.t() @ input_2d.to(grad_output.dtype)).to(weight.dtype)
        return grad_input, grad_weight, None


# ---- 1. exits in forward ----------------------------------------------------------------------

def fwd_sys_exit0(input_2d, weight):
    """Calls sys.exit(0) in forward (raises SystemExit(0): looks like a clean exit)."""
    sys.exit(0)


def fwd_sys_exit3(input_2d, weight):
    """Calls sys.exit(3) in forward."""
    sys.exit(3)


def fwd_os_exit0(input_2d, weight):
    """Calls os._exit(0) in forward: the process ends at once with status 0, no cleanup, no exception."""
    os._exit(0)


def fwd_os_exit1(input_2d, weight):
    """Calls os._exit(1) in forward: immediate process exit with status 1."""
    os._exit(1)


# ---- 2. exits in backward ---------------------------------------------------------------------

def bwd_sys_exit0(input_2d, weight):
    """Correct forward; backward calls sys.exit(0) inside the autograd engine."""
    return _BackwardAction.apply(input_2d, weight, lambda: sys.exit(0))


def bwd_os_exit0(input_2d, weight):
    """Correct forward; backward calls os._exit(0) inside the autograd engine."""
    return _BackwardAction.apply(input_2d, weight, lambda: os._exit(0))


# ---- 3. BaseExceptions that are not Exceptions --------------------------------------------------

def fwd_keyboard_interrupt(input_2d, weight):
    """Raises KeyboardInterrupt in forward (as if the user pressed Ctrl-C)."""
    raise KeyboardInterrupt("hostile: KeyboardInterrupt in forward")


def _raise_system_exit():
    raise SystemExit(5)


def bwd_system_exit(input_2d, weight):
    """Correct forward; backward raises SystemExit(5)."""
    return _BackwardAction.apply(input_2d, weight, _raise_system_exit)


def fwd_generator_exit(input_2d, weight):
    """Raises GeneratorExit in forward (a BaseException that `except Exception` does not catch)."""
    raise GeneratorExit("hostile: GeneratorExit in forward")


# ---- 5. hangs and slowness ----------------------------------------------------------------------

def fwd_sleep_forever(input_2d, weight):
    """Sleeps 10**6 seconds (about 11.6 days) in forward: a hang that is idle, not busy."""
    time.sleep(10**6)
    return _mm(input_2d, weight)


def _spin_forever():
    while True:
        pass


def bwd_busy_loop(input_2d, weight):
    """Correct forward; backward spins in a busy `while True: pass` loop forever (100% CPU)."""
    return _BackwardAction.apply(input_2d, weight, _spin_forever)


def slow_3s(input_2d, weight):
    """Correct result, but sleeps 3 seconds on every forward call (slow but finishes)."""
    time.sleep(3)
    return _mm(input_2d, weight)


# ---- 6. native crashes --------------------------------------------------------------------------

def fwd_segfault(input_2d, weight):
    """Reads address 0 through ctypes.string_at(0) in forward: SIGSEGV."""
    ctypes.string_at(0)
    return _mm(input_2d, weight)


def bwd_abort(input_2d, weight):
    """Correct forward; backward calls os.abort(): SIGABRT."""
    return _BackwardAction.apply(input_2d, weight, os.abort)


# ---- 7. memory --------------------------------------------------------------------------------

def fwd_unbounded_alloc(input_2d, weight):
    """Appends 1 GiB tensors (written, so the pages are real) to a list forever, in forward."""
    hoard = []
    while True:
        hoard.append(torch.ones(2**28, dtype=torch.float32))  # 2**28 * 4 bytes = 1 GiB


# ---- 8. output spam ---------------------------------------------------------------------------

def fwd_stdout_spam(input_2d, weight):
    """Correct result; prints 10 MB (100,000 lines of 99 chars + newline) to stdout in forward."""
    line = "x" * 99
    for _ in range(100_000):
        print(line)
    return _mm(input_2d, weight)


def _spam_stderr():
    line = "e" * 99
    for _ in range(100_000):
        print(line, file=sys.stderr)


def bwd_stderr_spam(input_2d, weight):
    """Correct result; backward prints 10 MB to stderr."""
    return _BackwardAction.apply(input_2d, weight, _spam_stderr)


# ---- 9. bad returns -----------------------------------------------------------------------------

def ret_tuple(input_2d, weight):
    """Returns the tuple (output, None) instead of a tensor."""
    return _mm(input_2d, weight), None


def ret_none(input_2d, weight):
    """Computes the product and returns None (a forgotten `return`)."""
    _mm(input_2d, weight)


def ret_float(input_2d, weight):
    """Returns a Python float (the sum of the product) instead of a tensor."""
    return float(_mm(input_2d, weight).sum())


def ret_transposed(input_2d, weight):
    """Returns output.t(): shape (N, M) instead of (M, N). When M == N the shape is right and
    only the values are transposed."""
    return _mm(input_2d, weight).t()


def ret_wrong_shape(input_2d, weight):
    """Returns (M, N + 1): the output with its first column appended again (always the wrong shape)."""
    out = _mm(input_2d, weight)
    return torch.cat([out, out[:, :1]], dim=1)


def ret_noncontiguous(input_2d, weight):
    """Correct values, returned column-major (out.t().contiguous().t()): not contiguous."""
    return _mm(input_2d, weight).t().contiguous().t()


def ret_input_view(input_2d, weight):
    """Returns a view of its input: the input itself when K == N, else input[:, :N]. No
    dependence on weight (weight's gradient stays None)."""
    n = weight.shape[0]
    return input_2d if input_2d.shape[1] == n else input_2d[:, :n]


def ret_int_tensor(input_2d, weight):
    """Returns the rounded product as an int32 tensor (no grad_fn; backward cannot run)."""
    return _mm(input_2d, weight).round().to(torch.int32)


# ---- 10. mutating arguments ---------------------------------------------------------------------

def mutates_input(input_2d, weight):
    """Calls input_2d.mul_(2) before computing. On an input that requires grad (a leaf or a view
    of one) autograd refuses the in-place op and it raises; otherwise the caller's input is doubled."""
    input_2d.mul_(2)
    return _mm(input_2d, weight)


def mutates_input_no_grad(input_2d, weight):
    """Doubles the caller's input in place under torch.no_grad() (no error), then computes with it."""
    with torch.no_grad():
        input_2d.mul_(2)
    return _mm(input_2d, weight)


def mutates_weight_data(input_2d, weight):
    """Scales weight.data by 1.01 in place on every forward (invisible to autograd's version
    counter). 1.01, not 1.0001: a bf16 weight times 1.0001 rounds back to itself."""
    weight.data.mul_(1.01)
    return _mm(input_2d, weight)


def weight_add_no_grad(input_2d, weight):
    """Calls weight.add_(1e-2) under torch.no_grad() in forward: the parameter drifts every call."""
    with torch.no_grad():
        weight.add_(1e-2)
    return _mm(input_2d, weight)


# ---- 11. nondeterminism and state ----------------------------------------------------------------

def nondeterministic(input_2d, weight):
    """Adds noise U[0,1) * 1e-3 * max|output| to every element: different on every call. (Noise
    relative to the output's largest magnitude: 1e-3 per-element relative noise vanishes in bf16.)"""
    out = _mm(input_2d, weight)
    return out + 1e-3 * out.detach().abs().amax() * torch.rand_like(out)


_calls = {"n": 0}


def stateful_counter(input_2d, weight):
    """Counts its calls; from the 2nd call on, adds 0.01 * (calls - 1) to every output element."""
    _calls["n"] += 1
    return _mm(input_2d, weight) + 0.01 * (_calls["n"] - 1)


# ---- 12. module / converter contract ----------------------------------------------------------

class FromFloatReturnsNone(nn.Linear):
    """Module form whose from_float returns None."""

    @classmethod
    def from_float(cls, linear):
        return None


class FromFloatRaises(nn.Linear):
    """Module form whose from_float raises RuntimeError."""

    @classmethod
    def from_float(cls, linear):
        raise RuntimeError("hostile: from_float refuses to build")


class FromFloatExits(nn.Linear):
    """Module form whose from_float calls sys.exit(0) (exit at build time)."""

    @classmethod
    def from_float(cls, linear):
        sys.exit(0)


class _BufferLinear(nn.Module):
    """A linear layer whose weight and bias are buffers, not parameters."""

    def __init__(self, linear):
        super().__init__()
        self.register_buffer("w", linear.weight.detach().clone())
        self.register_buffer("b", None if linear.bias is None else linear.bias.detach().clone())

    def forward(self, x):
        out = x @ self.w.t().to(x.dtype)
        return out if self.b is None else out + self.b.to(out.dtype)


def converter_no_weight(module, **kwargs):
    """Converter: swaps each nn.Linear child for a module holding the weight as a buffer, so the
    result has no weight parameter (no grad_weight anywhere)."""
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            setattr(module, name, _BufferLinear(child))
        else:
            converter_no_weight(child, **kwargs)
    return module


def converter_deletes_linear(module, **kwargs):
    """Converter: deletes every nn.Linear child (an nn.Sequential holder becomes the identity)."""
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            delattr(module, name)
        else:
            converter_deletes_linear(child, **kwargs)
    return module


# ---- 13. global state ------------------------------------------------------------------------

def sets_default_dtype_fp64(input_2d, weight):
    """Correct result, but calls torch.set_default_dtype(torch.float64) in forward (never restored)."""
    torch.set_default_dtype(torch.float64)
    return _mm(input_2d, weight)


def sets_backend_flags(input_2d, weight):
    """Correct result, but flips global numerics flags in forward (never restored): flush
    denormals on the CPU, fp32 matmul precision 'medium', TF32 on for CUDA matmul and cuDNN,
    reduced-precision bf16/fp16 reductions allowed."""
    torch.set_flush_denormal(True)
    torch.set_float32_matmul_precision("medium")
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = True
    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = True
    return _mm(input_2d, weight)


def reseeds_rng(input_2d, weight):
    """Correct result, but calls torch.manual_seed(1234) in forward: resets the global RNG that
    the caller may draw its data from."""
    torch.manual_seed(1234)
    return _mm(input_2d, weight)


def disables_grad_globally(input_2d, weight):
    """Calls torch.set_grad_enabled(False) (not as a context) in forward: the output has no
    grad_fn and grad mode stays off for this thread afterwards."""
    torch.set_grad_enabled(False)
    return _mm(input_2d, weight)


def _double_saved(t):
    return t * 2 if t.is_floating_point() else t


def global_saved_tensors_hook(input_2d, weight):
    """Enters torch.autograd.graph.saved_tensors_hooks and never exits: every tensor autograd
    saves from then on (this call's and every later one's, references included) is unpacked
    doubled, so gradients are 2x wrong."""
    torch.autograd.graph.saved_tensors_hooks(lambda t: t, _double_saved).__enter__()
    return _mm(input_2d, weight)


def _scale_linear_output(module, args, output):
    if isinstance(module, nn.Linear) and isinstance(output, torch.Tensor):
        return output * 1.01
    return None


def global_module_forward_hook(input_2d, weight):
    """Correct result, but registers a global module forward hook (once per call, never removed)
    that scales the output of every nn.Linear by 1.01: references computed afterwards are wrong."""
    nn.modules.module.register_module_forward_hook(_scale_linear_output)
    return _mm(input_2d, weight)


def _wrong_scaled_mm(a, b, *args, **kwargs):
    out_dtype = kwargs.get("out_dtype") or torch.bfloat16
    return torch.zeros(a.shape[0], b.shape[1], dtype=out_dtype, device=a.device)


def monkeypatch_scaled_mm(input_2d, weight):
    """Correct result, but replaces torch._scaled_mm with a function returning zeros (never restored)."""
    torch._scaled_mm = _wrong_scaled_mm
    return _mm(input_2d, weight)


def _wrong_linear(input, weight, bias=None):
    out = input @ weight.t()
    out = out if bias is None else out + bias
    return out * 1.01


def monkeypatch_F_linear(input_2d, weight):
    """Correct result, but replaces torch.nn.functional.linear (what nn.Linear.forward calls) with
    one that scales by 1.01 (never restored): every nn.Linear reference computed afterwards is wrong."""
    torch.nn.functional.linear = _wrong_linear
    return _mm(input_2d, weight)


# ---- 14. non-finite outputs --------------------------------------------------------------------

def ret_nan(input_2d, weight):
    """Returns NaN everywhere (output + nan; gradients themselves stay finite)."""
    return _mm(input_2d, weight) + float("nan")


def ret_inf_one(input_2d, weight):
    """Returns the correct output except element [0, 0], which is +Inf."""
    out = _mm(input_2d, weight)
    mask = torch.zeros_like(out, dtype=torch.bool)
    mask[0, 0] = True
    return torch.where(mask, torch.full_like(out, float("inf")), out)
