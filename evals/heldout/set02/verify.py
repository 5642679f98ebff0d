"""Standalone check of the held-out set `property_tests/heldout2` (CPU).

Imports neither `parity` nor `fp8_impl`. For every manifest entry it runs the implementation and
this set's correct implementation of the same recipe, in the same plug-in form, on
  * a plain case (2-D bf16 input, bf16 weight, contiguous, no bias, Gaussian data, one call) and
  * a case that satisfies the entry's trigger tokens,
and prints which of output / grad_input / grad_weight differ (bitwise; for the output also
dtype, shape and strides) or whether the implementation raised. It checks the manifest's
"gemm" field: the first differing GEMM (order output, grad_input, grad_weight) of the trigger
case must be the declared one, and for an entry with a trigger the plain case should be clean.
Entries observable only on CUDA ("gpu only") are listed and not executed.

Before that, the correct tensorwise / rowwise / rowwise_with_gw_hp implementations are compared
with torchao 0.18's Float8Linear (convert_to_float8_training with
Float8LinearConfig.from_recipe_name) on a few small cases: output, grad_input and grad_weight
must be bitwise equal.

    python property_tests/heldout2/verify.py            # everything
    python property_tests/heldout2/verify.py NAME ...   # only these manifest entries
Exit status 0 when every check passes.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import sys
import traceback
from pathlib import Path

import torch
from torch import nn

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
GEMMS = ("output", "grad_input", "grad_weight")
CORRECT = {
    "tensorwise": "correct_tensorwise.py",
    "rowwise": "correct_rowwise.py",
    "rowwise_with_gw_hp": "correct_rowwise_with_gw_hp.py",
    "blockwise": "correct_blockwise.py",
}
FORM_ATTR = {"function": "fp8_linear", "module": None, "converter": "convert"}
MODULE_ATTR = {
    "tensorwise": "TensorwiseFp8Linear",
    "rowwise": "RowwiseFp8Linear",
    "rowwise_with_gw_hp": "RowwiseGwHpFp8Linear",
    "blockwise": "BlockwiseFp8Linear",
}
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


# --------------------------------------------------------------------------- loading
_loaded: dict = {}


def load_attr(spec: str):
    """`path/to/file.py:attr` (relative to the repository root) -> object."""
    path, attr = spec.rsplit(":", 1)
    full = (REPO / path).resolve()
    if full not in _loaded:
        name = "heldout2_" + full.stem
        mod_spec = importlib.util.spec_from_file_location(name, full)
        mod = importlib.util.module_from_spec(mod_spec)
        sys.modules[name] = mod
        mod_spec.loader.exec_module(mod)
        _loaded[full] = mod
    return getattr(_loaded[full], attr)


def correct_spec(recipe: str, form: str) -> str:
    attr = FORM_ATTR[form] or MODULE_ATTR[recipe]
    return f"property_tests/heldout2/{CORRECT[recipe]}:{attr}"


# --------------------------------------------------------------------------- cases
@dataclasses.dataclass(frozen=True)
class Case:
    lead: tuple = (64,)            # leading dims of the input; M = prod(lead)
    K: int = 96
    N: int = 48
    x_dtype: str = "bf16"
    w_dtype: str = "bf16"
    x_layout: str = "contig"       # contig | transposed | sliced
    w_layout: str = "contig"       # contig | transposed
    go_layout: str = "contig"      # contig | transposed
    bias: bool = False
    data: str = "gauss"            # gauss zeros nearmax tiny outlier zero_rows outlier_row
    second_call: bool = False
    seed: int = 0

    @property
    def M(self):
        m = 1
        for d in self.lead:
            m *= d
        return m

    def label(self):
        parts = [f"{'x'.join(map(str, self.lead))}x{self.K}x{self.N}", f"x:{self.x_dtype}",
                 f"w:{self.w_dtype}"]
        for name, v in (("x", self.x_layout), ("w", self.w_layout), ("go", self.go_layout)):
            if v != "contig":
                parts.append(f"{name}:{v}")
        if self.bias:
            parts.append("bias")
        if self.data != "gauss":
            parts.append(f"data:{self.data}")
        if self.second_call:
            parts.append("second-call")
        return " ".join(parts)


def plain_case(recipe: str) -> Case:
    if recipe == "blockwise":
        return Case(lead=(128,), K=256, N=128)
    return Case()


def trigger_case(recipe: str, trigger: list) -> Case:
    c = plain_case(recipe)
    kw = {}
    for tok in trigger:
        if tok == "non-contiguous input":
            kw["x_layout"] = "transposed"
        elif tok == "non-contiguous weight":
            kw["w_layout"] = "transposed"
        elif tok == "non-contiguous grad_output":
            kw["go_layout"] = "transposed"
        elif tok == "K == N":
            kw["N"] = c.K
        elif tok == "N-D input":
            kw["lead"] = (2, c.M // 2)
        elif tok == "fp32 input":
            kw["x_dtype"] = "fp32"
        elif tok == "fp16 input":
            kw["x_dtype"] = "fp16"
        elif tok == "fp32 weight":
            kw["w_dtype"] = "fp32"
        elif tok == "second call":
            kw["second_call"] = True
        elif tok == "bias":
            kw["bias"] = True
        elif tok.startswith("data:"):
            kw["data"] = tok[5:]
        elif tok == "gpu only":
            pass
        else:
            raise ValueError(f"unknown trigger token {tok!r}")
    return dataclasses.replace(c, **kw)


def _values(case: Case):
    """fp32 master values for weight, bias, input, grad_output, weight update (deterministic)."""
    g = torch.Generator().manual_seed(1234 + case.seed)
    M, K, N = case.M, case.K, case.N
    w = torch.randn(N, K, generator=g) * K ** -0.5
    b = torch.randn(N, generator=g) * 0.1
    x = torch.randn(M, K, generator=g)
    if case.data == "zeros":
        x = torch.zeros(M, K)
    elif case.data == "nearmax":
        sign = torch.where(torch.rand(M, K, generator=g) < 0.5, -1.0, 1.0)
        x = sign * (400.0 + 48.0 * torch.rand(M, K, generator=g))
    elif case.data == "tiny":
        sign = torch.where(torch.rand(M, K, generator=g) < 0.5, -1.0, 1.0)
        x = sign * torch.exp2(-30.0 + 20.0 * torch.rand(M, K, generator=g))
    elif case.data == "outlier":
        x[:, K // 3] *= 100.0
    elif case.data == "zero_rows":
        x[1::5] = 0.0
        x[:, 2::7] = 0.0
    elif case.data == "outlier_row":
        x[M // 2] *= 1e4
    go = torch.randn(M, N, generator=g)
    dw = torch.randn(N, K, generator=g) * K ** -0.5 * 0.5
    return w, b, x, go, dw


def _layout(t2d: torch.Tensor, layout: str, lead: tuple) -> torch.Tensor:
    """Same logical values, chosen storage. t2d is [M, C]; the result has shape lead + [C]."""
    C = t2d.shape[-1]
    t = t2d.reshape(*lead, C)
    if layout == "contig":
        return t.contiguous()
    if layout == "transposed":
        if t.dim() == 2:
            return t.t().contiguous().t()
        # sequence-first storage of a [B, S, C] tensor
        return t.transpose(0, 1).contiguous().transpose(0, 1)
    if layout == "sliced":
        big = torch.zeros(*lead, C + 16, dtype=t.dtype)
        big[..., :C] = t
        return big[..., :C]
    raise ValueError(layout)


def make_tensors(case: Case):
    w, b, x, go, dw = _values(case)
    xd, wd = _DTYPES[case.x_dtype], _DTYPES[case.w_dtype]
    weight = _layout(w.to(wd), case.w_layout, (case.N,))
    bias = b.to(wd) if case.bias else None
    x = _layout(x.to(xd), case.x_layout, case.lead)
    go = _layout(go.to(xd), case.go_layout, case.lead)   # grad_output has the output's dtype
    return weight, bias, x, go, dw.to(wd)


# --------------------------------------------------------------------------- running
def _build(form: str, obj, weight, bias):
    """Returns (callable x -> y, weight parameter, bias parameter or None)."""
    N, K = weight.shape
    lin = nn.Linear(K, N, bias=bias is not None, device="meta")
    lin.weight = nn.Parameter(_same_layout_copy(weight))
    lin.bias = nn.Parameter(bias.detach().clone()) if bias is not None else None
    if form == "function":
        def call(x):
            y = obj(x.reshape(-1, K), lin.weight)
            y = y.reshape(*x.shape[:-1], N)
            if lin.bias is not None:
                y = y + lin.bias.to(y.dtype)
            return y
        return call, lin.weight, lin.bias
    if form == "module":
        m = obj.from_float(lin)
        return m, lin.weight, lin.bias
    if form == "converter":
        root = nn.Sequential(lin)
        root = obj(root)
        return root, root[0].weight, root[0].bias
    raise ValueError(form)


def _same_layout_copy(t: torch.Tensor) -> torch.Tensor:
    if t.is_contiguous():
        return t.detach().clone()
    return t.detach().t().contiguous().t()


def run(form: str, obj, case: Case) -> dict:
    """Runs forward+backward (twice for second_call). Returns {'calls': [...]} or {'error': ...}."""
    torch.manual_seed(0)
    weight, bias, x0, go0, dw = make_tensors(case)
    calls = []
    try:
        fn, wparam, bparam = _build(form, obj, weight, bias)
        for i in range(2 if case.second_call else 1):
            if i == 1:
                with torch.no_grad():
                    wparam.add_(dw)
                wparam.grad = None
                if bparam is not None:
                    bparam.grad = None
            x = x0.detach().clone() if x0.is_contiguous() else _relayout_like(x0)
            x.requires_grad_(True)
            y = fn(x)
            y.backward(go0)
            calls.append({
                "output": y.detach(),
                "grad_input": None if x.grad is None else x.grad.detach(),
                "grad_weight": None if wparam.grad is None else wparam.grad.detach(),
                "grad_bias": None if bparam is None or bparam.grad is None else bparam.grad.detach(),
            })
    except Exception as e:  # noqa: BLE001 - a crash is a result
        tb = traceback.extract_tb(e.__traceback__)
        phase = "backward" if any("backward" in fr.name for fr in tb) else "forward"
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:120]}", "phase": phase,
                "calls": calls}
    return {"calls": calls}


def _relayout_like(t: torch.Tensor) -> torch.Tensor:
    """A fresh leaf tensor with t's values and t's strides (t is a non-contiguous view)."""
    out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype) if _dense(t) else None
    if out is None:   # sliced: rebuild the same padded view
        C = t.shape[-1]
        big = torch.zeros(*t.shape[:-1], C + 16, dtype=t.dtype)
        big[..., :C] = t
        return big[..., :C]
    out.copy_(t)
    return out


def _dense(t):
    n = 1
    for s in t.shape:
        n *= s
    return sum(st * (sz - 1) for st, sz in zip(t.stride(), t.shape)) + 1 == n


def _same(a, b, check_layout: bool) -> bool:
    if a is None or b is None:
        return a is None and b is None
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if check_layout and a.stride() != b.stride():
        return False
    av, bv = a.float(), b.float()
    both_nan = torch.isnan(av) & torch.isnan(bv)
    return bool(torch.all((av == bv) | both_nan))


def diff(ref: dict, got: dict) -> dict:
    """-> {'crash': str|None, 'output': bool, 'grad_input': bool, 'grad_weight': bool, 'grad_bias': bool}."""
    out = {"crash": got.get("error"), "phase": got.get("phase")}
    if "error" in ref:
        out["ref_error"] = ref["error"]
    for key in GEMMS + ("grad_bias",):
        d = False
        for rc, gc in zip(ref.get("calls", []), got.get("calls", [])):
            if not _same(rc[key], gc[key], check_layout=(key == "output")):
                d = True
        out[key] = d
    return out


def first_wrong(d: dict):
    if d.get("crash"):
        return "crash"
    for g in GEMMS:
        if d[g]:
            return g
    return None


def fmt(d: dict) -> str:
    if d.get("ref_error"):
        return f"REFERENCE RAISED {d['ref_error']}"
    if d.get("crash"):
        return f"raises ({d['crash']})"
    flags = [g for g in GEMMS + ("grad_bias",) if d[g]]
    return "differs: " + ", ".join(flags) if flags else "identical"


# --------------------------------------------------------------------------- torchao parity
def torchao_parity() -> bool:
    from torchao.float8 import convert_to_float8_training
    from torchao.float8.config import Float8LinearConfig

    def torchao_conv(recipe):
        def conv(root, **_):
            return convert_to_float8_training(root, config=Float8LinearConfig.from_recipe_name(recipe))
        return conv

    cases = [
        Case(),
        Case(lead=(2, 32), K=64, N=128, bias=True),
        Case(lead=(32,), K=128, N=64, x_layout="transposed", w_layout="transposed",
             go_layout="transposed"),
        Case(lead=(48,), K=64, N=32, x_layout="sliced", x_dtype="fp32", second_call=True),
        Case(lead=(32,), K=64, N=64, x_dtype="fp16", w_dtype="fp32", bias=True),
        Case(lead=(2, 16), K=48, N=80, x_dtype="fp32", w_dtype="fp32", data="zero_rows"),
        Case(lead=(64,), K=96, N=48, data="tiny"),
        Case(lead=(64,), K=96, N=48, data="outlier_row", go_layout="transposed"),
    ]
    # torchao 0.18's rowwise recipes raise on a 3-D input stored transposed (a known limitation)
    tensorwise_only = [Case(lead=(2, 16), K=48, N=80, x_layout="transposed", bias=True)]
    ok = True
    print("== correct implementations vs torchao 0.18 Float8Linear (bitwise, CPU)")
    for recipe in ("tensorwise", "rowwise", "rowwise_with_gw_hp"):
        for case in cases + (tensorwise_only if recipe == "tensorwise" else []):
            ref = run("converter", torchao_conv(recipe), case)
            for form in ("function", "module", "converter"):
                got = run(form, load_attr(correct_spec(recipe, form)), case)
                d = diff(ref, got)
                bad = d.get("crash") or d.get("ref_error") or any(d[g] for g in GEMMS)
                ok &= not bad
                print(f"  {'FAIL' if bad else 'ok  '} {recipe:18s} {form:9s} {case.label():60s} {fmt(d)}")
    return ok


# --------------------------------------------------------------------------- manifest
def check_entry(e: dict) -> tuple:
    """-> (passed: bool, lines: list[str])."""
    lines = []
    name, recipe, form = e["name"], e["recipe"], e["form"]
    obj = load_attr(e["impl"])
    trig = e["trigger"]
    if "gpu only" in trig or "cpu" not in e["devices"]:
        return True, [f"  {name}: observable only on {', '.join(e['devices'])}; not executed on CPU "
                      f"(declared gemm={e['gemm']}, category={e['category']})"]
    ref_obj = load_attr(correct_spec(recipe, form))
    plain = plain_case(recipe)
    tcase = trigger_case(recipe, trig)
    d_plain = diff(run(form, ref_obj, plain), run(form, obj, plain))
    d_trig = diff(run(form, ref_obj, tcase), run(form, obj, tcase)) if trig else d_plain
    passed = True
    lines.append(f"  plain   [{plain.label()}]: {fmt(d_plain)}")
    if trig:
        lines.append(f"  trigger [{tcase.label()}]: {fmt(d_trig)}")
    got = first_wrong(d_trig)
    if d_trig.get("ref_error") or d_plain.get("ref_error"):
        passed = False
        lines.append("  !! the correct implementation raised")
    if e["category"] == "none":
        if got is not None or first_wrong(d_plain) is not None:
            passed = False
            lines.append("  !! a correct entry differs from the correct implementation")
        return passed, lines
    if e["category"] == "crash":
        if got != "crash":
            passed = False
            lines.append(f"  !! declared crash, got {got}")
        else:
            lines.append(f"  raised in the {d_trig['phase']} (declared gemm={e['gemm']})")
    elif got != e["gemm"]:
        passed = False
        lines.append(f"  !! declared gemm={e['gemm']}, first differing GEMM here: {got}")
    if trig and first_wrong(d_plain) is not None:
        passed = False
        lines.append("  !! differs on the plain case although a trigger is declared")
    return passed, lines


def main(argv) -> int:
    manifest = json.loads((HERE / "manifest.json").read_text())
    names = set(argv)
    ok = True
    if not names:
        ok &= torchao_parity()
    print("== manifest entries vs the correct implementation of their recipe (CPU)")
    for e in manifest:
        if names and e["name"] not in names:
            continue
        passed, lines = check_entry(e)
        ok &= passed
        head = (f"{'PASS' if passed else 'FAIL'} {e['name']}  [{e['recipe']}, {e['form']}, "
                f"{e['category']}, gemm={e['gemm']}, operand={e['operand']}, trigger={e['trigger']}]")
        print(head)
        for ln in lines:
            print(ln)
    print("ALL CHECKS PASSED" if ok else "SOME CHECKS FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
