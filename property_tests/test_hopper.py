"""The Hopper model (parity.hopper) and its calibration (parity.calibration, `fp8-parity calibrate`).

On the CPU: the model's epilogues are checked where the answer is known without a GPU (small integer
products and power-of-two scales: every correct accumulation is exact, so a misplaced scale or block
shows), the model is shown not to be an fp32 dot product (Hopper truncates aligned products), and the
calibration's rule and table are read. On an H200: the model equals the hardware bit for bit on a few
configurations of each kind (the full grid is `fp8-parity calibrate`'s).
"""

from __future__ import annotations

import subprocess
import sys
import warnings
from fractions import Fraction

import numpy as np
import pandas as pd
import pytest
import torch

from parity import calibration, hopper
from parity.calibration import CallKind, Config
from parity.pytest_plugin import fp8_gpu_available

pytest.importorskip("mmaemu")
E4 = torch.float8_e4m3fn
warnings.filterwarnings("ignore", module="mmaemu")


def _small_integers(rows: int, cols: int, seed: int) -> torch.Tensor:
    """fp8 values in {-2, ..., 2}: products and K-long sums (K <= 256) are exact in 13 bits."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(-2, 3, (rows, cols), generator=generator).float().to(E4)


def _pow2(shape, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return 2.0 ** torch.randint(-4, 5, shape, generator=generator).float()


def test_tensorwise_and_rowwise_epilogues_are_exact_where_every_accumulation_is():
    a, b = _small_integers(32, 64, 0), _small_integers(48, 64, 1)
    exact = a.double() @ b.double().t()
    one = torch.tensor(0.5)
    tensorwise = hopper.tensorwise(a, b, one, torch.tensor(4.0), out_dtype=torch.float32, fast_accum=True)
    assert torch.equal(tensorwise.value.double(), exact * 2.0)
    rows, cols = _pow2((32, 1), 2), _pow2((1, 48), 3)
    rowwise = hopper.rowwise(a, b, rows, cols, out_dtype=torch.float32, fast_accum=False)
    assert torch.equal(rowwise.value.double(), exact * rows.double() * cols.double())


@pytest.mark.parametrize("b_tiles", ["128x128", "1x128"])
def test_blockwise_scales_each_128_long_block_with_its_own_scales(b_tiles):
    M, K, N = 16, 384, 160
    a, b = _small_integers(M, K, 4), _small_integers(N, K, 5)
    scale_a = _pow2((M, K // 128), 6)
    scale_b = _pow2((2, K // 128), 7) if b_tiles == "128x128" else _pow2((N, K // 128), 7)
    per_row_of_b = scale_b.repeat_interleave(128, dim=0)[:N] if b_tiles == "128x128" else scale_b
    exact = sum((a[:, k:k + 128].double() @ b[:, k:k + 128].double().t()) * scale_a[:, i:i + 1].double()
                * per_row_of_b[:, i].double()[None, :] for i, k in enumerate(range(0, K, 128)))
    got = hopper.blockwise(a, b, scale_a, scale_b, out_dtype=torch.float32, b_tiles=b_tiles)
    assert torch.equal(got.value.double(), exact)


def _nearest_fp32(exact: Fraction) -> float:
    """The fp32 nearest to `exact`, ties to an even significand (from the two fp32 neighbours of its float64)."""
    guess = np.float32(float(exact))
    candidates = {guess, np.nextafter(guess, np.float32(np.inf)), np.nextafter(guess, np.float32(-np.inf))}
    def distance(value):
        return abs(Fraction(float(value)) - exact), int(np.array(value).view(np.int32)) & 1
    return float(min(candidates, key=distance))


def test_fma32_rounds_once_as_a_fused_multiply_add():
    generator = torch.Generator().manual_seed(8)
    a, b, c = (torch.randn(2000, generator=generator) * 2.0 ** torch.randint(-20, 20, (2000,), generator=generator)
               for _ in range(3))
    # products whose low bits sit at a tie of fp32 and a tiny c that breaks it: a double rounding goes wrong
    a[:4] = torch.tensor([1 + 2.0 ** -12, 1 + 2.0 ** -12, 1 - 2.0 ** -24, 3.0])
    b[:4] = torch.tensor([1 + 2.0 ** -12, 1 + 2.0 ** -12, 1 + 2.0 ** -23, 1 + 2.0 ** -23])
    c[:4] = torch.tensor([2.0 ** -60, -2.0 ** -60, 2.0 ** -80, -2.0 ** -75])
    got = hopper.fma32(a, b, c)
    for x, y, z, r in zip(a.tolist(), b.tolist(), c.tolist(), got.tolist()):
        assert r == _nearest_fp32(Fraction(x) * Fraction(y) + Fraction(z)), (x, y, z)
    plain = (a.double() * b.double() + c.double()).float()  # rounded twice: wrong at the ties
    assert not torch.equal(plain[:4], got[:4])


def test_the_model_truncates_aligned_products_where_fp32_keeps_them():
    """1 + 31 products of 2^-18: fp32 holds 1 + 31 * 2^-18 exactly; Hopper aligns each product to the
    largest exponent of its block and keeps about 13 fraction bits, so the small ones vanish (Fasi et al. 2021)."""
    K = 32
    a = torch.full((16, K), 2.0 ** -9).to(E4)
    a[:, 0] = 1.0
    one = torch.tensor(1.0)
    for fast in (True, False):
        got = hopper.tensorwise(a, a, one, one, out_dtype=torch.float32, fast_accum=fast).value
        assert got[0, 0].item() == 1.0
    assert (a.double() @ a.double().t())[0, 0].item() == 1 + (K - 1) * 2.0 ** -18


@pytest.mark.parametrize(("call", "message"), [
    (lambda a: hopper.tensorwise(a.float(), a, torch.tensor(1.0), torch.tensor(1.0), out_dtype=torch.bfloat16,
                                 fast_accum=True), "must be float8_e4m3fn or float8_e5m2"),
    (lambda a: hopper.rowwise(a, a, torch.ones(3, 1), torch.ones(1, 16), out_dtype=torch.bfloat16, fast_accum=True),
     "M = 16 A scales and N = 16 B scales, got 3 and 16"),
    (lambda a: hopper.tensorwise(a, a, torch.ones(16, 1), torch.tensor(1.0), out_dtype=torch.bfloat16,
                                 fast_accum=True), "one scale per operand"),
    (lambda a: hopper.blockwise(a, a, torch.ones(16, 1), torch.ones(16, 1), out_dtype=torch.bfloat16,
                                b_tiles="1x128"), "needs K a multiple of 128, got K = 32"),
    (lambda a: hopper.accumulator(a, a[:, :16], fast_accum=True), "A [16, 32] and B [16, 16]"),
])
def test_a_call_the_model_does_not_cover_says_what_is_wrong(call, message):
    with pytest.raises(hopper.HopperModelError, match=message.replace("[", r"\[").replace("]", r"\]")):
        call(torch.ones(16, 32).to(E4))


# ---- calibration ------------------------------------------------------------------------------------


def test_the_grid_covers_every_kind_with_aligned_shapes_and_stable_ids():
    grid = calibration.grid()
    assert len(grid) >= 500  # issue 27: a table of at least 500 configurations
    assert len({config.id for config in grid}) == len(grid)
    assert {config.kind for config in grid} == set(CallKind)
    assert all(side % 16 == 0 for config in grid for side in (config.m, config.k, config.n))
    assert all(side % 128 == 0 for config in grid if config.kind is CallKind.BLOCKWISE
               for side in (config.m, config.k, config.n))
    assert Config(CallKind.TENSORWISE, "e4m3", "e4m3", "bfloat16", True, 16, 32, 48).id == \
        "tw-e4m3xe4m3-bfloat16-fast-16x32x48"


def _table(*rows) -> pd.DataFrame:
    records = []
    for (m, k, n), bitwise in rows:
        config = Config(CallKind.TENSORWISE, "e4m3", "e4m3", "bfloat16", True, m, k, n)
        records.append(dict(id=config.id, kind="TensorWise", a="e4m3", b="e4m3", out="bfloat16", fast_accum=True,
                            m=m, k=k, n=n, b_tiles="", bitwise=bitwise, equal_fraction=1.0 if bitwise else 0.72))
    return pd.DataFrame.from_records(records)


def _call(m, k, n, **changes):
    return Config(**{**dict(kind=CallKind.TENSORWISE, a="e4m3", b="e4m3", out="bfloat16", fast_accum=True,
                            m=m, k=k, n=n), **changes})


def test_exactness_is_claimed_only_where_the_table_vouches_for_it():
    table = _table(((64, 256, 64), True), ((1024, 4096, 1024), True), ((256, 8192, 256), False))
    assert calibration.exactness(_call(128, 512, 96), table).exact
    beyond = calibration.exactness(_call(1024, 16384, 1024), table)
    assert not beyond.exact and "beyond the calibrated K (bit-equal at most at K = 4096)" in beyond.why
    split = calibration.exactness(_call(128, 8192, 128), table)  # longer K, smaller output than a differing config
    assert not split.exact and "differed (72% equal)" in split.why
    assert calibration.exactness(_call(1024, 4096, 1024), table).exact
    other = calibration.exactness(_call(64, 256, 64, fast_accum=False), table)
    assert not other.exact and "fast accumulation off" in other.why
    assert "not calibrated" in calibration.exactness(_call(64, 256, 64), None).why


def test_calibrate_without_a_gpu_says_it_cannot_run_here():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: calibrate would run")
    done = subprocess.run([sys.executable, "-m", "parity", "calibrate"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 125
    assert done.stderr.strip().splitlines()[-1] == ("fp8-parity calibrate: cannot run here: no CUDA device is "
                                                    "available: calibrate measures a GPU's FP8 GEMMs against the "
                                                    "Hopper model")


def test_the_committed_h200_table_is_complete_and_says_where_the_model_is_exact():
    table = calibration.load_table("NVIDIA H200")
    assert table is not None and len(table) == len(calibration.grid()) >= 500
    grid = len(calibration.grid())
    header = calibration.table_path("NVIDIA H200").read_text().splitlines()[3]
    assert f"measured {grid} of {grid} configurations" in header
    assert set(table["kind"]) == {kind.value for kind in CallKind}
    assert table["bitwise"].mean() >= 0.95
    split = Config(CallKind.TENSORWISE, "e4m3", "e4m3", "bfloat16", True, 128, 8192, 128)
    assert not calibration.exactness(split, table).exact  # 256x8192x256 with fast accumulation differed there
    check_sized = Config(CallKind.ROWWISE, "e4m3", "e4m3", "bfloat16", True, 112, 208, 64)
    assert calibration.exactness(check_sized, table).exact


def test_a_gpu_without_a_table_is_not_calibrated():
    assert calibration.load_table("A GPU nobody calibrated") is None
    assert calibration.gpu_slug("NVIDIA H200") == "nvidia-h200"


# ---- on the GPU -------------------------------------------------------------------------------------

GPU_CONFIGS = [
    Config(CallKind.TENSORWISE, "e4m3", "e4m3", "bfloat16", True, 64, 256, 96),
    Config(CallKind.TENSORWISE, "e5m2", "e4m3", "float32", False, 128, 1536, 320),
    Config(CallKind.ROWWISE, "e4m3", "e4m3", "bfloat16", True, 256, 512, 256),
    Config(CallKind.BLOCKWISE, "e4m3", "e4m3", "bfloat16", False, 128, 384, 256, "128x128"),
    Config(CallKind.BLOCKWISE, "e4m3", "e4m3", "bfloat16", False, 256, 1152, 384, "1x128"),
]


@pytest.mark.fp8_gpu
@pytest.mark.skipif(not fp8_gpu_available(), reason="needs an FP8 GPU")
@pytest.mark.parametrize("config", GPU_CONFIGS, ids=lambda config: config.id)
def test_the_model_computes_the_gpus_bits(config):
    row = calibration.measure(config, "cuda")
    assert not row["error"], row["error"]
    assert row["bitwise"], f"{config.id}: {row['equal_fraction']:.2%} of the elements bit-equal"


# ---- the exact oracle (hopper:<recipe>) and the CPU that computes the H200's bits ----------------------------


@pytest.fixture
def cpu_gemm_hopper(monkeypatch):
    """--cpu-gemm hopper for one test: every CPU scaled GEMM call through the model."""
    from parity.cpu_gemm import ENV
    monkeypatch.setenv(ENV, "hopper")


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
def test_with_the_cpu_computing_hoppers_bits_fp8_impl_is_the_model_bit_for_bit(recipe, cpu_gemm_hopper):
    from parity.check import CheckPlan, exact_line, run_check
    from parity.impls import load_impl
    plan = CheckPlan.make(load_impl("fp8_impl", recipe=recipe), device="cpu")
    assert f"hopper:{recipe}" in [c.reference.name for c in plan.comparisons]
    result = run_check(plan, device="cpu", max_examples=8, seed=1)
    assert result.verdict == "pass", [v.message for v in result.violations]
    judged = [row for row in result.rows if row.reference == f"hopper:{recipe}" and row.exact]
    assert judged and all(row.bitwise for row in judged)
    assert exact_line(result.rows, plan).startswith(f"exact: judged bit for bit against hopper:{recipe}")


def test_with_the_cpu_computing_hoppers_bits_fast_accumulation_shows_in_the_numbers(cpu_gemm_hopper):
    """A zoo mutant that asks for fast accumulation in grad_input (inner dim N = 512; within 128 products the two
    modes agree): a CPU's own kernel ignores the flag (only the recorded call shows it); through the model the
    numbers differ from the H200's."""
    from parity.cases import parse_case_id
    from parity.check import CheckPlan, run_check
    from parity.impls import load_impl
    from parity.vocabulary import Cause, Kind
    plan = CheckPlan.make(load_impl("evals/zoo/mutants.py:grad_input_fast_accum"), device="cpu")
    result = run_check(plan, device="cpu", cases=[parse_case_id("M64K128N512|normal|seed3")])  # inner N: 512
    exact = [v for v in result.violations if v.kind is Kind.EXACT]
    assert [v.tensor for v in exact] == ["grad_input"], [v.message for v in result.violations]
    # and the recorded flag is not "ignored by a CPU" here: this CPU's numbers show it
    assert not any(v.cause is Cause.FLAG_IGNORED_ON_CPU for v in result.violations)


def test_without_the_model_the_cpu_is_not_judged_bit_for_bit(monkeypatch):
    from parity.check import CheckPlan
    from parity.cpu_gemm import ENV
    from parity.impls import load_impl
    monkeypatch.delenv(ENV, raising=False)
    plan = CheckPlan.make(load_impl("fp8_impl"), device="cpu")
    assert not any(c.reference.bit_model for c in plan.comparisons)


def test_a_worker_computes_with_its_parents_cpu_gemm(monkeypatch):
    from parity import cpu_gemm
    from parity.worker import Worker
    runner = Worker("cpu")
    try:
        for value in ("hopper", "torch"):
            monkeypatch.setenv(cpu_gemm.ENV, value)
            assert runner.call(cpu_gemm.mode, time_limit=60) == value
    finally:
        runner.close()


def test_the_oracle_of_a_blockwise_recipe_is_not_judged_bit_for_bit_on_a_cpu(cpu_gemm_hopper):
    from parity.hopper_oracle import exactness_of
    from parity.recipes import RECIPES
    judged = exactness_of(RECIPES["blockwise"], "output", 128, 256, 128, torch.bfloat16, torch.device("cpu"))
    assert not judged.exact and "no block-scaled _scaled_mm" in judged.why
    tensorwise = exactness_of(RECIPES["tensorwise"], "output", 64, 128, 96, torch.bfloat16, torch.device("cpu"))
    assert tensorwise.exact, tensorwise.why


def test_the_cpus_hopper_kernel_serves_both_scaled_mm_ops_alike():
    """torch._scaled_mm (aten._scaled_mm) and torch.nn.functional.scaled_mm (aten._scaled_mm_v2) of the same
    operands give the model's bits under --cpu-gemm hopper: implementations written either way run one kernel."""
    import torch.nn.functional as F

    from parity.cpu_gemm import HopperScaledMM
    a, b = _small_integers(32, 256, 9).float().mul(3.5).to(E4), (torch.randn(48, 256) * 20).to(E4)
    scale_a, scale_b = torch.tensor(0.37), torch.tensor(0.011)
    want = hopper.tensorwise(a, b, scale_a, scale_b, out_dtype=torch.bfloat16, fast_accum=True).value
    with HopperScaledMM():
        v1 = torch._scaled_mm(a, b.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16,
                              use_fast_accum=True)
        v2 = F.scaled_mm(a, b.t(), scale_a, F.ScalingType.TensorWise, scale_b, F.ScalingType.TensorWise,
                         output_dtype=torch.bfloat16, use_fast_accum=True)
    assert torch.equal(v1.view(torch.int16), want.view(torch.int16))
    assert torch.equal(v2.view(torch.int16), want.view(torch.int16))


def test_a_small_case_computed_on_the_gpu_is_judged_by_the_gpus_table_though_compared_on_the_host(monkeypatch):
    """Small cases' results are compared on the host (parity.runner._move_to_host): the row is still the GPU's."""
    from parity import runner
    from parity.cases import parse_case_id
    from parity.data import make_data
    from parity.recipes import RECIPES
    from parity.rows import Row
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    case = parse_case_id("M64K128N96|normal|seed0")
    row = Row(case_id=case.id, **case.as_record(), impl="fp8_impl", reference="hopper:tensorwise",
              recipe="tensorwise", reference_recipe="tensorwise", policy="exact", device="cuda", tensor="output",
              step=0)
    runner._exactness(row, make_data(case, "cpu"), RECIPES["tensorwise"], "cuda")
    assert row.exact is True, row.exact_why


def test_a_sweeps_verdict_says_how_much_was_judged_bit_for_bit_and_survives_its_results_file(cpu_gemm_hopper,
                                                                                            tmp_path, monkeypatch):
    from parity import calibration
    from parity.cases import parse_case_id
    # a table without fp16 outputs (as the H200's was before 2026-12-02): what the verdict says of the rest
    full = calibration.load_table("NVIDIA H200")
    monkeypatch.setattr(calibration, "table_for", lambda name: full[full["out"] != "float16"])
    from parity.impls import load_impl
    from parity.report_verdict import verdict
    from parity.runner import run_cases
    from parity.sweep import sweep_comparisons
    cases = [parse_case_id("M64K128N96|normal|seed0"), parse_case_id("M32K64N48|in:fp16:C|w:bf16:C|go:C|normal|seed1")]
    comparisons = sweep_comparisons([load_impl("fp8_impl")], "cpu")
    assert "hopper:tensorwise" in [c.reference.name for c in comparisons]
    frame = run_cases(cases, comparisons, device="cpu")
    said = verdict(frame, candidate="fp8_impl")
    assert said.ok, said.headline
    # bf16 case: its three GEMMs; fp16 case: not calibrated in this table (fp16 out), left to the bound with the reason
    assert "bitwise equal to hopper:tensorwise, the GPU's own bits, in 3/6 FP8-GEMM comparisons" in said.headline
    assert "-> float16" in said.headline
    path = tmp_path / "results.csv"
    frame.to_csv(path, index=False)
    again = verdict(pd.read_csv(path), candidate="fp8_impl")
    assert again.headline == said.headline


def test_the_hopper_oracle_as_the_reference_where_results_are_not_hoppers_bits_is_a_usage_error(monkeypatch):
    """Against hopper:R a CPU's own kernel would be judged nowhere bit for bit: a PASS that judged nothing."""
    from parity.cpu_gemm import ENV
    monkeypatch.delenv(ENV, raising=False)
    done = subprocess.run([sys.executable, "-m", "parity", "check", "--impl", "fp8_impl", "--against",
                           "hopper:tensorwise", "--device", "cpu"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "judges Hopper's bits, and results on cpu are not" in done.stderr


SCALE_RESULT_LAYER = '''
import torch

def matmul(input_2d, weight):
    """Asks _scaled_mm for a scale_result, which the Hopper model does not compute."""
    fp8 = torch.float8_e4m3fn
    one = torch.ones((), dtype=torch.float32)
    x, w = input_2d.to(fp8), weight.to(fp8)
    return torch._scaled_mm(x, w.t(), scale_a=one, scale_b=one, scale_result=one, out_dtype=input_2d.dtype)
'''


def test_a_call_the_model_does_not_compute_is_not_judged_not_a_crash_of_the_candidate(cpu_gemm_hopper, tmp_path):
    """Under --cpu-gemm hopper a call the model refuses (scale_result) leaves the case unjudged, with why:
    what the GPU would compute there is unknown here, so it is no finding against the implementation."""
    from parity.cases import parse_case_id
    from parity.impls import load_impl
    from parity.runner import all_pairs, isolation, run_case_isolated
    path = tmp_path / "scale_result.py"
    path.write_text(SCALE_RESULT_LAYER)
    comparisons = all_pairs([load_impl(f"{path}:matmul")], [load_impl("hopper:tensorwise")])
    with isolation(comparisons, "cpu") as runner:  # code under test: in a worker, under the same CPU kernel
        rows = run_case_isolated(parse_case_id("M16K16N16|normal|seed0"), comparisons, runner=runner)
    assert rows and all(row.error is None for row in rows), [row.error for row in rows]
    assert all("scale_result is not modelled" in row.skipped and "cannot be judged" in row.skipped for row in rows)


# ---- bisect's result stage: a GEMM's bits computed again (parity.exact_reproduction) ------------------------

@pytest.mark.parametrize("kernel", ["fast", "hopper"])
@pytest.mark.parametrize("impl", ["fp8_impl", "torchao:rowwise", "fp8_impl:rowwise_with_gw_hp"])
def test_a_gemms_bits_computed_again_are_those_the_kernel_gave_the_implementation(kernel, impl, monkeypatch):
    """What bisect's result stage claims to know bit for bit: each FP8 GEMM of a correct implementation, its call
    computed again from the oracle's operands by the kernel that ran it (the CPU's fast kernel, or the Hopper
    model under --cpu-gemm hopper), then the recipe's roundings and the bias, is that implementation's result in
    every bit (fp32 input with a bias; the rowwise recipes' unit-scale GEMMs included)."""
    from parity.cases import Case
    from parity.cpu_gemm import ENV
    from parity.data import make_data
    from parity.diagnose import _equal_through
    from parity.exact_reproduction import Kernel, call_out_dtype, gemm_bits
    from parity.impls import load_impl
    from parity.runner import emulated_steps_of, execute
    monkeypatch.setenv(ENV, kernel)
    candidate = load_impl(impl)
    for case in (Case(lead=(32,), K=64, N=48, input_dtype="fp32", bias=True), Case(lead=(2, 16), K=48, N=32)):
        data = make_data(case)
        execution = execute(candidate, data, record=True, keep_data=True)
        emulated = emulated_steps_of(data, candidate.recipe)[0]
        for gemm in (spec.name for spec in candidate.recipe.gemms if not spec.high_precision):
            bits = gemm_bits(candidate.recipe, gemm, emulated.operands[gemm],
                             call_out_dtype(execution.calls, 0, gemm), torch.device("cpu"))
            assert bits.kernel is (Kernel.CPU_FAST if kernel == "fast" else Kernel.CPU_HOPPER)
            got = execution.steps[0][gemm]
            assert _equal_through(got, bits, None, case, gemm, candidate.recipe,
                                  data.bias if gemm == "output" else None) == got.numel(), (case.id, gemm)


def _calibrated_gpu() -> bool:
    from parity.calibration import table_for
    return fp8_gpu_available() and table_for(torch.cuda.get_device_name(0)) is not None


@pytest.mark.fp8_gpu
@pytest.mark.skipif(not _calibrated_gpu(), reason="needs an FP8 GPU with a committed calibration table (an H200 or an H100 80GB HBM3)")
@pytest.mark.parametrize("impl", ["fp8_impl", "torchao:rowwise", "fp8_impl:blockwise"])
def test_on_a_calibrated_gpu_a_gemms_bits_computed_again_are_the_gpus(impl):
    """The claim on a GPU: where the calibration vouches for a GEMM's call, the Hopper model on the oracle's
    operands, then the recipe's roundings and the bias, is a correct implementation's result in every bit."""
    from parity.cases import Case
    from parity.data import make_data
    from parity.diagnose import _equal_through
    from parity.exact_reproduction import Kernel, call_out_dtype, gemm_bits
    from parity.impls import load_impl
    from parity.runner import emulated_steps_of, execute
    candidate = load_impl(impl)
    device = torch.device("cuda")
    vouched = 0
    for case in (Case(lead=(256,), K=512, N=384, input_dtype="fp32"), Case(lead=(2, 128), K=256, N=128)):
        if candidate.unsupported(case, "cuda"):
            continue
        data = make_data(case, device)
        execution = execute(candidate, data, record=True, keep_data=True)
        emulated = emulated_steps_of(data.on_host(), candidate.recipe)[0]
        for gemm in (spec.name for spec in candidate.recipe.gemms if not spec.high_precision):
            out_dtype = call_out_dtype(execution.calls, 0, gemm)
            bits = None if out_dtype is None else gemm_bits(candidate.recipe, gemm, emulated.operands[gemm],
                                                            out_dtype, device)
            if bits is None:
                continue
            vouched += 1
            assert bits.kernel is Kernel.HOPPER_MODEL
            got = execution.steps[0][gemm]
            assert _equal_through(got, bits, None, case, gemm, candidate.recipe, None) == got.numel(), (case.id, gemm)
    assert vouched, "no GEMM's call was vouched for by the calibration"


def test_a_gemms_bits_are_not_claimed_where_no_known_kernel_computed_them(monkeypatch):
    """torch's own CPU kernel (its sums follow the operands' strides), a block-scaled GEMM on a CPU, a
    high-precision GEMM, and on a GPU a call the calibration does not vouch for: no bits, no exact claim."""
    from parity.cpu_gemm import ENV
    from parity.exact_reproduction import gemm_bits
    from parity.hopper_oracle import call_exactness
    from parity.oracles import quantize
    from parity.recipes import RECIPES
    generator = torch.Generator().manual_seed(0)
    a_hp, b_hp = torch.randn(128, 256, generator=generator), torch.randn(128, 256, generator=generator)
    def operands(recipe, gemm="output"):
        spec = RECIPES[recipe].gemm(gemm)
        return quantize(a_hp, spec.a), quantize(b_hp, spec.b)
    cpu = torch.device("cpu")
    monkeypatch.setenv(ENV, "torch")
    assert gemm_bits(RECIPES["tensorwise"], "output", operands("tensorwise"), torch.bfloat16, cpu) is None
    for kernel in ("fast", "hopper"):
        monkeypatch.setenv(ENV, kernel)
        assert gemm_bits(RECIPES["tensorwise"], "output", operands("tensorwise"), torch.bfloat16, cpu) is not None
        assert gemm_bits(RECIPES["blockwise"], "output", operands("blockwise"), torch.bfloat16, cpu) is None
        assert gemm_bits(RECIPES["rowwise_with_gw_hp"], "grad_weight", operands("tensorwise"), torch.bfloat16,
                         cpu) is None
    # a GPU: the calibration of the GPU decides, for the dtype the call writes
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    cuda = torch.device("cuda")
    assert call_exactness(RECIPES["tensorwise"], "output", 64, 128, 96, torch.bfloat16, cuda).exact
    rowwise_fp32 = call_exactness(RECIPES["rowwise"], "output", 64, 128, 96, torch.float32, cuda)
    assert not rowwise_fp32.exact and "no calibrated RowWise call" in rowwise_fp32.why
    assert gemm_bits(RECIPES["rowwise"], "output", operands("rowwise"), torch.float32, cuda) is None
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    assert not call_exactness(RECIPES["tensorwise"], "output", 64, 128, 96, torch.bfloat16, cuda).exact


def test_through_the_model_a_rounding_that_reproduces_every_bit_wins_over_a_bias_that_comes_near(
        cpu_gemm_hopper, tmp_path, code_under_test_in_a_worker):
    """--cpu-gemm hopper: the output rounded through bf16 before the bias (fp32 input, K = 1024). Against the
    float64 result "the bias added twice" comes within MATCH_DB first (the space tries it before a second
    rounding); through the Hopper model, which computed the call, the rounding reproduces every bit."""
    from parity.cases import Case
    from parity.data import make_data
    from parity.diagnose import gemm_inverse_scales, read_result
    from parity.exact_reproduction import Kernel, call_out_dtype, gemm_bits
    from parity.impls import load_impl
    from parity.runner import emulated_steps_of, execute
    path = tmp_path / "through_bf16.py"
    path.write_text("import torch\nfrom fp8_impl import float8_matmul\n\n\ndef output_through_bf16(input_2d, weight):\n"
                    "    return float8_matmul(input_2d, weight).to(torch.bfloat16).to(input_2d.dtype)\n")
    case = Case(lead=(32,), K=1024, N=16, input_dtype="fp32", bias=True)
    data, candidate = make_data(case), load_impl(f"{path}:output_through_bf16")
    execution = execute(candidate, data, record=True, keep_data=True)
    emulated, recipe = emulated_steps_of(data, candidate.recipe)[0], candidate.recipe
    read = dict(got=execution.steps[0]["output"], exact=emulated.output, case=case, tensor="output", recipe=recipe,
                bias=data.bias, scales=gemm_inverse_scales(data.steps[0], "output", recipe))
    assert read_result(**read).explanation.description == "the bias added twice"
    bits = gemm_bits(recipe, "output", emulated.operands["output"], call_out_dtype(execution.calls, 0, "output"),
                     torch.device("cpu"))
    named = read_result(**read, bits=bits).explanation
    assert named.description.startswith("the result rounded through bfloat16") and named.category == "accumulation"
    assert named.reproduced.whole and named.reproduced.elements == 512 and named.reproduced.kernel is Kernel.CPU_HOPPER
