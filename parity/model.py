"""A compact GPT and a synthetic language with a known entropy rate: training without a download.

The model has nanochat's shape: token embedding, then blocks of (RMSNorm -> causal self-attention
with rotary position embeddings and normalized queries and keys -> residual) and (RMSNorm -> MLP
with a relu^2 activation -> residual), a final RMSNorm and an untied output head whose logits are
soft-capped. Every matrix multiply is an nn.Linear without bias, so converting the linears to FP8
puts every GEMM of the model under test (the embedding is a lookup, attention's own products stay
in high precision, as in nanochat and torchao).

The data is a sparse first-order Markov source drawn from a seed: each token has `successors`
possible next tokens, with seeded probabilities. Its entropy rate is computed exactly,

    H = sum_i pi_i * H(P_i)        pi: the stationary distribution, P_i: token i's successor law,

and sequences start from pi, so every position's expected cross-entropy under the true law is H:
a loss has an absolute floor, and "FP8 trains as well as bf16" can be read against how far both
still are from it. Token i's successors always include i + 1 and i + 2 (mod vocab): cycles of
lengths vocab and vocab - 1 make the chain irreducible and aperiodic, so pi exists and is unique.

Sizes: every GEMM dim must be a multiple of the recipe's alignment (16 for tensorwise and
rowwise, 128 for blockwise): d_model, the MLP width (4 x d_model), the vocabulary and the tokens
of a step (batch x sequence length). GPTConfig says which one is not, before anything is built.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

ALIGNMENT = 16  # the FP8 GEMMs' smallest alignment (torch._scaled_mm); recipes may need more
LOGIT_SOFTCAP = 15.0  # nanochat's: logits = 15 tanh(logits / 15)


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
    batch_size: int  # sequences per step
    successors: int = 4  # next tokens each token of the Markov source can have

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
)}


def get_model_config(name: str) -> GPTConfig:
    if name not in MODELS:
        import difflib
        close = difflib.get_close_matches(name, list(MODELS), n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ModelError(f"unknown model {name!r}: {hint}known models: "
                         + "; ".join(f"{c.name} ({c.n_layer} layers, d_model {c.d_model})" for c in MODELS.values()))
    return MODELS[name]


# ---- the model ---------------------------------------------------------------------------------

def rms_norm(x: torch.Tensor) -> torch.Tensor:
    """RMSNorm without a learned gain, as nanochat."""
    return F.rms_norm(x, (x.size(-1),))


def rotary_tables(seq_len: int, head_dim: int, base: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [seq_len, head_dim / 2] of the rotary angles."""
    inverse_frequency = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inverse_frequency)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (first half, second half) of each head's dims by the position's angles; x [B, H, T, D]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat([x1 * cos + x2 * sin, x2 * cos - x1 * sin], dim=-1)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_head, self.head_dim = config.n_head, config.d_model // config.n_head
        d = config.d_model
        self.c_q, self.c_k, self.c_v = (nn.Linear(d, d, bias=False) for _ in range(3))
        self.c_proj = nn.Linear(d, d, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        heads = lambda t: t.view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # noqa: E731
        q, k, v = heads(self.c_q(x)), heads(self.c_k(x)), heads(self.c_v(x))
        q, k = rms_norm(apply_rotary(q, cos, sin)), rms_norm(apply_rotary(k, cos, sin))  # nanochat's QK norm
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.d_model, config.mlp_width, bias=False)
        self.c_proj = nn.Linear(config.mlp_width, config.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.relu(self.c_fc(x)).square())


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.attn, self.mlp = CausalSelfAttention(config), MLP(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(rms_norm(x), cos, sin)
        return x + self.mlp(rms_norm(x))


class GPT(nn.Module):
    """nanochat's GPT, compact: see the module docstring. forward(idx [B, T]) -> logits [B, T, V] (float32)."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.d_model)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        cos, sin = rotary_tables(config.seq_len, config.d_model // config.n_head)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    @torch.no_grad()
    def init_weights(self, seed: int) -> "GPT":
        """Weights drawn from `seed` on the CPU (the same bits on every device). nanochat zero-initializes
        the output projections and the head; here every weight is random, so that every GEMM carries
        signal from step 0 (a zero weight has no fp8 numerics to compare) and another seed is another
        model (the seed-to-seed noise the loss gap is judged against)."""
        generator = torch.Generator().manual_seed(seed)
        for name, param in self.named_parameters():
            fan_in = param.shape[-1]
            std = 1.0 if name == "wte.weight" else fan_in ** -0.5
            if name.endswith("c_proj.weight"):  # residual branches start small: a deep stack stays stable
                std /= math.sqrt(2 * self.config.n_layer)
            param.copy_(torch.randn(param.shape, generator=generator) * std)
        return self

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        x = rms_norm(self.wte(idx))
        cos, sin = self.cos[:T], self.sin[:T]
        for block in self.blocks:
            x = block(x, cos, sin)
        logits = self.lm_head(rms_norm(x)).float()
        return LOGIT_SOFTCAP * torch.tanh(logits / LOGIT_SOFTCAP)


# ---- the data ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class MarkovSource:
    """A sparse first-order Markov source over `vocab_size` tokens, drawn from `seed` (see the module
    docstring). `transition[i]` is token i's successor distribution (float64, `successors` non-zeros)."""

    vocab_size: int
    successors: int
    seed: int
    transition: torch.Tensor
    stationary: torch.Tensor

    @classmethod
    def make(cls, vocab_size: int, successors: int, seed: int) -> "MarkovSource":
        if not 2 <= successors <= vocab_size:
            raise ModelError(f"MarkovSource: successors = {successors} must be from 2 to vocab_size = {vocab_size}")
        generator = torch.Generator().manual_seed(seed)
        transition = torch.zeros(vocab_size, vocab_size, dtype=torch.float64)
        for token in range(vocab_size):
            chain = [(token + 1) % vocab_size, (token + 2) % vocab_size]  # irreducible and aperiodic (docstring)
            others = [t for t in torch.randperm(vocab_size, generator=generator).tolist() if t not in chain]
            next_tokens = (chain + others)[:successors]
            # Dirichlet(1) weights: -log(uniform) normalized; some successors likely, some rare
            weights = -torch.rand(successors, generator=generator, dtype=torch.float64).clamp(min=1e-12).log()
            transition[token, next_tokens] = weights / weights.sum()
        # pi P = pi, sum(pi) = 1: one equation of (P^T - I) pi = 0 is redundant; replace it by the sum
        system = transition.t() - torch.eye(vocab_size, dtype=torch.float64)
        system[-1] = 1.0
        rhs = torch.zeros(vocab_size, dtype=torch.float64)
        rhs[-1] = 1.0
        stationary = torch.linalg.solve(system, rhs)
        return cls(vocab_size, successors, seed, transition, stationary)

    @property
    def entropy_rate(self) -> float:
        """Nats per token: the cross-entropy a perfect model reaches, the floor of the training loss."""
        p = self.transition
        per_token = -(p * torch.where(p > 0, p.log(), torch.zeros_like(p))).sum(1)
        return float((self.stationary * per_token).sum())

    def batch(self, batch_size: int, length: int, generator: torch.Generator) -> torch.Tensor:
        """[batch_size, length] tokens (int64), each row started from the stationary distribution."""
        tokens = torch.empty(batch_size, length, dtype=torch.long)
        tokens[:, 0] = torch.multinomial(self.stationary.float(), batch_size, replacement=True, generator=generator)
        law = self.transition.float()
        for t in range(1, length):
            tokens[:, t] = torch.multinomial(law[tokens[:, t - 1]], 1, generator=generator).squeeze(1)
        return tokens


def batches(config: GPTConfig, steps: int, seed: int) -> tuple[MarkovSource, list[torch.Tensor]]:
    """The source of `config`'s vocabulary drawn from `seed`, and `steps` batches [batch_size, seq_len + 1]
    drawn from it (from seed + 1): every run of a comparison trains on these same tokens."""
    source = MarkovSource.make(config.vocab_size, config.successors, seed)
    generator = torch.Generator().manual_seed(seed + 1)
    return source, [source.batch(config.batch_size, config.seq_len + 1, generator) for _ in range(steps)]
