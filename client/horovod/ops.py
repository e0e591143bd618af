"""Horovod's reduction ops (hvd.Average, hvd.Sum, ...) and how they map onto the protocol's."""

from __future__ import annotations

from typing import Any, Optional

from reduction_server.errors import ConfigError
from reduction_server.wire.protocol import ReduceOp

# Horovod's numbering, so scripts that compare or store them keep working.
Average, Sum, Adasum, Min, Max, Product = 0, 1, 2, 3, 4, 5

_PROTOCOL = {Average: ReduceOp.AVG, Sum: ReduceOp.SUM, Min: ReduceOp.MIN, Max: ReduceOp.MAX, Product: ReduceOp.PROD}
_NAMES = {Average: "Average", Sum: "Sum", Adasum: "Adasum", Min: "Min", Max: "Max", Product: "Product"}


class AdasumUnsupported(ConfigError, NotImplementedError):
    """hvd.Adasum asked for: a ConfigError (a setting this server cannot take), and the
    NotImplementedError Horovod raises where it cannot run Adasum (sparse tensors, non-global
    process sets), which Horovod's scripts and tests catch."""


def resolve_op(op: Optional[Any], average: Optional[bool] = None) -> ReduceOp:
    """The protocol op for Horovod's (op, average) arguments: op wins; the deprecated `average`
    flag picks Average or Sum; neither means Average, as in Horovod."""
    if op is not None and average is not None:
        raise ValueError("give op or the deprecated average argument, not both")
    if op is None:
        op = Sum if average is False else Average
    if op == Adasum:
        raise AdasumUnsupported(
            "hvd.Adasum is not supported by the reduction server (it needs pairwise "
            "exchanges between workers); use hvd.Average or hvd.Sum"
        )
    try:
        return _PROTOCOL[op]
    except (KeyError, TypeError):
        raise ValueError(f"unknown reduction op {op!r}; use one of hvd." + ", hvd.".join(_NAMES.values())) from None
