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

The source is stored sparse (each token's successors and their probabilities), so a vocabulary
of thousands costs kilobytes: the stationary distribution comes from power iteration on that
sparse law (the chain mixes in under a hundred iterations; iteration stops when an iteration
changes pi by less than 1e-15 in L1, so pi is exact to float64 rounding), and sequences are
drawn by inverse CDF over a token's few successors, not over the whole vocabulary.

Sizes: every GEMM dim must be a multiple of the recipe's alignment (16 for tensorwise and
rowwise, 128 for blockwise): d_model, the MLP width (4 x d_model), the vocabulary and the tokens
of a step (batch x sequence length). GPTConfig says which one is not, before anything is built.

Your own model and your own data (`fp8-parity train --model path.py:factory --data FILE`):

    factory()   called with no arguments, returns an nn.Module whose forward takes token ids
                [B, T] (int64) and returns logits [B, T, vocab_size]. The module says the shape of
                its data with attributes: `vocab_size` and `seq_len` (int, required: T of a batch),
                `batch_size` (int, optional, default 8: sequences per micro-batch). Weights drawn
                from torch's global generator come from the run's seed (the factory is called under
                torch.manual_seed(seed), once for --seed and once for seed + 1, the noise run), so
                a factory that draws from its own fixed generator gives a noise run equal to the
                baseline (no noise, and the 0.25% line decides). Every nn.Linear in it is converted.
    --data FILE a .pt file holding an integer tensor of token ids (any shape, read flattened), a
                .npy file of integer ids, or any other file as UTF-8 text tokenized by bytes
                (ids 0-255: the model's vocabulary must be at least 256). Each sequence is a
                window at a seeded random offset. Real data has no known entropy rate, so the
                report has no loss floor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from parity.impls import ImplError, import_target
# the built-in models' sizes live in a torch-free module (the parser lists them); read here from there
from parity.model_configs import MODELS, GPTConfig, ModelError, get_model_config  # noqa: F401 - re-exported
from parity.names import FACTORY_PROTOCOL

LOGIT_SOFTCAP = 15.0  # nanochat's: logits = 15 tanh(logits / 15)


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
        # Activation checkpointing (`train --checkpoint`): each block runs under
        # torch.utils.checkpoint (non-reentrant), so its forward runs again in backward.
        self.checkpoint_blocks = False

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
            x = checkpoint(block, x, cos, sin, use_reentrant=False) if self.checkpoint_blocks else block(x, cos, sin)
        logits = self.lm_head(rms_norm(x)).float()
        return LOGIT_SOFTCAP * torch.tanh(logits / LOGIT_SOFTCAP)


# ---- the data ----------------------------------------------------------------------------------

STATIONARY_TOLERANCE = 1e-15  # L1 change of pi per power iteration at which it stops (float64 rounding)


@dataclass(frozen=True)
class MarkovSource:
    """A sparse first-order Markov source over `vocab_size` tokens, drawn from `seed` (see the module
    docstring). Token i's successors are `next_tokens[i]` ([vocab, successors], int64) with the
    probabilities `probabilities[i]` (float64, summing to 1)."""

    vocab_size: int
    successors: int
    seed: int
    next_tokens: torch.Tensor
    probabilities: torch.Tensor
    stationary: torch.Tensor

    @classmethod
    def make(cls, vocab_size: int, successors: int, seed: int) -> "MarkovSource":
        if not 2 <= successors <= vocab_size:
            raise ModelError(f"MarkovSource: successors = {successors} must be from 2 to vocab_size = {vocab_size}")
        generator = torch.Generator().manual_seed(seed)
        next_tokens = torch.empty(vocab_size, successors, dtype=torch.long)
        probabilities = torch.empty(vocab_size, successors, dtype=torch.float64)
        for token in range(vocab_size):
            chain = [(token + 1) % vocab_size, (token + 2) % vocab_size]  # irreducible and aperiodic (docstring)
            # the first `successors` of the permutation hold at least successors - 2 tokens outside the chain
            permutation = torch.randperm(vocab_size, generator=generator)[:successors].tolist()
            others = [t for t in permutation if t not in chain]
            next_tokens[token] = torch.tensor((chain + others)[:successors])
            # Dirichlet(1) weights: -log(uniform) normalized; some successors likely, some rare
            weights = -torch.rand(successors, generator=generator, dtype=torch.float64).clamp(min=1e-12).log()
            probabilities[token] = weights / weights.sum()
        return cls(vocab_size, successors, seed, next_tokens, probabilities,
                   _stationary(next_tokens, probabilities))

    @property
    def transition(self) -> torch.Tensor:
        """The dense transition matrix [vocab, vocab] (float64): for small vocabularies and tests."""
        dense = torch.zeros(self.vocab_size, self.vocab_size, dtype=torch.float64)
        return dense.scatter_(1, self.next_tokens, self.probabilities)

    @property
    def entropy_rate(self) -> float:
        """Nats per token: the cross-entropy a perfect model reaches, the floor of the training loss."""
        p = self.probabilities
        per_token = -(p * torch.where(p > 0, p.log(), torch.zeros_like(p))).sum(1)
        return float((self.stationary * per_token).sum())

    def batch(self, batch_size: int, length: int, generator: torch.Generator) -> torch.Tensor:
        """[batch_size, length] tokens (int64), each row started from the stationary distribution, each
        next token drawn by inverse CDF over the current token's successors."""
        # the walk runs one small step per position: numpy's per-call cost is torch's tenth
        tokens = np.empty((batch_size, length), dtype=np.int64)
        tokens[:, 0] = torch.multinomial(self.stationary.float(), batch_size, replacement=True,
                                         generator=generator).numpy()
        uniforms = torch.rand(batch_size, length, generator=generator, dtype=torch.float64).numpy()
        cumulative, next_tokens = self.probabilities.cumsum(1).numpy(), self.next_tokens.numpy()
        last = self.successors - 1
        for t in range(1, length):
            previous = tokens[:, t - 1]
            # the first successor whose cumulative probability exceeds u (the min: a sum that rounds below 1)
            choice = np.minimum((uniforms[:, t, None] >= cumulative[previous]).sum(1), last)
            tokens[:, t] = next_tokens[previous, choice]
        return torch.from_numpy(tokens)


def _stationary(next_tokens: torch.Tensor, probabilities: torch.Tensor) -> torch.Tensor:
    """pi = pi P by power iteration on the sparse law, from the uniform distribution."""
    vocab_size = next_tokens.shape[0]
    pi = torch.full((vocab_size,), 1.0 / vocab_size, dtype=torch.float64)
    flat_next = next_tokens.reshape(-1)
    for _ in range(100_000):
        new = torch.zeros_like(pi).index_add_(0, flat_next, (pi[:, None] * probabilities).reshape(-1))
        change = float((new - pi).abs().sum())
        pi = new
        if change < STATIONARY_TOLERANCE:
            return pi / pi.sum()
    raise ModelError(f"MarkovSource: the stationary distribution did not converge (last change {change:.3g}); "
                     f"draw the source from another seed")


@dataclass(frozen=True)
class TokenFile:
    """Token ids read from `--data FILE` (see the module docstring); sequences are windows at
    seeded random offsets. No entropy rate is known: `entropy_rate` is None."""

    path: str
    tokens: torch.Tensor  # [n] int64
    kind: str  # "token ids (.pt)", "token ids (.npy)" or "UTF-8 bytes"
    entropy_rate = None

    @classmethod
    def load(cls, path: str | Path, *, vocab_size: int, length: int) -> "TokenFile":
        """The file's tokens, checked against the model's `vocab_size` and a sequence `length`
        (seq_len + 1 tokens a row): ModelError naming the problem and the fix."""
        path = Path(path)
        if not path.is_file():
            raise ModelError(f"--data {str(path)!r} does not exist (resolved to {path.resolve()}): give a .pt or "
                             f".npy file of token ids or a UTF-8 text file")
        suffix = path.suffix.lower()
        if suffix in (".pt", ".pth"):
            kind = "token ids (.pt)"
            try:
                loaded = torch.load(path, weights_only=True, map_location="cpu")
            except Exception as err:  # noqa: BLE001 - a corrupt file or a pickle that is not a tensor
                raise ModelError(f"--data {str(path)!r}: torch.load failed ({type(err).__name__}: {err}): save the "
                                 f"token ids with torch.save(tensor_of_ids, path)") from None
            if not isinstance(loaded, torch.Tensor):
                raise ModelError(f"--data {str(path)!r} holds a {type(loaded).__name__}, not a tensor: save the "
                                 f"token ids with torch.save(tensor_of_ids, path)")
            tokens = loaded
        elif suffix == ".npy":
            kind = "token ids (.npy)"
            try:
                array = np.load(path, allow_pickle=False)
            except Exception as err:  # noqa: BLE001
                raise ModelError(f"--data {str(path)!r}: numpy.load failed ({type(err).__name__}: {err}): save the "
                                 f"token ids with numpy.save(path, integer_array)") from None
            if not np.issubdtype(array.dtype, np.integer):
                raise ModelError(f"--data {str(path)!r} holds {array.dtype} values, not integer token ids: save "
                                 f"an integer array (e.g. array.astype(numpy.int64))")
            tokens = torch.from_numpy(array.astype(np.int64))
        else:
            kind = "UTF-8 bytes"
            raw = path.read_bytes()
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise ModelError(f"--data {str(path)!r} is neither .pt nor .npy and not UTF-8 text ({err}): give "
                                 f"token ids as a .pt or .npy file") from None
            tokens = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        if tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == torch.bool:
            raise ModelError(f"--data {str(path)!r} holds {tokens.dtype} values, not integer token ids: save "
                             f"tokens.long()")
        tokens = tokens.reshape(-1).to(torch.long)
        if tokens.numel() < length:
            raise ModelError(f"--data {str(path)!r} has {tokens.numel()} tokens, fewer than one sequence of "
                             f"{length} (seq_len + 1): give a longer file or a model with a shorter seq_len")
        low, high = int(tokens.min()), int(tokens.max())
        if low < 0 or high >= vocab_size:
            what = "byte values reach" if kind == "UTF-8 bytes" else "token ids reach"
            bad = low if low < 0 else high
            raise ModelError(f"--data {str(path)!r}: {what} {bad}, outside the model's vocabulary 0..{vocab_size - 1}"
                             f": use a model whose vocab_size is above {high}"
                             + (" (bytes need 256: --model small)" if kind == "UTF-8 bytes" else "")
                             + " or re-tokenize the data")
        return cls(str(path), tokens, kind)

    def batch(self, batch_size: int, length: int, generator: torch.Generator) -> torch.Tensor:
        """[batch_size, length] windows of the file at random offsets drawn from `generator`."""
        offsets = torch.randint(0, self.tokens.numel() - length + 1, (batch_size,), generator=generator)
        return torch.stack([self.tokens[offset:offset + length] for offset in offsets.tolist()])


def batches(config, steps: int, seed: int, *, data: TokenFile | None = None):
    """The data source and `steps` batches [batch_size, seq_len + 1] drawn from it (from seed + 1):
    every run of a comparison trains on these same tokens. `config`: anything with vocab_size,
    successors, seq_len and batch_size (a GPTConfig, a UserModelShape). The source is `data` when
    given, else the Markov source of config's vocabulary drawn from `seed`."""
    source = data if data is not None else MarkovSource.make(config.vocab_size, config.successors, seed)
    generator = torch.Generator().manual_seed(seed + 1)
    return source, [source.batch(config.batch_size, config.seq_len + 1, generator) for _ in range(steps)]


# ---- your own model ------------------------------------------------------------------------------

DEFAULT_USER_BATCH_SIZE = 8


def is_model_factory(name: str) -> bool:
    """`--model path.py:factory` or `package.module:factory`, not a built-in name."""
    return ":" in name


@dataclass(frozen=True)
class UserModelShape:
    """The data shape a user's model declares (see the module docstring)."""

    name: str
    vocab_size: int
    seq_len: int
    batch_size: int
    successors: int = 4

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len


def load_model_factory(spec: str) -> Callable[[], nn.Module]:
    """The factory named by `path.py:factory` (or `package.module:factory`); ModelError when it
    does not import, lacks the attribute or is not callable."""
    module_spec, _, attr = spec.rpartition(":")
    if not module_spec or not attr:
        raise ModelError(f"--model {spec!r}: write your own model as path/to/file.py:factory (factory: "
                         f"{FACTORY_PROTOCOL})")
    try:
        factory = import_target(module_spec, attr)
    except ImplError as err:
        raise ModelError(f"--model {spec!r}: {str(err).replace('implementation file', 'model file')}") from None
    if not callable(factory):
        raise ModelError(f"--model {spec!r}: {attr} is a {type(factory).__name__}, not callable; it must be "
                         f"{FACTORY_PROTOCOL}")
    return factory


def build_user_model(spec: str, seed: int) -> tuple[nn.Module, UserModelShape]:
    """factory() under torch.manual_seed(seed), checked against the protocol."""
    factory = load_model_factory(spec)
    with torch.random.fork_rng(devices=[]):  # the caller's generator state is left as it was
        torch.manual_seed(seed)
        try:
            model = factory()
        except Exception as err:  # noqa: BLE001 - whatever the factory raised, show it
            raise ModelError(f"--model {spec!r}: calling the factory raised {type(err).__name__}: {err}") from None
    if not isinstance(model, nn.Module):
        raise ModelError(f"--model {spec!r}: the factory returned a {type(model).__name__}, not an nn.Module; it "
                         f"must be {FACTORY_PROTOCOL}")
    values = {}
    for attribute, default in (("vocab_size", None), ("seq_len", None), ("batch_size", DEFAULT_USER_BATCH_SIZE)):
        value = getattr(model, attribute, default)
        if value is None:
            raise ModelError(f"--model {spec!r}: the model ({type(model).__name__}) has no attribute {attribute!r}: "
                             f"set model.{attribute} = ... in the factory (the protocol: {FACTORY_PROTOCOL})")
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ModelError(f"--model {spec!r}: model.{attribute} = {value!r} must be a positive int")
        values[attribute] = value
    if not any(isinstance(module, nn.Linear) for module in model.modules()):
        raise ModelError(f"--model {spec!r}: the model has no nn.Linear layer, so nothing is converted to FP8: "
                         f"build its matrix multiplies from nn.Linear")
    return model, UserModelShape(spec, **values)
