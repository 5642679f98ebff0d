"""Smoke test of the hostile corpus: each manifest entry runs once, in its own subprocess.

    .venv/bin/python evals/hostile/smoke.py [--only NAME ...] [--timeout 20] [--json OUT]

The child loads the entry with parity.impls.load_impl (as the harness does), builds it, runs one
forward on a 16x32 bf16 input with a 16x32 bf16 weight and a backward with ones grad_output, a
second forward on fresh copies (function form), then checks torch's global state. It reports
each stage on a pipe as it goes, so a child that dies still says how far it got. The parent
records exit code, signal, timeout, output sizes. fwd_unbounded_alloc runs under RLIMIT_AS = 8 GiB.
"""
import argparse
import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
MANIFEST = HERE / "manifest.json"
OOM_CAP = 8 * 2**30


def _describe(value):
    import torch
    if isinstance(value, torch.Tensor):
        return dict(type="Tensor", shape=list(value.shape), dtype=str(value.dtype).replace("torch.", ""),
                    contiguous=value.is_contiguous(), requires_grad=value.requires_grad,
                    grad_fn=type(value.grad_fn).__name__ if value.grad_fn is not None else None,
                    nan=int(value.isnan().sum()) if value.is_floating_point() else 0,
                    inf=int(value.isinf().sum()) if value.is_floating_point() else 0)
    return dict(type=type(value).__name__, repr=repr(value)[:80])


def child(name):
    report = os.fdopen(int(os.environ["SMOKE_FD"]), "w", buffering=1)

    def say(**kw):
        report.write(json.dumps(kw) + "\n")
        report.flush()

    entry = next(e for e in json.load(open(MANIFEST)) if e["name"] == name)
    import torch
    import torch.nn.functional as F
    from torch import nn
    sys.path.insert(0, str(ROOT))
    from parity.impls import load_impl

    torch.manual_seed(0)
    x0 = torch.randn(16, 32, dtype=torch.bfloat16)
    w0 = torch.randn(16, 32, dtype=torch.bfloat16)
    expected = (x0.float() @ w0.float().t()).to(torch.bfloat16)
    scaled_mm, linear_fn = torch._scaled_mm, F.linear
    linear = nn.Linear(32, 16, bias=False, dtype=torch.bfloat16)
    with torch.no_grad():
        linear.weight.copy_(w0)

    def global_state(rng_before=None):
        state = {}
        state["rng_state_changed"] = rng_before is not None and not torch.equal(torch.get_rng_state(), rng_before)
        state["default_dtype"] = str(torch.get_default_dtype()).replace("torch.", "")
        state["grad_enabled"] = torch.is_grad_enabled()
        try:
            state["f32_matmul_precision"] = torch.get_float32_matmul_precision()
        except Exception as err:  # torch 2.13 raises when legacy and new precision APIs were mixed
            state["f32_matmul_precision"] = f"get_float32_matmul_precision raises {type(err).__name__}"
        state["flush_denormal"] = bool((torch.tensor([1e-40], dtype=torch.float32) * 1.0)[0] == 0)
        state["cuda_matmul_tf32"] = torch.backends.cuda.matmul.allow_tf32
        state["cudnn_tf32"] = torch.backends.cudnn.allow_tf32
        state["bf16_reduced_reduction"] = torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
        state["scaled_mm_patched"] = torch._scaled_mm is not scaled_mm
        state["F_linear_patched"] = F.linear is not linear_fn
        state["global_forward_hooks"] = len(nn.modules.module._global_forward_hooks)
        with torch.enable_grad():
            a = torch.tensor(3.0, requires_grad=True)
            (a * a).backward()
            state["fresh_grad_of_a_squared_at_3"] = float(a.grad)
        t = torch.ones(1, 4, dtype=torch.float32)
        wt = torch.full((4, 4), 0.5, dtype=torch.float32)
        with torch.no_grad():
            state["fresh_F_linear_ok"] = bool(torch.allclose(F.linear(t, wt), t @ wt.t()))
            try:
                lin = nn.Linear(4, 4, bias=False)
                lin.weight.copy_(wt)
                state["fresh_nn_Linear_ok"] = bool(torch.allclose(lin(t), t @ wt.t()))
            except Exception as err:  # e.g. a default dtype of float64 makes a fresh nn.Linear fp64
                state["fresh_nn_Linear_ok"] = f"raises {type(err).__name__}: {str(err)[:80]}"
        return state

    baseline = global_state()
    torch.manual_seed(0)
    rng_before = torch.get_rng_state()
    say(stage="start")
    try:
        impl = load_impl(entry["impl"])
        say(stage="loaded", form=impl.form.value)
        x = x0.clone().requires_grad_(True)
        if impl.form.value == "function":
            w = linear.weight
            module = None
            say(stage="built")
            out = impl.target(x, w)
        else:
            module, w, _ = impl.build(linear)
            say(stage="built", module=type(module).__name__)
            out = module(x)
        desc = _describe(out)
        if isinstance(out, torch.Tensor) and list(out.shape) == [16, 16]:
            desc["max_abs_err_vs_fp32_matmul"] = float((out.detach().double() - expected.double()).abs().max())
        desc["input_changed"] = not torch.equal(x.detach(), x0)
        desc["weight_changed"] = not torch.equal(w.detach(), w0)
        say(stage="forward", out=desc)
        out.backward(torch.ones(16, 16, dtype=torch.bfloat16))
        say(stage="backward", grad_input=None if x.grad is None else list(x.grad.shape),
            grad_weight=None if w.grad is None else list(w.grad.shape),
            grad_input_ok=x.grad is not None and torch.allclose(
                x.grad.float(), torch.ones(16, 16, dtype=torch.float32) @ w0.float(), rtol=2e-2, atol=1e-1))
        if module is None:
            x2, w2 = x0.clone().requires_grad_(True), nn.Parameter(w0.clone())
            out2 = impl.target(x2, w2)
            same = (isinstance(out2, torch.Tensor) and out2.shape == out.shape and out2.dtype == out.dtype
                    and bool(torch.isclose(out2.detach(), out.detach(), rtol=0, atol=0, equal_nan=True).all()))
            say(stage="second_call", same_as_first=same)
    except BaseException as err:
        say(stage="exception", type=type(err).__name__, message=str(err)[:300])
        raise
    finally:
        if not report.closed:
            # global state left behind: what differs from before the entry was loaded
            state = global_state(rng_before)
            state = {k: [baseline.get(k, False), v] for k, v in state.items() if v != baseline.get(k, False)}
            say(stage="post", state=state)


def _limit_memory():
    resource.setrlimit(resource.RLIMIT_AS, (OOM_CAP, OOM_CAP))


def run(entry, timeout):
    r, w = os.pipe()
    oom = entry["behaviour"] == "oom"
    t0 = time.time()
    proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--child", entry["name"]],
                            cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            pass_fds=(w,), start_new_session=True, preexec_fn=_limit_memory if oom else None,
                            env={**os.environ, "SMOKE_FD": str(w)})
    os.close(w)
    timed_out = False
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        os.killpg(proc.pid, signal.SIGKILL)  # the group of the child started just above
        stdout, stderr = proc.communicate()
    elapsed = time.time() - t0
    with os.fdopen(r) as f:
        stages = [json.loads(line) for line in f if line.strip()]
    rc = proc.returncode
    sig = signal.Signals(-rc).name if rc is not None and rc < 0 else None
    return dict(name=entry["name"], rc=rc, signal=sig, timed_out=timed_out, seconds=round(elapsed, 1),
                stdout_bytes=len(stdout), stderr_bytes=len(stderr), stderr_tail=stderr[-400:].decode(errors="replace"),
                stages=stages)


def summary(res):
    st = {s["stage"]: s for s in res["stages"]}
    last = [s["stage"] for s in res["stages"] if s["stage"] not in ("post",)]
    how = "TIMEOUT(killed)" if res["timed_out"] else (f"signal {res['signal']}" if res["signal"] else f"rc={res['rc']}")
    parts = [how, f"{res['seconds']}s", f"reached={last[-1] if last else '-'}"]
    if "exception" in st:
        e = st["exception"]
        parts.append(f"exc={e['type']}: {e['message'][:120]}")
    elif res["rc"] not in (0, None) and res["stderr_tail"].strip():
        parts.append(f"stderr_last={res['stderr_tail'].strip().splitlines()[-1][:160]}")
    if "forward" in st:
        parts.append(f"out={st['forward']['out']}")
    if "backward" in st:
        b = dict(st["backward"])
        b.pop("stage")
        parts.append(f"bwd={b}")
    if "second_call" in st:
        parts.append(f"second_call_same={st['second_call']['same_as_first']}")
    if "post" in st:
        parts.append(f"global_state_changed(before,after)={st['post']['state'] or 'none'}")
    else:
        parts.append("post=not reached")
    if res["stdout_bytes"] > 1000 or res["stderr_bytes"] > 5000:
        parts.append(f"stdout={res['stdout_bytes']}B stderr={res['stderr_bytes']}B")
    return " | ".join(parts)


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        return child(sys.argv[2])
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", nargs="*")
    ap.add_argument("--timeout", type=float, default=20)
    ap.add_argument("--json")
    args = ap.parse_args()
    entries = [e for e in json.load(open(MANIFEST)) if not args.only or e["name"] in args.only]
    results = []
    for e in entries:
        res = run(e, args.timeout)
        results.append(res)
        print(f"{e['name']:28s} [{e['behaviour']}/{e['phase']}] {summary(res)}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
