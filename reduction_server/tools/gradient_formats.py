"""Bytes on the wire per gradient element, by format: what `--compression` chooses. A gradient
is counted in float32 elements (`--mib`, the model catalogue); a format says how many bytes each
element takes on the wire: int8 blocks take a byte an element and a float32 scale a block of
RS_INT8_BLOCK's default (wire/formats.py, docs/protocol.md "Formats")."""

from __future__ import annotations

from typing import Dict, NamedTuple

from ..config.settings import DEFAULT_INT8_BLOCK
from ..errors import ConfigError
from ..wire.formats import SCALE_BYTES


class Format(NamedTuple):
    """One wire format: its name (as `--compression` spells it) and bytes per element (on
    average: int8 blocks' scales are shared by their elements)."""

    name: str
    itemsize: float
    meaning: str


FORMATS: Dict[str, Format] = {
    f.name: f
    for f in (
        Format("none", 4, "float32 on the wire"),
        Format(
            "fp16", 2, "16-bit floats on the wire (hvd.Compression.fp16, bfloat16 alike); the reducers sum in float32"
        ),
        Format(
            "int8",
            1 + SCALE_BYTES / DEFAULT_INT8_BLOCK,
            f"int8 blocks of {DEFAULT_INT8_BLOCK} elements with a float32 scale each, both ways, as "
            "compression='int8' and the int8 hook send them; the reducers sum in float32",
        ),
    )
}


def wire_format(name: str) -> Format:
    """The format called `name`; an unknown one is refused naming the known."""
    try:
        return FORMATS[name]
    except KeyError:
        raise ConfigError(f"unknown --compression {name!r}; choose from {', '.join(FORMATS)}") from None
