"""What of torchao's MX code runs here: one line per piece, ok or the error it raised.

    python -m evals.scoring.mx_probe [--device cuda] [--json OUT]

Each probe runs one public entry point of torchao.prototype.mx_formats / moe_training on a small tensor
and says whether it ran, and (where it computes a cast) whether its bytes are parity.mx's oracle's. The
results for torch 2.13 on a CPU and torch 2.11 on the H200 are in docs/concepts/mx.md.
"""

from __future__ import annotations

import argparse
import json
import logging
import traceback

import torch


def _probes(device: str):
    from torchao.prototype.mx_formats import mx_tensor, nvfp4_tensor, utils
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from parity import mx, oracles
    from parity.recipes import RECIPES

    torch.manual_seed(0)
    x = torch.randn(128, 256, device=device).to(torch.bfloat16)

    def oracle_bytes(rule):
        q = oracles.quantize(x.cpu(), RECIPES["mxfp8"].gemm("output").a, mx_rule=rule)
        return mx.e8m0_bytes_of(q.inv_scale), q.values

    def to_mx(rule, mode):
        def run():
            scale, data = mx_tensor.to_mx(x, torch.float8_e4m3fn, 32, mode)
            want_scale, want_values = oracle_bytes(rule)
            same = torch.equal(scale.view(torch.uint8).cpu(), want_scale) and \
                torch.equal(data.cpu().to(torch.float64), want_values)
            return f"bit for bit the oracle's: {same}"
        return run

    def triton_dim(kernel, rule):
        def run():
            from torchao.prototype.mx_formats import kernels
            cast = getattr(kernels, kernel)
            out = cast(x, 32, rule) if kernel.endswith("dim1") else cast(x, inner_block_size=32, scaling_mode=rule)
            return f"ran ({type(out).__name__})"
        return run

    def mxfp8_linear(preference):
        def run():
            from torchao.prototype.moe_training.mxfp8_linear import MXFP8Linear
            from torchao.quantization.quantize_.common.kernel_preference import KernelPreference
            layer = MXFP8Linear(256, 64, bias=False, device=device, dtype=torch.bfloat16,
                                kernel_preference=getattr(KernelPreference, preference))
            inp = x.clone().requires_grad_()
            layer(inp).sum().backward()
            return "forward and backward ran"
        return run

    def training_op_config():
        from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig, MXFP8TrainingRecipe
        from torchao.quantization import quantize_
        model = torch.nn.Sequential(torch.nn.Linear(256, 64, bias=False, device=device, dtype=torch.bfloat16))
        quantize_(model, MXFP8TrainingOpConfig.from_recipe(MXFP8TrainingRecipe.MXFP8_EMULATED_RCEIL))
        model(x).sum().backward()
        return "converted; forward and backward ran"

    def nvfp4():
        scales, data = nvfp4_tensor.nvfp4_quantize(x, 16, nvfp4_tensor.per_tensor_amax_to_scale(x.abs().amax()))
        return f"ran: {tuple(data.shape)} packed bytes, {tuple(scales.shape)} e4m3 block scales"

    def blocked():
        scales = torch.randint(0, 255, (200, 7), dtype=torch.uint8, device=device)
        return f"bit for bit parity.mx.swizzled: {torch.equal(utils.to_blocked(scales).cpu(), mx.swizzled(scales.cpu()))}"

    def scaled_mm_mxfp8():
        a = torch.randn(128, 64, device=device).to(torch.float8_e4m3fn)
        b = torch.randn(128, 64, device=device).to(torch.float8_e4m3fn).t()
        s = torch.full((128 * 4,), 127, dtype=torch.uint8, device=device).view(torch.float8_e8m0fnu)
        F = torch.nn.functional
        out = F.scaled_mm(a, b, s, F.ScalingType.BlockWise1x32, s, F.ScalingType.BlockWise1x32,
                          swizzle_a=F.SwizzleType.SWIZZLE_32_4_4, swizzle_b=F.SwizzleType.SWIZZLE_32_4_4)
        return f"ran ({out.dtype})"

    return {
        "mx_formats.to_mx FLOOR": to_mx("floor", ScaleCalculationMode.FLOOR),
        "mx_formats.to_mx RCEIL": to_mx("rceil", ScaleCalculationMode.RCEIL),
        "kernels.triton_to_mxfp8_dim0 (Triton)": triton_dim("triton_to_mxfp8_dim0", "rceil"),
        "kernels.triton_to_mxfp8_dim1 (Triton)": triton_dim("triton_to_mxfp8_dim1", "rceil"),
        "utils.to_blocked": blocked,
        "nvfp4_tensor.nvfp4_quantize": nvfp4,
        "moe_training.MXFP8Linear EMULATED": mxfp8_linear("EMULATED"),
        "moe_training.MXFP8Linear AUTO (SM100 kernels)": mxfp8_linear("AUTO"),
        "moe_training.MXFP8TrainingOpConfig (quantize_)": training_op_config,
        "F.scaled_mm BlockWise1x32 (torch's MX GEMM)": scaled_mm_mxfp8,
    }


def probe(device: str) -> list[dict]:
    logging.disable(logging.WARNING)  # torchao's missing optional extensions
    rows = []
    for name, run in _probes(device).items():
        try:
            rows.append(dict(probe=name, ok=True, said=run()))
        except Exception as err:  # noqa: BLE001 - what it raised is the answer
            where = traceback.extract_tb(err.__traceback__)[-1]
            rows.append(dict(probe=name, ok=False, said=f"{type(err).__name__}: {str(err).strip()[:200]} "
                                                         f"({where.filename.split('site-packages/')[-1]}:{where.lineno})"))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", help="write the rows here too")
    args = parser.parse_args()
    import torchao
    header = dict(torch=torch.__version__, torchao=torchao.__version__, device=args.device,
                  gpu=torch.cuda.get_device_name() if args.device == "cuda" else None)
    rows = probe(args.device)
    print(json.dumps(header))
    for row in rows:
        print(json.dumps(row))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(dict(header, probes=rows), out, indent=1)


if __name__ == "__main__":
    main()
