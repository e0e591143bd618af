"""Who a worker is to the reducers: the four fields every one of its headers carries."""

from __future__ import annotations

from dataclasses import dataclass

from reduction_server.wire import protocol
from reduction_server.wire.protocol import MsgType


@dataclass(frozen=True)
class Identity:
    """A worker's rank and world size, and the job and generation it belongs to."""

    rank: int
    world: int
    job: int
    generation: int

    def header(self, mtype: MsgType, payload: bytes = b"", group: int = 0) -> bytes:
        """The header of a handshake, PING, BYE, GROUP or PROGRESS message from this worker."""
        return protocol.text_header(
            mtype, payload, rank=self.rank, world=self.world, job=self.job, generation=self.generation, group=group
        )

    def owns(self, h: protocol.Header) -> bool:
        """Whether an answer is about this worker's job and generation."""
        return (h.job, h.generation) == (self.job, self.generation)
