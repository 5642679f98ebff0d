"""Writes the bug files (each a copy of its twin with one small change) and manifest.json."""
import json, os
HERE = os.path.dirname(os.path.abspath(__file__))
P = "property_tests/heldout10/"
CORRECT = [
    ("tw_func", "fp8_linear", "function", "tensorwise", "tensorwise, autograd.Function with functional helpers, saves high-precision input and weight"),
    ("tw_module", "TensorwiseFP8Linear", "module", "tensorwise", "tensorwise, class-based quantizer, saves the fp8 casts and their scales for backward"),
    ("tw_conv", "convert", "converter", "tensorwise", "tensorwise, scaled GEMM as a torch.library custom op, N-D via flatten/unflatten"),
    ("rw_func", "fp8_linear_rowwise", "function", "rowwise", "rowwise, functional helpers, power-of-2 scales, post-scaling for the non-fast-accum GEMMs"),
    ("rw_conv", "convert_to_rowwise", "converter", "rowwise", "rowwise, quantizer objects holding their reduction axis, N-D via flatten"),
    ("gwhp_module", "Float8LinearGwHp", "module", "rowwise_with_gw_hp", "rowwise_with_gw_hp, module caching nothing, in-place post-scaling"),
    ("gwhp_func", "linear_gw_hp", "function", "rowwise_with_gw_hp", "rowwise_with_gw_hp, one helper per GEMM"),
    ("bw_module", "BlockwiseFP8Linear", "module", "blockwise", "blockwise 1x128/128x128, quantize-dequantize then one fp32 matmul"),
    ("bw_conv", "convert_blockwise", "converter", "blockwise", "blockwise 1x128/128x128, per-K-block fp32 partial products with separate scales"),
    ("rw_module", "RowwiseLinear", "module", "rowwise", "rowwise, torch.library custom op for the cast, saves nothing but high-precision tensors"),
]
from _bugs import BUGS

def main():
    man = []
    info = {c[0]: c for c in CORRECT}
    for stem, attr, form, recipe, desc in CORRECT:
        man.append(dict(name=stem, impl=P + stem + ".py:" + attr, form=form, recipe=recipe, category="none",
                        gemm=None, operand=None, trigger=[], devices=["cpu", "cuda"], source="invented",
                        description=desc))
    counters = {}
    for b in BUGS:
        twin, old, new, cat, gemm, operand, trigger, source, desc = b
        counters[twin] = counters.get(twin, 0) + 1
        name = "bug_%s_%02d" % (twin, counters[twin])
        src = open(os.path.join(HERE, twin + ".py")).read()
        assert src.count(old) == 1, (name, old, src.count(old))
        open(os.path.join(HERE, name + ".py"), "w").write(src.replace(old, new))
        _, attr, form, recipe, _ = info[twin]
        man.append(dict(name=name, impl=P + name + ".py:" + attr, form=form, recipe=recipe, category=cat,
                        gemm=gemm, operand=operand, trigger=trigger,
                        devices=["cuda"] if "gpu only" in trigger else ["cpu", "cuda"],
                        source=source, description=desc))
    json.dump(man, open(os.path.join(HERE, "manifest.json"), "w"), indent=1)
    print(len(man), "entries")

if __name__ == "__main__":
    main()
