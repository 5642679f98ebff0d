"""parity.names lists, without torch, what the parser offers: here each list is checked against the
module that builds the real thing (the recipes, the built-ins, the enums, the presets), so that the
command line cannot offer a name the harness does not have, or miss one it has."""

from __future__ import annotations

from parity import bench, cpu_gemm, distributed, model, model_configs, names, sweep, train_plan
from parity.impls import BUILTINS, Form
from parity.policy import Policy
from parity.recipes import RECIPES


def test_the_recipes_are_those_of_parity_recipes():
    assert names.FP8_RECIPES == tuple(name for name, recipe in RECIPES.items() if recipe.is_fp8)
    assert names.HIGH_PRECISION_RECIPES == tuple(name for name, recipe in RECIPES.items() if not recipe.is_fp8)


def test_the_builtins_are_the_keys_of_parity_impls_builtins():
    assert names.BUILTIN_NAMES == tuple(BUILTINS)
    assert set(names.BUILTIN_HELP) <= set(BUILTINS)
    families = {name.partition(":")[0] for name in BUILTINS if ":" in name}
    assert families == set(names.BUILTIN_PACKAGES)


def test_the_forms_and_policies_are_the_values_of_their_enums():
    assert names.FORMS == tuple(form.value for form in Form)
    assert names.POLICIES == tuple(policy.value for policy in Policy)


def test_the_modes_are_those_the_modules_accept():
    assert cpu_gemm.MODES == names.CPU_GEMM_MODES and names.CPU_GEMM_MODES[0] == "fast"  # the default
    assert distributed.MODES == names.DISTRIBUTED_MODES


def test_the_presets_are_those_of_sweep_and_bench():
    assert {name: preset.description for name, preset in sweep.PRESETS.items()} == names.SWEEP_PRESET_DESCRIPTIONS
    assert list(sweep.PRESETS) == list(names.SWEEP_PRESET_DESCRIPTIONS)  # the order --help lists them in
    assert all(name == preset.name for name, preset in sweep.PRESETS.items())
    assert {name: preset.description for name, preset in bench.PRESETS.items()} == names.BENCH_PRESET_DESCRIPTIONS
    assert list(bench.PRESETS) == list(names.BENCH_PRESET_DESCRIPTIONS)
    assert {name: len(preset.shapes) for name, preset in bench.PRESETS.items()} == names.BENCH_PRESET_SHAPES


def test_the_defaults_name_builtins():
    for default in (*names.SWEEP_DEFAULT_IMPLS, *names.BENCH_DEFAULT_IMPLS, names.DEFAULT_BASELINE):
        assert default in BUILTINS, default
    assert sweep.DEFAULT_IMPLS == names.SWEEP_DEFAULT_IMPLS and bench.DEFAULT_IMPLS == names.BENCH_DEFAULT_IMPLS
    assert train_plan.DEFAULT_BASELINE == names.DEFAULT_BASELINE and train_plan.LEARNING_RATE == names.LEARNING_RATE


def test_the_models_the_parser_lists_are_those_train_builds():
    assert model.MODELS is model_configs.MODELS and model.GPTConfig is model_configs.GPTConfig
    assert model.FACTORY_PROTOCOL == names.FACTORY_PROTOCOL
