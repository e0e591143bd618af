"""What each rank gets of a collective, by Horovod's rules, for every framework: reducescatter's
share of the rows, alltoall's splits, and how an integer average is taken."""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple, Type

from reduction_server.wire.protocol import ReduceOp


def piece(rows: int, rank: int, size: int) -> Tuple[int, int]:
    """(first row, rows) of rank's share of `rows` rows, as Horovod divides them: the first
    rows % size ranks take one more."""
    base, extra = divmod(rows, size)
    return rank * base + min(rank, extra), base + (rank < extra)


def splits(rows: int, given: Optional[Sequence[int]], size: int, error: Type[Exception] = ValueError) -> List[int]:
    """alltoall's rows for each of `size` ranks: `given`, checked, or equal shares when it is
    None or empty; `error` (with Horovod's meaning) when they cannot be."""
    if not given:
        if rows % size:
            raise error(
                f"alltoall without splits divides the first dimension ({rows}) equally among the {size} "
                "ranks; it does not divide"
            )
        return [rows // size] * size
    counts = [int(v) for v in given]
    if len(counts) != size or min(counts) < 0 or sum(counts) > rows:
        raise error(
            f"alltoall's splits {counts} must give each of the {size} ranks a number of rows, none negative, "
            f"adding up to at most the first dimension ({rows})"
        )
    return counts


def reduction(op: ReduceOp, integer: bool, postscale: float, size: int) -> Tuple[ReduceOp, float]:
    """(the op to send, the postscale to apply after): an integer average is summed and then
    scaled by postscale / size in float64, as Horovod does, where the reducers' integer average
    would truncate before the postscale."""
    return (ReduceOp.SUM, postscale / size) if integer and op is ReduceOp.AVG else (op, postscale)
