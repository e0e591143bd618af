"""Horovod's dynamic timeline (hvd.start_timeline / hvd.stop_timeline) with real reducers and two
ranks, checked as Horovod's test_timeline_api checks it (that test is skipped in Horovod's own
file): rank 0 writes the path it is given, with Horovod's names for what happened."""

import pytest

pytest.importorskip("torch", reason="torch is not installed (pip install torch) - the adapter needs it")

from helpers.cluster import reducers, run_workers  # noqa: E402


def test_start_and_stop_timeline_write_horovods_events(tmp_path):
    with reducers(1, workers=2) as group:
        results = run_workers(2, group, "horovod_timeline_worker.py", [str(tmp_path)], timeout=120)
    files = results[0]["files"]
    assert len(files) == 4, files.keys()
    for path, seen in files.items():
        events = seen["events"]
        names = [e["name"] for e in events]
        meta = next(e for e in events if e["name"] == "process_name")
        assert "start_time_since_epoch_in_micros" in meta["args"], path
        assert "allreduce.test_allreduce" in names, (path, names)
        assert "NEGOTIATE_ALLREDUCE" in names, (path, names)
        assert ("CYCLE_START" in names) == seen["mark_cycles"], (path, names)
    # the other rank writes its own file beside rank 0's
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [f"timeline{i}.json" for i in range(4)] + [f"timeline{i}.rank1.json" for i in range(4)]
    )
