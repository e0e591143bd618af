"""The formats a chunk travels in (docs/protocol.md, "Formats"): its element type, or block-scaled
int8, each way.

The header's dtype byte names the format up (what the workers send) in its low four bits and the
format down (the result) in its high four: 0 there means the same as up, so an element type's own
code (0-9, NCCL's numbering) is the format both ways, as it always was. Block-scaled int8
(INT8_BLOCK) travels as blocks of B elements, each a float32 scale and B int8 values; a
contribution in it is decoded into a float32 accumulator, and the result goes back as float32,
bfloat16, float16 or int8 blocks again. B is the sender's RS_INT8_BLOCK, a power of two; it is not in
the header: a receiver derives it from the element count and the payload's size (block_of).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional

from ..config.settings import MAX_INT8_BLOCK as MAX_BLOCK
from ..config.settings import MIN_INT8_BLOCK as MIN_BLOCK

#: block-scaled int8: per block of B elements a little-endian float32 scale, then B int8 values
INT8_BLOCK = 12
_FLOAT16, _FLOAT32, _BFLOAT16 = 6, 7, 9  # DType's codes (protocol.py), which imports this module
#: the formats a result of INT8_BLOCK contributions may go back in
INT8_RESULTS = (INT8_BLOCK, _FLOAT32, _BFLOAT16, _FLOAT16)
SCALE_BYTES = 4
_NAMES = {INT8_BLOCK: "int8", _FLOAT32: "float32", _BFLOAT16: "bfloat16", _FLOAT16: "float16"}


@dataclass(frozen=True)
class WireFormat:
    """A compressed format pair: the header's dtype byte, the formats up and down."""

    code: int
    up: int
    down: int

    @property
    def name(self) -> str:
        """As error messages say it: "int8 blocks up, bfloat16 down"."""
        return f"{_NAMES[self.up]} blocks up, {_NAMES[self.down]}{' blocks' if self.down == INT8_BLOCK else ''} down"


def format_code(up: int, down: int) -> int:
    """The header's dtype byte for `up` and `down` (codes: a DType's, or INT8_BLOCK)."""
    return up | (0 if down == up else down << 4)


#: every compressed dtype byte a header may carry, by code; an element type's code is not here
COMPRESSED: Dict[int, WireFormat] = {
    format_code(INT8_BLOCK, down): WireFormat(format_code(INT8_BLOCK, down), INT8_BLOCK, down) for down in INT8_RESULTS
}


def block_bytes(count: int, block: int) -> int:
    """Bytes of `count` elements as int8 blocks of `block` (the last one may be shorter)."""
    return count + SCALE_BYTES * -(-count // block)


def block_of(count: int, nbytes: int) -> Optional[int]:
    """The block size B that makes `count` elements `nbytes` bytes of int8 blocks, or None. With
    B a power of two it is unique when there are two blocks or more; one block (count <= B) reads
    the same whatever B, and count itself (rounded up to a power of two) is returned."""
    blocks, rest = divmod(nbytes - count, SCALE_BYTES)
    if count <= 0 or rest or blocks < 1 or blocks > count:
        return None
    block = max(MIN_BLOCK, 1 << (-(-count // blocks) - 1).bit_length())
    if -(-count // block) != blocks or (blocks > 1 and block > MAX_BLOCK):
        return None
    return block


def span(code: int, itemsize: int, block: int, offset: int, count: int) -> slice:
    """The bytes of elements offset..offset+count of a buffer in format `code` (a DType of
    `itemsize` bytes, or INT8_BLOCK with its block size; offset falls on a block boundary)."""
    if code == INT8_BLOCK:
        start = offset // block * (block + SCALE_BYTES)
        return slice(start, start + block_bytes(count, block))
    return slice(offset * itemsize, (offset + count) * itemsize)
