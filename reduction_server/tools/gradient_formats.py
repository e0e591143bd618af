"""Bytes on the wire per gradient element, by format: what `--compression` chooses. A gradient
is counted in float32 elements (`--mib`, the model catalogue); a format says how many bytes each
element takes on the wire. The compression formats of later releases are more rows here."""

from __future__ import annotations

from typing import Dict, NamedTuple

from ..errors import ConfigError


class Format(NamedTuple):
    """One wire format: its name (as `--compression` spells it) and bytes per element."""

    name: str
    itemsize: int
    meaning: str


FORMATS: Dict[str, Format] = {
    f.name: f
    for f in (
        Format("none", 4, "float32 on the wire"),
        Format(
            "fp16", 2, "16-bit floats on the wire (hvd.Compression.fp16, bfloat16 alike); the reducers sum in float32"
        ),
    )
}


def wire_format(name: str) -> Format:
    """The format called `name`; an unknown one is refused naming the known."""
    try:
        return FORMATS[name]
    except KeyError:
        raise ConfigError(f"unknown --compression {name!r}; choose from {', '.join(FORMATS)}") from None
