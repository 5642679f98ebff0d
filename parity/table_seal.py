"""A results table's seal: its row count and checksum, carried in its own gzip header.

Why: a table cut in half and gzipped again, or a CSV cut at a line break, is a valid table of
fewer rows, and a verdict over it reads PASS (issue 29: half a FAIL table rendered "PASS ... 38/38
comparisons"). The gzip trailer's CRC only covers what was compressed, so a re-compressed part
passes it. fp8-parity therefore writes every table (parity.results_file.encoded) as one gzip member
whose header comment (FCOMMENT, RFC 1952) reads

    fp8-parity results table: rows=1110 sha256=<hex digest of the CSV bytes>

and a reader that finds the seal checks both. The seal travels with the file (a table copied out
of its report folder, `check --results`, a sweep's partial table); `gzip -d`, pandas and every other
reader ignore the comment. A table without a seal (written before it existed, re-compressed, a
plain CSV) cannot be told complete: `unseal` says so and its callers decide (`report` refuses it
unless --unverified).

    seal(csv_bytes, rows)      the gzip file's bytes
    unseal(data)               Unsealed(csv, seal or None), or SealError saying what is wrong
"""

from __future__ import annotations

import hashlib
import re
import struct
import zlib
from dataclasses import dataclass

GZIP_MAGIC = b"\x1f\x8b"
_DEFLATE, _FTEXT, _FHCRC, _FEXTRA, _FNAME, _FCOMMENT = 8, 0x01, 0x02, 0x04, 0x08, 0x10
_UNKNOWN_OS, _BEST_COMPRESSION = 255, 2  # the header bytes gzip.compress(level 9, mtime=0) writes
PREFIX = "fp8-parity results table: "
_SEAL = re.compile(r"^fp8-parity results table: rows=(\d+) sha256=([0-9a-f]{64})$")


class SealError(ValueError):
    """The bytes are not one whole gzip member, or their seal does not match them: the message says which."""


class SealMismatch(SealError):
    """A whole gzip member whose rows are not the ones its seal describes: the table was changed."""


@dataclass(frozen=True)
class Seal:
    """What the writer of a table recorded: its number of data rows and the SHA-256 of its CSV bytes."""

    rows: int
    sha256: str

    @property
    def comment(self) -> str:
        return f"{PREFIX}rows={self.rows} sha256={self.sha256}"

    @classmethod
    def of(cls, csv: bytes, rows: int) -> "Seal":
        return cls(rows, hashlib.sha256(csv).hexdigest())


@dataclass(frozen=True)
class Unsealed:
    """A table's CSV bytes and its seal (None: the file carries none)."""

    csv: bytes
    seal: Seal | None


def seal(csv: bytes, rows: int) -> bytes:
    """`csv` (a table of `rows` data rows) as one gzip member whose header comment is its seal. Without a
    timestamp: the same rows give the same bytes."""
    comment = Seal.of(csv, rows).comment.encode("ascii")
    header = GZIP_MAGIC + bytes([_DEFLATE, _FCOMMENT]) + struct.pack("<I", 0) + bytes([_BEST_COMPRESSION, _UNKNOWN_OS])
    compressor = zlib.compressobj(9, zlib.DEFLATED, -zlib.MAX_WBITS)
    body = compressor.compress(csv) + compressor.flush()
    return header + comment + b"\0" + body + struct.pack("<II", zlib.crc32(csv), len(csv) & 0xFFFFFFFF)


def unseal(data: bytes) -> Unsealed:
    """The CSV bytes of a gzip file of one member, and its seal if it has one (checked against the bytes).
    SealError when it is not gzip, is cut short, fails its CRC, holds more than one member (files
    concatenated: a reader would take the second's header for rows), or its seal does not match."""
    if not data.startswith(GZIP_MAGIC):
        raise SealError(f"Not a gzipped file ({data[:2]!r})")
    if len(data) < 10 or data[2] != _DEFLATE:
        raise SealError("Compressed file ended before the end-of-stream marker was reached" if len(data) < 10
                        else f"unknown compression method {data[2]}")
    flags, position, comment = data[3], 10, None
    try:
        if flags & _FEXTRA:
            position += 2 + struct.unpack("<H", data[position:position + 2])[0]
        if flags & _FNAME:
            position = data.index(b"\0", position) + 1
        if flags & _FCOMMENT:
            end = data.index(b"\0", position)
            comment, position = data[position:end].decode("latin-1"), end + 1
    except (ValueError, struct.error):
        raise SealError("Compressed file ended before the end-of-stream marker was reached") from None
    if flags & _FHCRC:
        position += 2
    csv, rest = _inflate(data[position:])
    if rest.strip(b"\0"):
        raise SealError("it holds more than one gzip member (files concatenated one after another?); fp8-parity "
                        "writes a table as one")
    return Unsealed(csv, _checked_seal(comment, csv))


def _inflate(stream: bytes) -> tuple[bytes, bytes]:
    """The data of one raw deflate stream and its gzip trailer, checked; and what follows the trailer."""
    inflater = zlib.decompressobj(-zlib.MAX_WBITS)
    try:
        csv = inflater.decompress(stream)
    except zlib.error as err:
        raise SealError(str(err)) from None
    trailer = inflater.unused_data
    if not inflater.eof or len(trailer) < 8:
        raise SealError("Compressed file ended before the end-of-stream marker was reached")
    crc, size = struct.unpack("<II", trailer[:8])
    if crc != zlib.crc32(csv) or size != len(csv) & 0xFFFFFFFF:
        raise SealError("CRC check failed: the data differs from what was compressed")
    return csv, trailer[8:]


def _checked_seal(comment: str | None, csv: bytes) -> Seal | None:
    """The seal in the header comment, checked against the CSV bytes; None when there is no seal."""
    if comment is None or not comment.startswith(PREFIX):
        return None
    found = _SEAL.match(comment)
    if not found:
        raise SealError(f"its seal {comment[:120]!r} cannot be read")
    recorded = Seal(int(found.group(1)), found.group(2))
    if Seal.of(csv, recorded.rows) != recorded:
        raise SealMismatch("its rows differ from the checksum fp8-parity wrote in its header (edited, or cut and "
                           "compressed again with the header kept)")
    return recorded
