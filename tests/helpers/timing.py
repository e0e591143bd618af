"""The timeouts failure tests run with, and how tight they may measure on a shared machine."""

from __future__ import annotations

HEARTBEAT = 0.5  # RS_HEARTBEAT_INTERVAL (default 1)
# A process that dies or closes is noticed through its connection, whatever the liveness timeout:
# those tests keep it long (a loaded machine must not fail a healthy peer) and bound the latency
# by DETECT; the tests of silent peers (SIGSTOP) use LIVENESS.
QUIET = 10.0
LIVENESS = 2.0
DETECT = 3.0
SLACK = 3.0  # this machine is shared and noisy: detection times are bounded, never measured tight
FAST = {"RS_LIVENESS_TIMEOUT": str(QUIET), "RS_HEARTBEAT_INTERVAL": str(HEARTBEAT), "RS_LOG_LEVEL": "INFO"}
SILENT = {**FAST, "RS_LIVENESS_TIMEOUT": str(LIVENESS)}
