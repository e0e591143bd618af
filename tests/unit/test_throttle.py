"""log.Throttle: what bounds the log lines a peer without the job token can cause."""

from __future__ import annotations

import logging
from typing import List

from reduction_server.log import MAX_THROTTLED_CAUSES, THROTTLE_S, Throttle


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: List[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _throttle():
    logger = logging.getLogger("test_throttle")
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    logger.handlers[:] = [Lines()]
    now = [100.0]
    return Throttle(logger, lambda: now[0]), logger.handlers[0].lines, now


def test_the_first_line_of_each_cause_is_written_the_rest_counted_then_summarised():
    throttle, lines, now = _throttle()
    assert [throttle.event(logging.WARNING, "rejected", peer=i) for i in range(5)] == [True] + [False] * 4
    assert throttle.event(logging.WARNING, "handshake_failed", cause="a", reason="a")
    assert throttle.event(logging.WARNING, "handshake_failed", cause="b", reason="b")  # another cause
    throttle.flush()  # nothing has passed yet
    assert lines == ["rejected peer=0", "handshake_failed reason=a", "handshake_failed reason=b"]
    now[0] += THROTTLE_S
    throttle.flush()
    assert lines[3:] == [f"suppressed what=rejected lines=4 interval_s={THROTTLE_S}"]
    assert throttle.event(logging.WARNING, "rejected", peer=9)  # a new interval
    assert lines[4:] == ["rejected peer=9"] and throttle.suppressed == 4


def test_a_late_line_of_a_cause_writes_the_summary_of_its_last_interval_first():
    throttle, lines, now = _throttle()
    throttle.event(logging.INFO, "malformed_frame", peer=1)
    throttle.event(logging.INFO, "malformed_frame", peer=2)
    now[0] += THROTTLE_S + 1
    throttle.event(logging.INFO, "malformed_frame", peer=3)
    assert lines == [
        "malformed_frame peer=1",
        f"suppressed what=malformed_frame lines=1 interval_s={THROTTLE_S}",
        "malformed_frame peer=3",
    ]


def test_the_causes_kept_are_bounded_and_the_oldest_is_summarised_first():
    throttle, lines, now = _throttle()
    throttle.event(logging.WARNING, "handshake_failed", cause="first")
    throttle.event(logging.WARNING, "handshake_failed", cause="first")
    for i in range(MAX_THROTTLED_CAUSES + 10):
        now[0] += 0.001
        throttle.event(logging.WARNING, "handshake_failed", cause=str(i))
    assert len(throttle._causes) == MAX_THROTTLED_CAUSES
    assert lines[MAX_THROTTLED_CAUSES] == f"suppressed what=handshake_failed:first lines=1 interval_s={THROTTLE_S}"
