"""How a collective is cut into chunks and which reducer sums each chunk.

The plan depends only on the element count, the item size, the number of reducers, the chunk
size and the pipeline depth, so every rank computes the same one without talking (a rank
configured with another chunk size or depth is caught by the reducer as a mismatch). The chunks'
size comes from the reducers R (RS_PIPELINE_DEPTH chunks each at least); chunk k of collective
seq goes to endpoint (seq + k) mod E, where the E endpoints are the reducers' shards
(engine/endpoints.py; E = R when every reducer runs one): large buffers spread evenly, and small
ones rotate. When that endpoint is lost, the chunk goes to the first one not lost in its
preference order (`preference`), which every rank computes alike. Below, "reducer" means an
endpoint.
"""

from __future__ import annotations

from typing import List, NamedTuple, Tuple

from reduction_server.config.settings import DEFAULT_PIPELINE_DEPTH
from reduction_server.wire import protocol


class Chunk(NamedTuple):
    """One chunk of a collective: its bounds in elements, and the reducer that sums it."""

    offset: int
    count: int
    reducer: int


#: below this, a chunk is not split further to use more reducers (per-message cost dominates)
MIN_SPLIT_BYTES = 64 * 1024
_ALIGN_ELEMENTS = 64


def plan_chunks(
    total: int,
    itemsize: int,
    num_reducers: int,
    chunk_bytes: int,
    depth: int = DEFAULT_PIPELINE_DEPTH,
    block: int = 0,
) -> List[Tuple[int, int]]:
    """[(offset, count), ...] in elements, covering 0..total in order; with `block` (int8 blocks
    of that many elements), every chunk but the last is whole blocks, at least one."""
    if total <= 0:
        return []
    largest = max(1, chunk_bytes // itemsize)
    # A buffer a little over one chunk would leave reducers idle and unpipelined: give every
    # reducer `depth` chunks, but not pieces smaller than MIN_SPLIT_BYTES.
    even = -(-total // (num_reducers * depth))
    size = min(largest, max(even, MIN_SPLIT_BYTES // itemsize))
    if block:  # a chunk starts on a block boundary (whatever chunk_bytes says)
        size = max(block, size - size % block)
    elif size > _ALIGN_ELEMENTS:
        size -= size % _ALIGN_ELEMENTS  # chunk starts stay cache-line aligned
    return [(offset, min(size, total - offset)) for offset in range(0, total, size)]


def largest_frame_bytes(chunk_bytes: int) -> int:
    """The largest frame a reducer sends a worker whose chunks are at most `chunk_bytes`: the
    RESULT of plan_chunks' largest chunk (of the widest dtype), or a message that carries no
    chunk. The worker's ZMQ_MAXMSGSIZE: whatever sends more is cut off before it is buffered."""
    return max(chunk_bytes, max(protocol.ITEMSIZE.values()), protocol.MAX_CONTROL_PAYLOAD)


def reducer_of(seq: int, chunk: int, num_reducers: int) -> int:
    """The reducer that sums chunk `chunk` of collective `seq`: (seq + chunk) mod num_reducers."""
    return (seq + chunk) % num_reducers


def preference(seq: int, chunk: int, active: int, spares: int = 0) -> List[int]:
    """The reducers that may sum chunk `chunk` of collective `seq`, in order: its own
    (reducer_of over the `active` reducers), then the spares (RS_SPARE_REDUCERS, listed after
    them), then the other active reducers, each list starting one further along for each turn
    the position comes round, so that a lost reducer's chunks spread over the rest (evenly,
    over many collectives). The first reducer not lost is the chunk's; a chunk on a reducer
    still up never moves when another one is lost."""
    position = seq + chunk
    own = position % active
    others = active - 1
    turn = position // active
    return (
        [own]
        + [active + (own + turn + j) % spares for j in range(spares)]
        + [(own + 1 + (turn + j) % others) % active for j in range(others)]
    )


def plan(seq: int, spans: List[Tuple[int, int]], num_reducers: int) -> List[Chunk]:
    """Collective seq's chunks (the spans plan_chunks gave), each with its reducer: the one
    plan the engine follows."""
    return [Chunk(offset, count, reducer_of(seq, k, num_reducers)) for k, (offset, count) in enumerate(spans)]
