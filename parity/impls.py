"""Implementations under test: loading them by name, recognizing their form, building them.

An implementation is named `package.module:attr` or `path/to/file.py:attr`, or by a
built-in name (see BUILTINS). `attr` may be one of three forms:

  function   f(input_2d, weight) -> output            like fp8_impl.float8_matmul
  module     an nn.Linear subclass with from_float()   like torchao's / nanochat's Float8Linear
  converter  f(module, **kwargs) -> module             like convert_to_float8_training

Whatever the form, `Impl.build(linear)` returns a module computing the layer `linear`
describes, plus the parameters its gradients land in.
"""

from __future__ import annotations

import contextlib
import difflib
import enum
import importlib
import importlib.util
import inspect
import logging
import os
import sys
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn


class ImplError(ValueError):
    """An implementation that cannot be loaded or recognized; the message says how to fix it."""


class Form(str, enum.Enum):
    FUNCTION = "function"
    MODULE = "module"
    CONVERTER = "converter"


FORM_HELP = (
    "accepted forms: a function f(input_2d, weight) -> output; an nn.Linear subclass with a "
    "classmethod from_float(linear); a converter f(module, **kwargs) -> module")


@contextlib.contextmanager
def quiet_imports():
    """torchao logs missing optional CUDA kernels and torch deprecation notes at import: hide them."""
    loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree", "torch._dynamo")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


@dataclass
class Impl:
    name: str
    form: Form
    target: Any
    recipe: str = "tensorwise"  # what its numerics claim to be: decides the parity policy
    compute_dtype: torch.dtype | None = None  # references run on the case's data cast to this dtype
    convert_kwargs: dict = field(default_factory=dict)
    device_independent: bool = False  # its results do not depend on the device (float64 math)

    @property
    def is_reference(self) -> bool:
        return self.compute_dtype is not None

    def build(self, linear: nn.Linear) -> tuple[nn.Module, nn.Parameter, nn.Parameter | None]:
        """(module, weight parameter, bias parameter) implementing `linear`."""
        if self.form is Form.FUNCTION:
            module = _FunctionLinear(linear, self.target)
        elif self.form is Form.MODULE:
            module = self.target.from_float(linear)
        else:
            holder = nn.Sequential(linear)  # converters swap children; a holder gives them one
            module = self.target(holder, **self.convert_kwargs)
            if module is None:
                module = holder
        weight, bias = _find_parameters(module, linear)
        return module, weight, bias


class _FunctionLinear(nn.Module):
    """A linear layer around a function f(input_2d, weight), with the bias added in the output dtype."""

    def __init__(self, linear: nn.Linear, fn: Callable):
        super().__init__()
        self.linear, self.fn = linear, fn

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        lead = input.shape[:-1]
        output = self.fn(input.reshape(-1, input.shape[-1]), self.linear.weight)
        output = output.reshape(*lead, output.shape[-1])
        if self.linear.bias is not None:
            output = output + self.linear.bias.to(output.dtype)
        return output


def _find_parameters(module: nn.Module, linear: nn.Linear):
    """The weight and bias the built module uses: the linear's own when shared, else the
    parameters of the converted module with the same shapes."""
    params = dict(module.named_parameters())
    if any(p is linear.weight for p in params.values()):
        return linear.weight, linear.bias
    shape = tuple(linear.weight.shape)
    weights = [p for n, p in params.items() if n.split(".")[-1] == "weight" and tuple(p.shape) == shape]
    biases = [p for n, p in params.items() if n.split(".")[-1] == "bias" and tuple(p.shape) == shape[:1]]
    if len(weights) != 1:
        raise ImplError(
            f"the built module has {len(weights)} parameters named 'weight' of shape {list(shape)} "
            f"(parameters: {[(n, list(p.shape)) for n, p in params.items()]}); parity needs exactly one to "
            f"read grad_weight from")
    return weights[0], (biases[0] if linear.bias is not None and biases else None)


# ---- built-ins ---------------------------------------------------------------------------------

def _fp8_impl() -> Impl:
    from fp8_impl import Float8Linear
    return Impl("fp8_impl", Form.MODULE, Float8Linear)


def _torchao(recipe: str) -> Callable[[], Impl]:
    def load() -> Impl:
        try:
            with quiet_imports():
                from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        except Exception as err:  # noqa: BLE001 - any import failure is reported the same way
            raise ImplError(f"torchao:{recipe} needs torchao.float8, which does not import: {err!r}; "
                            f"install it with `pip install torchao`") from None
        return Impl(f"torchao:{recipe}", Form.CONVERTER, convert_to_float8_training, recipe=recipe,
                    convert_kwargs=dict(config=Float8LinearConfig.from_recipe_name(recipe)))
    return load


def _reference(name: str, dtype: torch.dtype) -> Callable[[], Impl]:
    return lambda: Impl(name, Form.MODULE, _IdentityLinear, recipe=name, compute_dtype=dtype,
                        device_independent=dtype == torch.float64)


class _IdentityLinear:
    """nn.Linear itself, in the function-free 'module' form (references)."""

    @staticmethod
    def from_float(linear: nn.Linear) -> nn.Linear:
        return linear


def _emulated() -> Impl:
    from parity.oracles import emulated_matmul
    return Impl("emulated", Form.FUNCTION, emulated_matmul, recipe="emulated", device_independent=True)


BUILTINS: dict[str, Callable[[], Impl]] = {
    "fp8_impl": _fp8_impl,
    "torchao:tensorwise": _torchao("tensorwise"),
    "torchao:rowwise": _torchao("rowwise"),
    "torchao:rowwise_with_gw_hp": _torchao("rowwise_with_gw_hp"),
    "emulated": _emulated,
    "bf16": _reference("bf16", torch.bfloat16),
    "fp64": _reference("fp64", torch.float64),
}
BUILTIN_HELP = {
    "fp8_impl": "this project's minimal tensorwise Float8Linear",
    "torchao:tensorwise": "torchao Float8Linear, tensorwise recipe",
    "torchao:rowwise": "torchao Float8Linear, rowwise recipe",
    "torchao:rowwise_with_gw_hp": "torchao Float8Linear, rowwise with high-precision grad_weight",
    "emulated": "exact float64 emulation of the tensorwise FP8 math",
    "bf16": "nn.Linear in bfloat16",
    "fp64": "nn.Linear in float64",
}


# ---- loading by name ----------------------------------------------------------------------------

def _import_target(module_spec: str, attr: str) -> Any:
    is_path = module_spec.endswith(".py") or "/" in module_spec or "\\" in module_spec
    try:
        if is_path:
            path = Path(module_spec).expanduser().resolve()
            if not path.is_file():
                raise ImplError(f"implementation file {module_spec!r} does not exist (resolved to {path})")
            module_name = f"_parity_impl_{path.stem}_{abs(hash(str(path))) % 10**8}"
            module = sys.modules.get(module_name)
            if module is None:
                spec = importlib.util.spec_from_file_location(module_name, path)
                module = importlib.util.module_from_spec(spec)
                sys.modules[module_name] = module  # dataclasses and pickling look the module up here
                sys.path.insert(0, str(path.parent))  # so the file can import its siblings
                try:
                    with quiet_imports():
                        spec.loader.exec_module(module)
                except BaseException:
                    del sys.modules[module_name]
                    raise
                finally:
                    sys.path.remove(str(path.parent))
        else:
            with quiet_imports():
                module = importlib.import_module(module_spec)
    except ImplError:
        raise
    except Exception as err:  # noqa: BLE001 - whatever the import raised, show it
        frames = traceback.extract_tb(err.__traceback__)
        where = f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
        raise ImplError(f"cannot import {module_spec!r}: {type(err).__name__}: {err}{where}") from None
    target = module
    for part in attr.split("."):
        if not hasattr(target, part):
            public = [n for n in dir(target) if not n.startswith("_")]
            close = difflib.get_close_matches(part, public, n=3)
            hint = f"; did you mean {close}?" if close else f"; it has: {public[:20]}"
            raise ImplError(f"{module_spec!r} has no attribute {part!r}{hint}")
        target = getattr(target, part)
    return target


def detect_form(target: Any) -> Form:
    """Which of the three forms `target` is; ImplError if none."""
    if inspect.isclass(target):
        if issubclass(target, nn.Module) and callable(getattr(target, "from_float", None)):
            return Form.MODULE
        raise ImplError(f"class {target.__name__} is not an nn.Module with a classmethod from_float(linear); "
                        f"{FORM_HELP}")
    if not callable(target):
        raise ImplError(f"{target!r} is not callable; {FORM_HELP}")
    try:
        params = list(inspect.signature(target).parameters.values())
    except (TypeError, ValueError):
        raise ImplError(f"cannot read the signature of {target!r}; pass --form to say which form it is; "
                        f"{FORM_HELP}") from None
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in positional if p.default is p.empty]
    if len(required) == 2 or (len(required) < 2 <= len(positional)):
        return Form.FUNCTION
    if len(required) == 1:
        return Form.CONVERTER
    raise ImplError(f"{getattr(target, '__name__', target)!r} takes {len(required)} required positional "
                    f"arguments; {FORM_HELP} (or pass --form)")


def _prefer_impl_path() -> None:
    """FP8_PARITY_IMPL_PATH (set by `bisect --git`) puts an implementation's checkout first on sys.path."""
    for path in reversed([p for p in os.environ.get("FP8_PARITY_IMPL_PATH", "").split(os.pathsep) if p]):
        if path not in sys.path:
            sys.path.insert(0, path)


def load_impl(spec: str, *, form: Form | str | None = None, recipe: str | None = None) -> Impl:
    """The implementation named by `spec` (a built-in, `module:attr` or `file.py:attr`)."""
    _prefer_impl_path()
    spec = spec.strip()
    if spec in BUILTINS:
        impl = BUILTINS[spec]()
    else:
        if ":" not in spec:
            raise ImplError(
                f"unknown implementation {spec!r}: name a built-in ({', '.join(BUILTINS)}) or "
                f"'package.module:attr' or 'path/to/file.py:attr'")
        module_spec, _, attr = spec.rpartition(":")
        target = _import_target(module_spec, attr)
        impl = Impl(spec, detect_form(target) if form is None else Form(form), target)
    if form is not None:
        impl.form = Form(form)
    if recipe is not None:
        impl.recipe = recipe
    return impl
