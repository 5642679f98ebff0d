"""The built-in models of `fp8-parity train`: their sizes, their learning rates, and the checks of a
size that every FP8 GEMM dim needs. Standard library only: the parser (parity.cli) lists these
models in `train --help` without importing torch; parity.model builds them.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

ALIGNMENT = 16  # the FP8 GEMMs' smallest alignment (torch._scaled_mm); recipes may need more


class ModelError(ValueError):
    """A model or data configuration that cannot be built; the message says what and how to fix it."""


@dataclass(frozen=True)
class GPTConfig:
    """The model and the shape of a training step's batch."""

    name: str
    n_layer: int
    d_model: int
    n_head: int
    vocab_size: int
    seq_len: int  # tokens a sequence predicts (each batch row holds seq_len + 1 tokens)
    batch_size: int  # sequences per step (per micro-batch under gradient accumulation)
    successors: int = 4  # next tokens each token of the Markov source can have
    # AdamW's learning rate for this model (--lr overrides it). 1e-2 takes the tiny model from
    # ln(64) = 4.2 nats to within a fraction of a nat of the source's entropy rate in 50 steps:
    # the loss still moves at the end, so a gap between implementations is a gap in how they
    # train, not two flat lines.
    learning_rate: float = 1e-2

    def __post_init__(self):
        for field_name in ("n_layer", "d_model", "n_head", "vocab_size", "seq_len", "batch_size"):
            if getattr(self, field_name) < 1:
                raise ModelError(f"model {self.name!r}: {field_name} = {getattr(self, field_name)} must be positive")
        if self.d_model % self.n_head or (self.d_model // self.n_head) % 2:
            raise ModelError(f"model {self.name!r}: d_model = {self.d_model} must split into n_head = {self.n_head} "
                             f"heads of an even size (rotary embeddings rotate pairs of dims): choose n_head so that "
                             f"d_model / n_head is even")
        if not 2 <= self.successors <= self.vocab_size:
            raise ModelError(f"model {self.name!r}: successors = {self.successors} must be from 2 to the vocabulary "
                             f"size {self.vocab_size} (each token's successors include the next two tokens)")
        self.check_alignment(ALIGNMENT)

    @property
    def mlp_width(self) -> int:
        return 4 * self.d_model

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len

    def check_alignment(self, alignment: int, why: str = "torch._scaled_mm") -> None:
        """ModelError naming every GEMM dim that is not a multiple of `alignment`."""
        dims = (("d_model", self.d_model), ("MLP width (4 x d_model)", self.mlp_width),
                ("vocab_size", self.vocab_size), ("tokens per step (batch_size x seq_len)", self.tokens_per_step))
        bad = [f"{name} = {value}" for name, value in dims if value % alignment]
        if bad:
            raise ModelError(f"model {self.name!r}: {', '.join(bad)} not a multiple of {alignment}, which every FP8 "
                             f"GEMM dim needs ({why}): round it to a multiple of {alignment}")


MODELS: dict[str, GPTConfig] = {c.name: c for c in (
    # the CPU's: 2 layers, d_model 64; 256 tokens a step; 50 steps take seconds on 2 cores
    GPTConfig("tiny", n_layer=2, d_model=64, n_head=2, vocab_size=64, seq_len=32, batch_size=8),
    # a GPU's: big enough that tensorwise scales meet real dynamic range, small enough for minutes
    GPTConfig("small", n_layer=4, d_model=256, n_head=4, vocab_size=256, seq_len=128, batch_size=16),
    # block-scaled recipes need every dim a multiple of 128
    GPTConfig("small128", n_layer=2, d_model=128, n_head=2, vocab_size=128, seq_len=64, batch_size=2),
    # The H200's: nanochat's d12 (12 layers, d_model 768, 6 heads of 128). Vocabulary 8192, not
    # nanochat's 65536: the Markov source has 4 successors per token, so the model must learn
    # 8192 x 4 transitions; 200 steps of 16384 tokens show each token about 400 times (each
    # transition ~100), so the loss gets near the entropy floor within the run (measured on a CPU
    # proxy: 2 layers, d_model 128, this vocabulary, 16384 tokens a step, AdamW 3e-3: 9.5 nats to
    # 2.6 in 60 steps, floor 1.09; not measured on d12 itself), where 65536
    # would leave most transitions seen a handful of times and the curve would measure how
    # fast the table is memorized, not how the numerics train. 8192 is a multiple of 128 (block
    # scales) and keeps the head a real GEMM (768 x 8192, 6.3M of the 91M matmul weights).
    # Batch 16 x 1024 = 16384 tokens a step (every dim a multiple of 128).
    # FLOPs a step, one run: 6 x 91.2M matmul weights x 16384 tokens = 9.0 TFLOP, plus attention's
    # products 3 x 4 x 16 x 1024^2 x 768 x 12 layers = 1.9 TFLOP (on CUDA the lockstep runs the math
    # kernel, which computes the whole square, not the causal half: parity.train says why): ~11
    # TFLOP; four runs in lockstep ~44 TFLOP, 200 steps ~9 PFLOP: ~30 s at 300 TFLOP/s (a third
    # of the H200's bf16 peak, an eager model of this size). The math kernel's softmax over
    # 16 x 6 x 1024^2 scores moves ~1 GB per layer and pass, ~1.5 ms a layer fwd+bwd at 4 TB/s:
    # 12 layers x 4 runs x 200 steps ~15 s more. The statistics at a sampled step add float64 shadows
    # of every GEMM of the four runs, 4 x 9.0 = 36 TFLOP of fp64 (the H200's fp64 tensor cores:
    # 67 TFLOP/s peak), ~1 s each: 41 sampled steps (every 5) ~40 s; drawing the 200 batches on
    # the CPU ~5 s. So ~1.5-2 min in all, under the 5 minutes (an estimate: the machine
    # this was written on has no GPU; test_train.py's fp8_gpu test measures it).
    # AdamW at 3e-3: the tiny model's 1e-2 is too large for 12 layers of 768 without warm-up
    # (GPT-2 small trains at 6e-4 with warm-up; QK norm, RMSNorm and the logit soft-cap make
    # this model more tolerant), and still above the bf16 weights' resolution (a weight near
    # its init std 768^-0.5 = 0.036 has a bf16 step of 2.4e-4), so updates are not rounded away.
    GPTConfig("d12", n_layer=12, d_model=768, n_head=6, vocab_size=8192, seq_len=1024, batch_size=16,
              learning_rate=3e-3),
)}


def get_model_config(name: str) -> GPTConfig:
    if name not in MODELS:
        close = difflib.get_close_matches(name, list(MODELS), n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ModelError(f"unknown model {name!r}: {hint}known models: "
                         + "; ".join(f"{c.name} ({c.n_layer} layers, d_model {c.d_model})" for c in MODELS.values()))
    return MODELS[name]
