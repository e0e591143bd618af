"""RS_TIMELINE: each rank of a real job writes a Chrome trace of its collectives, which loads as
JSON (also on the rank that exits without closing its communicator) and nests properly."""

import json
from collections import defaultdict
from typing import Dict, List

import pytest

from helpers.cluster import reducers, run_workers
from reduction_server.client.timeline import timeline_path

pytestmark = pytest.mark.timeout(120)

WORLD = 2
PHASES = ["queue", "send", "wait", "receive"]  # in this order; wait only when it lasted


def test_timeline_path_puts_the_rank_in_the_name():
    assert timeline_path("/tmp/tl-{rank}.json", 3) == "/tmp/tl-3.json"
    assert timeline_path("/tmp/trace.json", 3) == "/tmp/trace.rank3.json"
    assert timeline_path("trace", 0) == "trace.rank0"


def collectives(events: List[dict]) -> Dict[int, dict]:
    """seq -> {"event": the collective's X event, "phases": its nested phase events in time order}."""
    out = {}
    for e in events:
        if e.get("cat") == "collective":
            out[e["args"]["seq"]] = {"event": e, "phases": []}
    for e in events:
        if e.get("cat") == "phase":
            owners = [
                c
                for c in out.values()
                if c["event"]["tid"] == e["tid"]
                and c["event"]["ts"] <= e["ts"]
                and e["ts"] + e["dur"] <= c["event"]["ts"] + c["event"]["dur"]
            ]
            assert len(owners) == 1, f"phase {e} is not inside exactly one collective"
            owners[0]["phases"].append(e)
    for c in out.values():
        c["phases"].sort(key=lambda e: e["ts"])
    return out


def test_each_rank_writes_a_trace_of_its_collectives_and_buckets(tmp_path):
    template = tmp_path / "timeline.json"
    with reducers(2, workers=WORLD) as group:
        results = run_workers(WORLD, group, "timeline_worker.py", [], extra_env={"RS_TIMELINE": str(template)})
    buckets = results[0]["buckets"]
    assert buckets == [["w1", "b1"], ["w2", "b2"], ["w3"]]
    for rank in range(WORLD):
        with open(tmp_path / f"timeline.rank{rank}.json") as f:
            events = json.load(f)  # rank 1 never closed its communicator: the exit hook completed the file
        assert all(e["pid"] == rank for e in events)
        named = [e for e in events if e["name"] == "process_name"]
        assert len(named) == 1 and named[0]["args"]["name"] == f"rank {rank}", named
        # when the file's clock starts, in Horovod's words: the first event is no earlier
        assert named[0]["args"]["start_time_since_epoch_in_micros"] <= min(e.get("ts", 2e18) for e in events)
        timed = [e for e in events if e["ph"] == "X"]
        assert timed and all(e["dur"] >= 0 for e in timed)
        by_seq = collectives(timed)
        # Two plain all-reduces, the fusion plan's check, the buckets in the order they filled
        # (their tensors were given in reverse), and the all-reduce that failed.
        names = [by_seq[seq]["event"]["name"] for seq in sorted(by_seq)]
        assert names == [
            "all_reduce sum #0",
            "all_reduce sum #1",
            "all_reduce sum #2",
            "bucket 2: w3",
            "bucket 1: w2, b2",
            "bucket 0: w1, b1",
            "all_reduce sum #6",
        ], names
        failed = by_seq[6]["event"]
        assert failed["args"]["status"] == "failed" and "disagree" in failed["args"]["error"], failed
        starts = [by_seq[seq]["event"]["ts"] for seq in sorted(by_seq)]
        assert starts[:3] == sorted(starts[:3]), starts  # submitted one after the other
        for c in by_seq.values():
            e, phases = c["event"], c["phases"]
            if e is failed:
                continue
            assert e["args"]["status"] == "ok", e
            kinds = [p["name"] for p in phases]
            if e["name"].startswith("bucket"):
                index = int(e["name"].split()[1].rstrip(":"))
                assert e["args"]["tensors"] == buckets[index]
                assert kinds[0] == "fusion" and phases[0]["args"]["copy_us"] > 0, kinds
                kinds = kinds[1:]
            assert kinds in (PHASES, [p for p in PHASES if p != "wait"]), (e["name"], kinds)
            ends = [p["ts"] + p["dur"] for p in phases]
            assert all(ends[i] <= phases[i + 1]["ts"] + 1e-3 for i in range(len(phases) - 1)), phases
        assert by_seq[1]["event"]["args"]["chunks"] > 1 and by_seq[0]["event"]["args"]["chunks"] == 1
        # Rows (tids) hold collectives one after another: Perfetto needs X events on a row to nest.
        rows = defaultdict(list)
        for c in by_seq.values():
            rows[c["event"]["tid"]].append(c["event"])
        for row in rows.values():
            row.sort(key=lambda e: e["ts"])
            assert all(a["ts"] + a["dur"] <= b["ts"] + 1e-3 for a, b in zip(row, row[1:])), row
