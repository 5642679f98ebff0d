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
import dataclasses
import difflib
import enum
import importlib
import importlib.util
import inspect
import logging
import math
import os
import sys
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from parity import cpu_gemm, hopper
from parity.cases import Layout
from parity.hopper_oracle import hopper_matmul
from parity.names import FSDP_FLOAT8_ALL_GATHER, family_recipes
from parity.oracles import emulated_matmul
from parity.sandbox import ProcessExit, exits_raise
from parity.recipes import DEFAULT_RECIPE, FP8_RECIPES, RECIPES, Recipe, Scaling, get_recipe
from parity.vocabulary import Phase


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
        with exits_raise():  # a module that calls os._exit at import is an error of the module, not an exit 0
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


@dataclass
class Impl:
    name: str
    form: Form
    target: Any
    recipe: Recipe = DEFAULT_RECIPE  # what its numerics claim to be: decides oracle, policy, alignment
    convert_kwargs: dict = field(default_factory=dict)  # passed to a converter or to from_float
    exact: bool = False  # a float64 emulation: its results do not depend on the device
    bit_model: bool = False  # the Hopper model (hopper:<recipe>): a GPU's bits, judged bit for bit where calibrated
    # why a case cannot run here (beyond the recipe's alignment), or None: cuda-only kernels, dtypes
    limits: Callable[[Any, str], str | None] | None = None
    # code under test, described here and run in a worker only (parity.runner.execute): the process that judges
    # it never imports it (its `target` is None there)
    remote: bool = False

    def __reduce__(self):
        """Pickled by name: a worker process rebuilds the implementation (parity.worker)."""
        return reload_impl, self.reload_args

    @property
    def reload_args(self) -> tuple[str, str, str, bool]:
        """What rebuilds this implementation in another process: reload_impl(*impl.reload_args)."""
        return self.name, self.form.value, self.recipe.name, self.recipe.reciprocal_scales

    @property
    def is_reference(self) -> bool:
        """A high-precision nn.Linear (bf16, fp64): runs on the case's data cast to compute_dtype."""
        return not self.recipe.is_fp8

    @property
    def compute_dtype(self) -> torch.dtype | None:
        return self.recipe.high_precision

    @property
    def device_independent(self) -> bool:
        return self.exact or self.compute_dtype == torch.float64

    def unsupported(self, case, device_type: str) -> str | None:
        """Why `case` is skipped for this implementation on `device_type` (not a failure), or None."""
        reason = self.recipe.unsupported(case.M, case.K, case.N)
        if reason is None and self.limits is not None:
            reason = self.limits(case, device_type)
        return None if reason is None else f"{self.name}: {reason}"

    def build(self, linear: nn.Linear, *,
              name: str | None = None) -> tuple[nn.Module, nn.Parameter, nn.Parameter | None]:
        """(module, weight parameter, bias parameter) implementing `linear`. `name`: the layer's
        name in its model ("blocks.0.mlp.c_fc"), which a converter sees as the layer's fqn (its
        module filter decides by it); without one, the converter sees the layer as "0"."""
        if self.remote:
            raise RuntimeError(f"{self.name} is code under test: it is built only in a worker, never in the process "
                               f"that judges it")
        if self.form is Form.FUNCTION:
            module = _FunctionLinear(linear, self.target)
        elif self.form is Form.MODULE:
            module = self.target.from_float(linear, **self.convert_kwargs)
        elif name is None:
            holder = nn.Sequential(linear)  # converters swap children; a holder gives them one
            module = self.target(holder, **self.convert_kwargs)
            if module is None:
                module = holder
        else:
            holder = _holder_at(name, linear)
            converted = self.target(holder, **self.convert_kwargs)
            module = (holder if converted is None else converted).get_submodule(name)
        weight, bias = _find_parameters(module, linear)
        return module, weight, bias


def linear_names(model: nn.Module) -> list[str]:
    """The names of the nn.Linear layers of `model`, in its order."""
    return [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]


LayerWrap = Callable[[str, nn.Module, nn.Parameter], nn.Module]  # (name, converted layer, weight) -> module


def convert_linears(model: nn.Module, impl: Impl,
                    wrap: LayerWrap | None = None) -> dict[str, tuple[nn.Parameter, nn.Parameter | None]]:
    """Replace every nn.Linear of `model`, in place, by its implementation by `impl` (Impl.build with
    the layer's name, so a converter's module filter sees the real fqn), put inside wrap(name, layer,
    weight) when given. Returns each converted layer's (weight, bias) parameters (where its gradients
    land), by layer name, in the model's order."""
    parameters = {}
    for name in linear_names(model):
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        layer, weight, bias = impl.build(getattr(parent, leaf), name=name)
        parameters[name] = (weight, bias)
        setattr(parent, leaf, layer if wrap is None else wrap(name, layer, weight))
    return parameters


def _holder_at(name: str, linear: nn.Linear) -> nn.Module:
    """A root module holding `linear` at the path `name` (empty modules on the way): a converter
    sees the layer under its name in the model."""
    root = parent = nn.Module()
    *path, leaf = name.split(".")
    for part in path:
        child = nn.Module()
        parent.add_module(part, child)
        parent = child
    parent.add_module(leaf, linear)
    return root


class _FunctionLinear(nn.Module):
    """A linear layer around a function f(input_2d, weight). A function that takes a bias (a
    parameter named `bias`: F.linear's f(input, weight, bias=None)) adds it itself, and is judged
    on how; otherwise the bias is added here, in the output dtype."""

    def __init__(self, linear: nn.Linear, fn: Callable):
        super().__init__()
        self.linear, self.fn = linear, fn
        try:
            self.takes_bias = "bias" in inspect.signature(fn).parameters
        except (TypeError, ValueError):
            self.takes_bias = False

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        lead = input.shape[:-1]
        input_2d = input.reshape(-1, input.shape[-1])
        bias = self.linear.bias
        output = self.fn(input_2d, self.linear.weight, bias=bias) if self.takes_bias and bias is not None \
            else self.fn(input_2d, self.linear.weight)
        if not isinstance(output, torch.Tensor):
            raise TypeError(f"{_defined_at(self.fn)} returned {type(output).__name__}, not a tensor")
        output = output.reshape(*lead, output.shape[-1])
        if bias is not None and not self.takes_bias:
            output = output + bias.to(output.dtype)
        return output


def _defined_at(fn: Callable) -> str:
    """"the function NAME (defined at FILE:LINE)", for a message about what it did."""
    code = getattr(fn, "__code__", None)
    where = f" (defined at {code.co_filename}:{code.co_firstlineno})" if code else ""
    return f"the function {getattr(fn, '__qualname__', fn)!s}{where}"


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

def _fp8_impl(recipe: Recipe) -> Callable[[], Impl]:
    def load() -> Impl:
        # Imported when first loaded, not with this module: fp8_impl imports torch._dynamo, 1.4 s of
        # `python -X importtime -c "import torch; import fp8_impl"` (2-core machine), which the pytest
        # plugin (in every pytest session where fp8-parity is installed), the runner and the check
        # import this module without needing.
        from fp8_impl import Float8Linear, Float8LinearConfig
        name = "fp8_impl" if recipe is DEFAULT_RECIPE else f"fp8_impl:{recipe.name}"
        return Impl(name, Form.MODULE, Float8Linear, recipe=recipe,
                    convert_kwargs=dict(config=Float8LinearConfig.from_recipe_name(recipe.name)))
    return load


def _quiet_import(what: str, load: Callable[[], Any]) -> Any:
    try:
        with quiet_imports():
            return load()
    except Exception as err:  # noqa: BLE001 - any import failure is reported the same way
        raise ImplError(f"{what} does not import: {err!r}; install it with `pip install torchao`") from None


def _torchao_float8_limits(recipe: Recipe) -> Callable[[Any, str], str | None] | None:
    """torchao 0.18's axiswise Float8TrainingTensor cannot clone an N-D input stored transposed."""
    if recipe.gemm("output").a.scaling is not Scaling.AXISWISE:
        return None

    def limits(case, device_type: str) -> str | None:
        if len(case.lead) > 1 and case.input_layout is Layout.TRANSPOSED:
            return ("torchao 0.18 raises on an N-D input stored transposed under axiswise scaling "
                    "(AssertionError: aten.clone.default with axiswise scaling is not supported yet)")
        return None
    return limits


def _torchao_float8(recipe: Recipe) -> Callable[[], Impl]:
    def load() -> Impl:
        float8 = _quiet_import(f"torchao:{recipe.name} needs torchao.float8, which",
                               lambda: importlib.import_module("torchao.float8"))
        return Impl(f"torchao:{recipe.name}", Form.CONVERTER, float8.convert_to_float8_training, recipe=recipe,
                    convert_kwargs=dict(config=float8.Float8LinearConfig.from_recipe_name(recipe.name)),
                    limits=_torchao_float8_limits(recipe))
    return load


def _torchao_blockwise_limits(case, device_type: str) -> str | None:
    if device_type != "cuda":
        return "torchao's blockwise training runs its quantization in Triton kernels: a CUDA GPU only"
    if case.bias or case.input_dtype != "bf16" or case.weight_dtype != "bf16":
        return "torchao's Float8BlockwiseLinear takes bf16 input and weight and no bias"
    if case.weight_layout is not Layout.CONTIGUOUS or (case.input_layout is not Layout.CONTIGUOUS and
                                                       not _copied_by_reshape(case)):
        # measured on an H100 (2026-12-07): a transposed input ended a check in exit 125 after 181 s
        return ("torchao 0.18's Float8BlockwiseLinear raises on a non-contiguous input or weight (its Triton casts "
                "assert 'Input tensor must be contiguous')")
    return None


def _copied_by_reshape(case) -> bool:
    """An N-D input stored transposed, which a layer's reshape to 2-D copies (contiguous) before its casts."""
    return case.input_layout is Layout.TRANSPOSED and len(case.lead) > 1 and math.prod(case.lead[:-1]) > 1


class _TorchaoBlockwiseLinear:
    """torchao.prototype's Float8BlockwiseLinear, imported when first built (it needs Triton, so it
    does not import on a CPU-only machine, where every case is skipped by its limits)."""

    @staticmethod
    def from_float(linear: nn.Linear) -> nn.Module:
        module = _quiet_import("torchao:blockwise needs torchao.prototype.blockwise_fp8_training (and Triton), which",
                               lambda: importlib.import_module("torchao.prototype.blockwise_fp8_training.linear"))
        return module.Float8BlockwiseLinear.from_float(linear)


def _torchao_blockwise(recipe: Recipe) -> Callable[[], Impl]:
    return lambda: Impl(f"torchao:{recipe.name}", Form.MODULE, _TorchaoBlockwiseLinear, recipe=recipe,
                        limits=_torchao_blockwise_limits)


def _reference(recipe: Recipe) -> Callable[[], Impl]:
    return lambda: Impl(recipe.name, Form.MODULE, _IdentityLinear, recipe=recipe)


class _IdentityLinear:
    """nn.Linear itself, in the function-free 'module' form (references)."""

    @staticmethod
    def from_float(linear: nn.Linear) -> nn.Linear:
        return linear


def _emulated(recipe: Recipe) -> Callable[[], Impl]:
    def load() -> Impl:
        return Impl(f"emulated:{recipe.name}", Form.FUNCTION, emulated_matmul(recipe), recipe=recipe, exact=True)
    return load


def _hopper(recipe: Recipe) -> Callable[[], Impl]:
    def load() -> Impl:
        return Impl(f"hopper:{recipe.name}", Form.FUNCTION, hopper_matmul(recipe), recipe=recipe,
                    bit_model=True, limits=_needs_mmaemu)
    return load


def _needs_mmaemu(case, device_type: str) -> str | None:
    return None if hopper.available() else "the Hopper model needs mmaemu (pip install mmaemu==0.1.0)"


def _torchao_fsdp_float8_all_gather() -> Impl:
    impl = _torchao_float8(DEFAULT_RECIPE)()  # tensorwise
    config = dataclasses.replace(impl.convert_kwargs["config"], enable_fsdp_float8_all_gather=True)
    return dataclasses.replace(impl, name=FSDP_FLOAT8_ALL_GATHER, convert_kwargs=dict(config=config))


def _torchao_mx_limits(case, device_type: str) -> str | None:
    """torchao 0.18's MXFP8Linear takes one dtype, bf16 or fp32, and casts its operands as they are stored:
    to_mx asserts contiguity, and only an N-D input stored transposed is copied (by its reshape) first."""
    if case.input_dtype != case.weight_dtype or case.input_dtype not in ("bf16", "fp32"):
        return ("torchao 0.18's MXFP8 layer casts bf16 or fp32 only (to_mx asserts it), and its emulated GEMM "
                "multiplies the input and the weight in one dtype")
    if case.weight_layout is not Layout.CONTIGUOUS or (case.input_layout is not Layout.CONTIGUOUS and
                                                       not _copied_by_reshape(case)):
        return "torchao 0.18's MXFP8 layer raises on a non-contiguous input or weight (AssertionError in to_mx)"
    return None


class _TorchaoMXFP8Linear:
    """torchao 0.18's MXFP8Linear (torchao.prototype.moe_training.mxfp8_linear) in its EMULATED mode, the one
    that runs without SM100: its casts are torch code (to_mx), its GEMMs multiply the dequantized operands
    (MXTensor.dequantize, then mm in the input's dtype). The scale rule is set per recipe (from_float's)."""

    @staticmethod
    def from_float(linear: nn.Linear, *, rule: str) -> nn.Module:
        mxfp8_linear = _quiet_import("torchao:mxfp8 needs torchao.prototype.moe_training.mxfp8_linear, which",
                                     lambda: importlib.import_module("torchao.prototype.moe_training.mxfp8_linear"))
        config = importlib.import_module("torchao.prototype.mx_formats.config")
        preference = importlib.import_module("torchao.quantization.quantize_.common.kernel_preference")
        module = mxfp8_linear.MXFP8Linear(linear.in_features, linear.out_features, bias=linear.bias is not None,
                                          device="meta", kernel_preference=preference.KernelPreference.EMULATED,
                                          scale_calculation_mode=config.ScaleCalculationMode(rule))
        module.weight, module.bias = linear.weight, linear.bias
        return module


def _torchao(recipe: Recipe) -> Callable[[], Impl]:
    """torchao's implementation of a recipe: its MXFP8 layer, its block-scaled prototype, or torchao.float8."""
    if recipe.mx_rule is not None:
        return lambda: Impl(f"torchao:{recipe.name}", Form.MODULE, _TorchaoMXFP8Linear, recipe=recipe,
                            convert_kwargs=dict(rule=recipe.mx_rule), limits=_torchao_mx_limits)
    blocks = any(gemm.kind == "BlockWise" for gemm in recipe.gemms)
    return _torchao_blockwise(recipe) if blocks else _torchao_float8(recipe)


BUILTINS: dict[str, Callable[[], Impl]] = {
    "fp8_impl": _fp8_impl(DEFAULT_RECIPE),
    **{f"fp8_impl:{name}": _fp8_impl(RECIPES[name]) for name in family_recipes("fp8_impl")},
    **{f"torchao:{name}": _torchao(RECIPES[name]) for name in family_recipes("torchao")},
    FSDP_FLOAT8_ALL_GATHER: _torchao_fsdp_float8_all_gather,
    "emulated": _emulated(DEFAULT_RECIPE),
    **{f"emulated:{name}": _emulated(RECIPES[name]) for name in FP8_RECIPES},
    **{f"hopper:{name}": _hopper(RECIPES[name]) for name in family_recipes("hopper")},
    **{name: _reference(recipe) for name, recipe in RECIPES.items() if not recipe.is_fp8},
}
del BUILTINS["fp8_impl:tensorwise"]  # it is "fp8_impl"
# (parity.names.BUILTIN_NAMES lists these keys for the parser, which must not import this module)


def builtin_for_recipe(family: str, recipe: Recipe) -> str | None:
    """The built-in of `family` (fp8_impl, torchao, emulated) implementing `recipe`, if any."""
    name = f"{family}:{recipe.name}"
    if family == "fp8_impl" and recipe is DEFAULT_RECIPE:
        return "fp8_impl"
    return name if name in BUILTINS else None


def recipe_flag(impl: str, recipe: str) -> list[str]:
    """`--recipe RECIPE` for the user's code of a recipe other than the default (a built-in knows its own): what a
    printed command needs to judge the implementation as it was judged."""
    return [] if impl in BUILTINS or recipe == DEFAULT_RECIPE.name else ["--recipe", recipe]


def hopper_reference(candidate: Impl, device_type: str, *, as_reference: bool = False) -> Impl | None:
    """hopper:<recipe> for an FP8 candidate where results are Hopper's bits: on a GPU, or on a CPU under
    --cpu-gemm hopper (whose block-scaled GEMMs are no _scaled_mm calls the model sees); None elsewhere,
    for an oracle itself (unless `as_reference`: may this oracle be a reference here?), or without mmaemu."""
    name = builtin_for_recipe("hopper", candidate.recipe)
    if name is None or (not as_reference and (candidate.exact or candidate.bit_model)) or not hopper.available():
        return None
    block_scaled = any(gemm.kind == "BlockWise" for gemm in candidate.recipe.gemms)
    if device_type == "cuda" or (cpu_gemm.mode() == "hopper" and not block_scaled):
        return load_impl(name)
    return None


def reload_impl(name: str, form: str, recipe: str, reciprocal_scales: bool = False) -> Impl:
    """The implementation of Impl.reload_args, loaded again by name (in a worker or rank process)."""
    impl = load_impl(name, form=None if name in BUILTINS else form, recipe=None if name in BUILTINS else recipe)
    impl.form = Form(form)
    return with_reciprocal_scales(impl) if reciprocal_scales else impl


def with_reciprocal_scales(impl: Impl) -> Impl:
    """The implementation judged as one whose recipe computes scales as fp8_max * (1 / amax) in float32
    (Recipe.reciprocal_scales); an exact emulation becomes that recipe's emulation."""
    recipe = dataclasses.replace(impl.recipe, reciprocal_scales=True)
    if impl.exact:
        return dataclasses.replace(impl, target=emulated_matmul(recipe), recipe=recipe)
    return dataclasses.replace(impl, recipe=recipe)


def default_reference(candidate: Impl, device_type: str) -> Impl:
    """What a candidate is compared with when the user names nothing: its recipe's parity
    reference on this device (torchao's implementation of the recipe), or the recipe's exact
    emulation when that is the candidate itself or there is none; fp64 for a high-precision one."""
    recipe = candidate.recipe
    if not recipe.is_fp8:
        return load_impl("fp64")
    name = recipe.parity_reference.get(device_type)
    if name is None or name == candidate.name:
        name = builtin_for_recipe("emulated", recipe)
    return load_impl(name)


# ---- loading by name ----------------------------------------------------------------------------

def import_target(module_spec: str, attr: str) -> Any:
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
    except SystemExit as err:
        call = str(err.code) if isinstance(err, ProcessExit) else f"sys.exit({err.code!r})"
        raise ImplError(f"importing {module_spec!r} exited the process ({call}): an implementation must not "
                        f"exit at import") from None
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
    said = _form_said_by(positional[0]) if positional else None  # convert(model, skip=None) is a converter
    if said is not None:
        return said
    if len(required) == 2 or (len(required) < 2 <= len(positional)):
        return Form.FUNCTION
    if len(required) == 1:
        return Form.CONVERTER
    raise ImplError(f"{getattr(target, '__name__', target)!r} takes {len(required)} required positional "
                    f"arguments; {FORM_HELP} (or pass --form)")


MODULE_PARAMETER_NAMES = ("model", "module", "mod", "net", "network", "root", "layer", "linear")


def _form_said_by(first: inspect.Parameter) -> Form | None:
    """The form the first parameter's annotation or name says (a module: converter; a tensor:
    function), or None when it says neither."""
    annotation = first.annotation
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", "")
    if inspect.isclass(annotation) and issubclass(annotation, nn.Module) or text.endswith(("Module", "Sequential")):
        return Form.CONVERTER
    if annotation is torch.Tensor or text.endswith("Tensor"):
        return Form.FUNCTION
    return Form.CONVERTER if first.name in MODULE_PARAMETER_NAMES else None


IMPL_PATH_ENV = "FP8_PARITY_IMPL_PATH"  # set by `bisect --git` (parity.history): an implementation's checkout


def _prefer_impl_path() -> None:
    """FP8_PARITY_IMPL_PATH puts an implementation's checkout first on sys.path: in a worker only, where code under
    test runs (in the process that judges, a folder of the path could shadow torchao or the harness itself)."""
    for path in reversed([p for p in os.environ.get(IMPL_PATH_ENV, "").split(os.pathsep) if p]):
        if path not in sys.path:
            sys.path.insert(0, path)


def is_code_under_test(spec: str) -> bool:
    """Whether `spec` names code this process must never import: anything but the harness's built-ins, and
    fp8_impl's built-ins too when FP8_PARITY_IMPL_PATH says they come from another checkout."""
    if spec not in BUILTINS:
        return True
    return spec.split(":")[0] == "fp8_impl" and bool(os.environ.get(IMPL_PATH_ENV))


# A module may import torchao, compile kernels or autotune at import: tens of seconds on a busy 2-core machine.
# One that takes more than this is a finding (a sleep or a spin at import), not a wait without end.
IMPORT_TIME_LIMIT = 120.0


class ImplDied(ImplError):
    """The implementation's worker died or hung while importing it: a finding about the code under test
    (parity.cli: FAIL, exit 1), not bad usage."""


def describe_here(spec: str, form: str | None, recipe: str | None) -> dict:
    """In a worker: the implementation imported and recognized, as plain data (its form), or why it cannot be."""
    from parity.worker import report_phase
    report_phase(spec, Phase.IMPORT.value)
    try:
        impl = load_impl(spec, form=form, recipe=recipe)
    except ImplError as err:
        return dict(error=str(err))
    return dict(form=impl.form.value)


def _described(spec: str, form: Form | str | None, recipe: Recipe | None, time_limit: float | None) -> Impl:
    """The code under test named `spec`, imported and recognized in a fresh worker (parity.worker), described
    here: its name, form and recipe, no code of it."""
    from parity import worker  # (multiprocessing: loaded when code under test is first described)
    with worker.Worker("cpu") as probe:
        described = probe.call(describe_here, spec, None if form is None else Form(form).value,
                               None if recipe is None else recipe.name,
                               time_limit=time_limit or IMPORT_TIME_LIMIT)
    if isinstance(described, worker.Died):
        raise ImplDied(f"{spec}: {described.message.replace(' during importing', ' while importing')}")
    if not isinstance(described, dict) or not isinstance(described.get("error", described.get("form")), str):
        raise ImplDied(f"{spec}: its worker sent back no description ({type(described).__name__}): the code under "
                       f"test tampered with the worker")
    if "error" in described:
        raise ImplError(described["error"])
    try:
        found = Form(described["form"])
    except ValueError:
        raise ImplDied(f"{spec}: its worker named no form ({described['form']!r})") from None
    return Impl(spec, found, None, recipe=recipe or DEFAULT_RECIPE, remote=True)


def load_impl(spec: str, *, form: Form | str | None = None, recipe: str | Recipe | None = None,
              time_limit: float | None = None) -> Impl:
    """The implementation named by `spec` (a built-in, `module:attr` or `file.py:attr`).

    `recipe` (a name of parity.recipes) is what your code claims to implement; for a built-in
    family ("fp8_impl", "emulated") it picks that family's implementation of the recipe, and a
    built-in that implements another recipe is an error.

    Code under test (is_code_under_test) is imported in a worker only, within `time_limit` seconds
    (default IMPORT_TIME_LIMIT): here it is a description (Impl.remote) that parity.runner.execute sends to
    a worker. ImplDied when that worker dies or hangs at the import."""
    from parity.worker import in_worker  # (torch-free; multiprocessing only when first used)
    spec = spec.strip()
    wanted = None if recipe is None else get_recipe(recipe)
    family = spec.split(":")[0]
    if wanted is not None and spec in ("fp8_impl", "emulated"):
        spec = builtin_for_recipe(family, wanted) or spec
    if spec in BUILTINS:
        builtin_recipe = _builtin_recipe(spec)
        if wanted is not None and builtin_recipe is not wanted:
            raise ImplError(f"{spec} implements the {builtin_recipe.name} recipe, not {wanted.name}: drop --recipe, "
                            f"or name {builtin_for_recipe(family, wanted) or 'an implementation of ' + wanted.name}")
    elif ":" not in spec:
        close = difflib.get_close_matches(spec, list(BUILTINS), n=1)
        raise ImplError(f"unknown implementation {spec!r}: {_did_you_mean(close)}name a built-in "
                        f"({', '.join(BUILTINS)}) or 'package.module:attr' or 'path/to/file.py:attr'")
    if in_worker():
        impl = load_here(spec, form=form, recipe=wanted)
    elif is_code_under_test(spec):
        impl = _described(spec, form, wanted or _builtin_recipe(spec), time_limit)
    else:
        impl = BUILTINS[spec]()
    if form is not None:
        impl.form = Form(form)
    return impl


def reload_here(name: str, form: str, recipe: str, reciprocal_scales: bool = False) -> Impl:
    """reload_impl imported in THIS process: for a process that runs code under test and is not a
    parity.worker (a rank of check --distributed)."""
    impl = load_here(name, form=form, recipe=None if name in BUILTINS else get_recipe(recipe))
    return with_reciprocal_scales(impl) if reciprocal_scales else impl


def load_here(spec: str, *, form: Form | str | None = None, recipe: Recipe | None = None) -> Impl:
    """The implementation named by `spec` imported in THIS process, as a worker imports it (FP8_PARITY_IMPL_PATH
    applied): for workers, and for tests of loading itself; never in a process that judges code under test."""
    _prefer_impl_path()
    impl = BUILTINS[spec]() if spec in BUILTINS else _imported(spec, form, recipe)
    if form is not None:
        impl.form = Form(form)
    return impl


def _builtin_recipe(spec: str) -> Recipe | None:
    """The recipe a built-in's name says ("fp8_impl": tensorwise; "torchao:rowwise": rowwise), without loading it."""
    if spec not in BUILTINS:
        return None
    _, _, name = spec.partition(":")
    return RECIPES.get(name) or (DEFAULT_RECIPE if name == "" and spec in ("fp8_impl", "emulated")
                                 else BUILTINS[spec]().recipe)


def _did_you_mean(close: list[str]) -> str:
    return f"did you mean {close[0]!r}? " if close else ""


def _imported(spec: str, form: Form | str | None, wanted: Recipe | None) -> Impl:
    """Code under test, imported here (a worker)."""
    module_spec, _, attr = spec.rpartition(":")
    try:
        target = import_target(module_spec, attr)
    except ImplError as err:
        close = difflib.get_close_matches(spec, list(BUILTINS), n=1)
        if close:  # torchao:tensorwize is more likely a typo of a built-in than an attribute
            raise ImplError(f"unknown implementation {spec!r}: {_did_you_mean(close)}(it is no built-in, and as "
                            f"'module:attr' it does not load: {str(err).split(';')[0]})") from None
        raise
    return Impl(spec, detect_form(target) if form is None else Form(form), target, recipe=wanted or DEFAULT_RECIPE)
