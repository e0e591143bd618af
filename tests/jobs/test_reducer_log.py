"""A reducer's log: a summary at stop and nothing else for a clean job at the default level
(RS_LOG_LEVEL unset; its start is the one short `listening` line on stdout); RS_LOG_LEVEL=INFO adds
its configuration at start and the per-peer events."""

import json
import platform
import re
import sys
from typing import Dict, List, Tuple

import pytest

from helpers.cluster import ONE_PROCESS, reducers, run_workers

pytestmark = pytest.mark.timeout(120)

WORLD = 2
JOB = {
    "sequential": [
        {"dtype": "float32", "op": "sum", "count": 1000, "seed": 1},
        {"dtype": "float16", "op": "avg", "count": 300, "seed": 2},
    ]
}
_FIELD = re.compile(r'(\w+)=("(?:[^"\\]|\\.)*"|\S+)')


def events(log: str) -> List[Dict[str, str]]:
    """Each line as {"level", "event", field: value}; a line of any other shape fails the test."""
    out = []
    for line in log.splitlines():
        match = re.match(r"\S+ \S+ (\w+) reduction_server\.(\w+) (\w+) (.*)$", line)
        assert match, f"not a structured log line: {line!r}"
        out.append(
            {
                "level": match.group(1),
                "event": match.group(3),
                **{k: v.strip('"') for k, v in _FIELD.findall(match.group(4))},
            }
        )
    return out


def clean_job(extra_env=None) -> Tuple[str, List[Dict[str, str]]]:
    """The reducer's address and its log's events, for a job that runs without a problem (one
    process: a sharded reducer's shards log each their own events)."""
    with reducers(1, workers=WORLD, extra_env={**(extra_env or {}), **ONE_PROCESS}) as group:
        results = run_workers(WORLD, group, "allreduce_worker.py", [json.dumps(JOB)])
        assert all(r["failures"] == [] for r in results), results
        return group.addresses[0], events(group.stop()[0])


def test_default_level_logs_a_summary_only():
    _, lines = clean_job()
    assert [(e["level"], e["event"]) for e in lines] == [("NOTICE", "stopped")], lines
    [stopped] = lines
    # Two all-reduces and the worker script's closing barrier, one chunk each on the one reducer.
    payload = 1000 * 4 + 300 * 2 + 4
    assert (stopped["completed"], stopped["failed"], stopped["failed_by_code"]) == ("3", "0", "none"), stopped
    assert (int(stopped["bytes_in"]), int(stopped["bytes_out"])) == (WORLD * payload, WORLD * payload), stopped
    assert stopped["peers_admitted"] == str(WORLD) and float(stopped["uptime_s"]) > 0, stopped


def test_info_level_adds_the_configuration_at_start_and_the_per_peer_events():
    address, lines = clean_job({"RS_LOG_LEVEL": "INFO"})
    started = lines[0]
    assert (started["level"], started["event"]) == ("INFO", "started"), lines
    assert started["address"] == address
    assert (started["reducer"], started["workers"], started["auth"], started["metrics"]) == ("0", "2", "token", "off")
    if sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc":
        assert started["heap"] == "kept", started  # reduction_server/reducer/heap.py
    for field in (
        "max_chunk_bytes",
        "max_accumulator_bytes",
        "timeout_s",
        "heartbeat_interval_s",
        "liveness_timeout_s",
        "deterministic",
        "pid",
    ):
        assert field in started, (field, started)
    # and the per-peer events
    names = [e["event"] for e in lines]
    assert names[0] == "started" and names[-1] == "stopped", names
    assert sorted(int(e["rank"]) for e in lines if e["event"] == "admitted") == list(range(WORLD)), names
