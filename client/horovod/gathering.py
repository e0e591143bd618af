"""The collectives that move rows between ranks, allgather and alltoall, as one byte-exact
all-reduce: each rank writes its rows at its own offset in a zero buffer, the reducers sum it
(the other ranks add zeros), and each rank reads what it asked for. Exact for every dtype."""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, List, Tuple

import numpy as np

from .requests import ALLTOALL, Request

#: (the zero-filled buffer with this rank's rows in place, what makes the result of it once summed)
Plan = Tuple[np.ndarray, Callable[[], Any]]


def _row_bytes(request: Request) -> int:
    return math.prod(request.shape[1:]) * request.dtype.itemsize


def plan(request: Request, send: memoryview, requests: Dict[int, Request], rank: int) -> Plan:
    """The buffer and finishing step of this rank's allgather or alltoall, given every rank's
    request (`requests`, by rank: every rank of the collective)."""
    sizes = [requests[r].rows * _row_bytes(requests[r]) for r in range(len(requests))]
    ends = np.cumsum(sizes)
    buf = np.zeros(int(ends[-1]) if sizes else 0, np.uint8)
    start = int(ends[rank]) - sizes[rank]
    buf[start : start + sizes[rank]] = np.frombuffer(send, np.uint8)
    if request.kind == ALLTOALL:
        return buf, lambda: _received(buf, requests, rank, ends, sizes)
    rows = sum(requests[r].rows for r in range(len(requests)))
    shape = (rows, *request.shape[1:])
    return buf, lambda: buf.view(request.dtype.storage).reshape(shape)


def _received(
    buf: np.ndarray, requests: Dict[int, Request], rank: int, ends: np.ndarray, sizes: List[int]
) -> Tuple[np.ndarray, List[int]]:
    """alltoall: (the rows every rank sent to this one, in rank order; how many from each)."""
    row = _row_bytes(requests[rank])
    pieces, counts = [], []
    for src in range(len(requests)):
        splits = requests[src].splits
        first = int(ends[src]) - sizes[src] + sum(splits[:rank]) * row
        pieces.append(buf[first : first + splits[rank] * row])
        counts.append(splits[rank])
    mine = requests[rank]
    joined = np.concatenate(pieces)
    return joined.view(mine.dtype.storage).reshape(sum(counts), *mine.shape[1:]), counts
