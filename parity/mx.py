"""Microscaling formats, exactly: MXFP8 (OCP MX v1.0) and NVFP4 (NVIDIA), the casts and the scale layouts.

What a microscaled operand is
-----------------------------
A block-scaled cast gives every short run of consecutive elements along a GEMM's contraction
dimension its own scale, so an outlier spoils only its block:

    MXFP8   blocks of 32; elements float8_e4m3fn (max 448); one E8M0 scale per block: a bare
            power of two 2^e, stored as the byte e + 127 (no sign, no mantissa, no zero; the byte
            0xFF is NaN). torch calls the byte torch.float8_e8m0fnu.
    NVFP4   blocks of 16; elements FP4 E2M1 (0, 0.5, 1, 1.5, 2, 3, 4, 6 and negatives), two per
            byte (torch.float4_e2m1fn_x2, the element of lower index in the low nibble); one
            E4M3 scale per block times one float32 scale per tensor (two levels: the E4M3 block
            scale alone cannot span a tensor's range).

The decoded value of an element is q * scale (MXFP8: q * 2^e; NVFP4: q * s * global).

How the scale is chosen (the contract of this session: /work/wt/MX-SPEC.md)
----------------------------------------------------------------------------
For a block x (upcast to float32), amax = max |x_i|.

    FLOOR   OCP MX v1.0, section 6.3: e = floor(log2(amax)) - 8, 8 being the largest exponent of
            e4m3 (448 = 1.75 * 2^8). The block's largest element lands in [256, 512) after
            scaling, so one with a mantissa above 1.75 saturates to 448 (the spec accepts that).
    RCEIL   cuBLAS and Blackwell's cast (cvt.rp.ue8m0): e is the smallest integer with
            2^e >= amax / 448, the quotient computed in float32. Nothing saturates.

Both clamp e to [-127, 127]; amax 0 gives e = -127; a block holding a NaN (or an Inf: e4m3fn has
none) gets the NaN scale 0xFF, and every element of it decodes to NaN. The elements are
e4m3(x_i / 2^e), rounded to nearest even, saturating at +-448.

NVFP4: global = amax_tensor / (448 * 6) in float32 (1.0 for an all-zero tensor), a decode scale;
s = e4m3(amax_block / 6 / global), the quotients in float32 left to right, rounded to nearest even
and saturating at 448; the block's decode scale is s * global in float32, and the elements are
e2m1(x_i / (s * global)), the quotient in float32, rounded to nearest even, saturating at +-6 (a
block with s == 0 gives zeros).

Everything here is computed exactly: exponents from frexp of float64 copies of float32 numbers,
and each float32 quotient the contract names as torch's correctly rounded float32 division.

The scale layout cuBLAS takes on SM100 ("swizzled", cuBLAS's 1-D block scaling factor layout)
-----------------------------------------------------------------------------------------------
The scales of an operand [rows, K] form S [rows, K / block]. S is padded with zeros to
[round_up(rows, 128), round_up(K / block, 4)] and cut into 128 x 4 tiles, tile (i, j) covering rows
128i.. and scale columns 4j..; inside a tile the scale (r, c) sits at byte (r % 32) * 16 +
(r // 32) * 4 + c of the tile's 512; the tiles follow each other row of tiles by row of tiles.
`swizzled` and `unswizzled` map S to and from that flat layout.

parity.oracles runs these casts as CastStages (its `mx_stages`), so the hypotheses of
parity.mx_mistakes can change one stage at a time, as parity.mistakes does for the other recipes.
"""

from __future__ import annotations

import torch

from parity.vocabulary import Word

MX_BLOCK = 32  # MXFP8's block
NVFP4_BLOCK = 16  # NVFP4's block
E8M0_BIAS = 127
E8M0_NAN = 0xFF
E8M0_MIN_EXPONENT, E8M0_MAX_EXPONENT = -127, 127
E4M3_MAX = 448.0
E4M3_EMAX = 8  # the exponent of e4m3's largest binade (448 = 1.75 * 2^8)
E2M1_MAX = 6.0
NVFP4_GLOBAL_DIVISOR = E4M3_MAX * E2M1_MAX  # 2688: a block at the tensor's amax gets s = 448
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # the magnitude of codes 0..7; bit 3 is the sign
SCALE_TILE_ROWS, SCALE_TILE_COLUMNS = 128, 4  # the swizzled layout's tile of scales


class BlockMisfit(RuntimeError):
    """An operand whose inner dim is not a whole number of blocks: MX-SPEC.md casts whole blocks only (a
    RuntimeError, as a tile that does not divide an operand is elsewhere in parity.oracles)."""


def check_whole_blocks(inner: int, block: int) -> None:
    if inner % block:
        raise BlockMisfit(f"a microscaled cast takes whole blocks of {block} along the inner dim, got {inner} "
                          f"elements ({inner % block} left over): pad it to {-(-inner // block) * block}")


class ScaleRule(Word):
    """How an MXFP8 cast picks its power-of-two scale from a block's amax."""

    FLOOR = "floor"  # OCP MX v1.0: floor(log2(amax)) - 8
    RCEIL = "rceil"  # cuBLAS / cvt.rp.ue8m0: the smallest 2^e >= amax / 448 (float32 quotient)


# ---- E8M0 -------------------------------------------------------------------------------------------

def _binade(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(p, power): x = m * 2^p with 0.5 <= m < 1, and whether x is a power of two (m == 0.5); x > 0, float64."""
    mantissa, exponent = torch.frexp(x)
    return exponent.to(torch.float64), mantissa == 0.5


def e8m0_exponent(amax: torch.Tensor, rule: ScaleRule | str) -> torch.Tensor:
    """The unbiased exponent e (float64) of each block's E8M0 scale from its float32 amax, NaN where the
    block holds a NaN or an Inf (its scale is the NaN byte)."""
    rule = ScaleRule(rule)
    amax32 = amax.to(torch.float32)
    if rule is ScaleRule.FLOOR:
        p, _ = _binade(amax32.to(torch.float64))
        exponent = (p - 1) - E4M3_EMAX  # floor(log2(amax)) = p - 1 for amax in [2^(p-1), 2^p)
        positive = amax32 > 0
    else:
        descale = (amax32 / torch.tensor(E4M3_MAX, dtype=torch.float32)).to(torch.float64)  # float32 quotient
        p, power = _binade(descale)
        exponent = torch.where(power, p - 1, p)  # the smallest e with 2^e >= descale
        positive = descale > 0
    exponent = torch.where(positive, exponent, torch.full_like(exponent, E8M0_MIN_EXPONENT))
    exponent = exponent.clamp(E8M0_MIN_EXPONENT, E8M0_MAX_EXPONENT)
    return torch.where(amax32.isfinite(), exponent, torch.full_like(exponent, float("nan")))


def e8m0_bytes(exponent: torch.Tensor) -> torch.Tensor:
    """The stored bytes (uint8) of unbiased exponents, NaN -> 0xFF."""
    biased = torch.where(exponent.isnan(), torch.full_like(exponent, E8M0_NAN), exponent + E8M0_BIAS)
    return biased.to(torch.uint8)


def e8m0_values(codes: torch.Tensor) -> torch.Tensor:
    """What E8M0 bytes (uint8 or torch.float8_e8m0fnu) decode to: 2^(byte - 127), NaN for 0xFF (float64)."""
    raw = codes.view(torch.uint8) if codes.dtype == torch.float8_e8m0fnu else codes
    biased = raw.to(torch.float64)
    return torch.where(biased == E8M0_NAN, torch.full_like(biased, float("nan")), torch.exp2(biased - E8M0_BIAS))


def e8m0_bytes_of(inverse_scales: torch.Tensor) -> torch.Tensor:
    """The E8M0 bytes of decode scales 2^e (float64, as parity.oracles' Quantized.inv_scale holds them), NaN -> 0xFF."""
    exponent, _ = _binade(inverse_scales.to(torch.float64))
    return e8m0_bytes(torch.where(inverse_scales.isnan(), inverse_scales, exponent - 1))


def mxfp8_scale(amax: torch.Tensor, fp8_max: float = E4M3_MAX, *, rule: ScaleRule | str = ScaleRule.RCEIL,
                **rounding) -> torch.Tensor:
    """parity.oracles' `scale` stage for a 1x32 cast: the float32 multiplier 2^-e of each block (NaN for a
    NaN block), from its amax. `fp8_max` and the float8 recipes' rounding keywords are not used: the scale is
    a power of two by the rule (they are in the signature so parity.mistakes' transforms compose)."""
    return torch.exp2(-e8m0_exponent(amax, rule)).to(torch.float32)


# ---- NVFP4 --------------------------------------------------------------------------------------------

def grid_quantum(x: torch.Tensor, mantissa_bits: int, min_exponent: int) -> torch.Tensor:
    """The spacing (float64) of a binary float format's values around each of `x`'s: 2^(binade - mantissa bits),
    the subnormals sharing the lowest binade's (e4m3: 3 bits, binades from -6; e2m1: 1 bit, from 0)."""
    _, exponent = torch.frexp(x)  # x = m * 2**exponent with 0.5 <= |m| < 1
    return torch.exp2((torch.clamp(exponent - 1, min=min_exponent) - mantissa_bits).to(torch.float64))


def round_e4m3(x: torch.Tensor) -> torch.Tensor:
    """float64 values rounded to nearest even onto e4m3 (float8_e4m3fn), saturating at 448 (NaN stays)."""
    clamped = x.clamp(-E4M3_MAX, E4M3_MAX)
    quantum = grid_quantum(clamped, 3, -6)
    return torch.round(clamped / quantum) * quantum


def nvfp4_global_scale(amax_tensor: torch.Tensor, *, divisor: float = NVFP4_GLOBAL_DIVISOR) -> torch.Tensor:
    """The per-tensor decode scale amax / (448 * 6) in float32 (a 0-dim tensor); 1.0 for an all-zero tensor.
    (`divisor`: another one, for the mistakes that aim it elsewhere.)"""
    amax32 = amax_tensor.to(torch.float32).reshape(())
    global_ = amax32 / torch.tensor(divisor, dtype=torch.float32)
    return torch.where(amax32 == 0, torch.ones_like(global_), global_)


def nvfp4_block_quotient(amax_block: torch.Tensor, global_: torch.Tensor) -> torch.Tensor:
    """amax_block / 6 / global, the two quotients in float32: a block scale before its e4m3 rounding."""
    per_block = amax_block.to(torch.float32) / torch.tensor(E2M1_MAX, dtype=torch.float32)
    return per_block / global_.to(torch.float32)


def nvfp4_block_scales(amax_block: torch.Tensor, global_: torch.Tensor) -> torch.Tensor:
    """s = e4m3(amax_block / 6 / global), the two quotients in float32, as float64 e4m3 values."""
    return round_e4m3(nvfp4_block_quotient(amax_block, global_).to(torch.float64))


def nvfp4_scale(amax: torch.Tensor, fp8_max: float = E2M1_MAX, **rounding) -> torch.Tensor:
    """parity.oracles' `scale` stage for a 1x16 cast: each block's decode scale s * global, exact in float64
    (s has 4 significant bits, global 24), from the block amaxes [rows, blocks] (their max is the tensor's
    amax). Unlike the float8 stages this is the decode scale, not a multiplier: `scaled` divides by it."""
    global_ = nvfp4_global_scale(amax.max())
    return nvfp4_block_scales(amax, global_) * global_.to(torch.float64)


def divided_by_decode_scale(groups: torch.Tensor, decode: torch.Tensor) -> torch.Tensor:
    """parity.oracles' `scaled` stage for a 1x16 cast: x / (s * global), the decode scale rounded to
    float32 and the quotient in float32. A block whose scale is 0 gives zeros (not 0/0)."""
    decode32 = decode.to(torch.float32)[:, None, :, None]
    quotient = groups.to(torch.float32) / decode32
    return torch.where(decode32 == 0, torch.zeros_like(quotient), quotient)


def unchanged(scale: torch.Tensor) -> torch.Tensor:
    """parity.oracles' `inverse` stage for a 1x16 cast: the decode scale is already what the GEMM applies."""
    return scale


# ---- E2M1 codes and packing --------------------------------------------------------------------------

_GRID = torch.tensor(E2M1_GRID, dtype=torch.float64)


def e2m1_codes(values: torch.Tensor) -> torch.Tensor:
    """4-bit codes (uint8, 0..15) of values on the e2m1 grid (sign in bit 3; -0 is code 8)."""
    magnitude = values.abs().to(torch.float64)
    codes = (magnitude[..., None] == _GRID).to(torch.uint8).argmax(-1).to(torch.uint8)
    if not bool((_GRID[codes.long()] == magnitude).all()):
        raise ValueError("e2m1_codes: a value is not on the e2m1 grid (round it first)")
    return codes | (torch.signbit(values).to(torch.uint8) << 3)


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """What 4-bit e2m1 codes decode to (float64)."""
    magnitude = _GRID[(codes & 7).long()]
    return torch.where((codes & 8) > 0, -magnitude, magnitude)


def pack_e2m1(values: torch.Tensor) -> torch.Tensor:
    """e2m1 values [rows, inner] (inner even) packed two per byte, element 2j in the low nibble:
    [rows, inner / 2] torch.float4_e2m1fn_x2."""
    codes = e2m1_codes(values)
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).view(torch.float4_e2m1fn_x2)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """Packed e2m1 [rows, cols] (float4_e2m1fn_x2 or uint8) as float64 values [rows, 2 * cols]."""
    raw = packed.contiguous().view(torch.uint8) if packed.dtype != torch.uint8 else packed
    pairs = torch.stack([e2m1_values(raw & 0xF), e2m1_values(raw >> 4)], dim=-1)
    return pairs.reshape(*raw.shape[:-1], raw.shape[-1] * 2)


# ---- the swizzled (blocked) scale layout -------------------------------------------------------------

def padded_scale_shape(rows: int, columns: int) -> tuple[int, int]:
    """[rows, columns] of scales padded to whole 128x4 tiles."""
    return -(-rows // SCALE_TILE_ROWS) * SCALE_TILE_ROWS, -(-columns // SCALE_TILE_COLUMNS) * SCALE_TILE_COLUMNS


def swizzle_positions(rows: int, columns: int) -> torch.Tensor:
    """Where each scale (r, c) of a padded grid [rows, columns] (whole tiles) goes in the flat swizzled layout."""
    r = torch.arange(rows)[:, None]
    c = torch.arange(columns)[None, :]
    tile = (r // SCALE_TILE_ROWS) * (columns // SCALE_TILE_COLUMNS) + c // SCALE_TILE_COLUMNS
    inside = r % SCALE_TILE_ROWS
    return tile * 512 + (inside % 32) * 16 + (inside // 32) * 4 + c % SCALE_TILE_COLUMNS


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A one-byte tensor (float8, e8m0) viewed as uint8, which indexing takes; others as they are."""
    return tensor.view(torch.uint8) if tensor.element_size() == 1 and tensor.dtype != torch.uint8 else tensor


def swizzled(scales: torch.Tensor, padding: float = 0) -> torch.Tensor:
    """Scales S [rows, columns] in cuBLAS's swizzled layout: padded to whole 128x4 tiles with `padding` (byte 0
    for stored scales; for decoded ones, what byte 0 decodes to: PADDING_DECODED), flat (1-D,
    round_up(rows, 128) * round_up(columns, 4) entries), S's dtype."""
    rows, columns = padded_scale_shape(*scales.shape)
    raw = _as_bytes(scales.contiguous())
    padded = torch.full((rows, columns), padding, dtype=raw.dtype, device=raw.device)
    padded[: scales.shape[0], : scales.shape[1]] = raw
    flat = padded.new_zeros(rows * columns)
    flat[swizzle_positions(rows, columns).reshape(-1)] = padded.reshape(-1)
    return flat.view(scales.dtype)


# What a scale byte of 0 (the swizzled layout's padding, or a scale never written) decodes to, by the element
# format: E8M0's 2^-127 for MXFP8's e4m3 elements, NVFP4's E4M3 zero for its e2m1 ones
PADDING_DECODED = {torch.float8_e4m3fn: 2.0 ** -127, torch.float4_e2m1fn_x2: 0.0}


def unswizzled(flat: torch.Tensor, rows: int, columns: int) -> torch.Tensor:
    """The scales S [rows, columns] read back from a swizzled tensor (any shape holding the padded grid's
    entries, in order); a ValueError where it holds another number of entries."""
    padded_rows, padded_columns = padded_scale_shape(rows, columns)
    values = flat.reshape(-1)
    if values.numel() != padded_rows * padded_columns:
        raise ValueError(f"a swizzled grid of {rows}x{columns} scales has {padded_rows * padded_columns} entries "
                         f"({padded_rows}x{padded_columns} padded), got {values.numel()}")
    positions = swizzle_positions(padded_rows, padded_columns)
    grid = _as_bytes(values.contiguous())[positions.reshape(-1)].reshape(padded_rows, padded_columns)
    return grid[:rows, :columns].contiguous().view(flat.dtype)
