"""A job laid out by a Vertex AI CLUSTER_SPEC and a TF_CONFIG, as the platform sets them: bare
`reduction-server serve` takes its port and worker count from the spec, workers their rank and
the reducers' addresses. Real processes on loopback."""

import json
import subprocess
import sys

import pytest

from helpers.cluster import SCRIPTS, child_env, collect
from helpers.ports import free_port_range

CASES = {
    "sequential": [
        {"dtype": d, "op": o, "count": 70_001, "seed": i}
        for i, (d, o) in enumerate(
            [("float32", "sum"), ("float16", "avg"), ("int64", "max"), ("bfloat16", "sum"), ("uint8", "min")]
        )
    ],
    "broadcast": [100],
}


def vertex_spec(ports, workers, task_type, index):
    """CLUSTER_SPEC the way Vertex AI writes it for a job with Reduction Server."""
    return json.dumps(
        {
            "cluster": {
                "workerpool0": ["127.0.0.1:2222"],
                "workerpool1": [f"127.0.0.1:{2223 + i}" for i in range(workers - 1)],
                "workerpool2": [f"127.0.0.1:{p}" for p in ports],
            },
            "environment": "cloud",
            "task": {"type": task_type, "index": index},
            "job": {
                "worker_pool_specs": [
                    {"replica_count": 1},
                    {"replica_count": workers - 1},
                    {"replica_count": len(ports)},
                ]
            },
        }
    )


def tf_config(ports, workers, task_type, index):
    """TF_CONFIG with a chief, workers and the reducers as ps."""
    return json.dumps(
        {
            "cluster": {
                "chief": ["127.0.0.1:2222"],
                "worker": [f"127.0.0.1:{2223 + i}" for i in range(workers - 1)],
                "ps": [f"127.0.0.1:{p}" for p in ports],
            },
            "task": {"type": task_type, "index": index},
            "environment": "cloud",
        }
    )


@pytest.mark.parametrize("variable", ["CLUSTER_SPEC", "TF_CONFIG"])
def test_job_from_the_cluster_spec(variable):
    base = free_port_range(16)  # 8 ports each: room for a sharded reducer's shards (RS_SHARDS)
    workers, ports = 3, [base, base + 8]
    make = vertex_spec if variable == "CLUSTER_SPEC" else tf_config
    reducer_type, worker_types = (
        ("workerpool2", ["workerpool0", "workerpool1", "workerpool1"])
        if variable == "CLUSTER_SPEC"
        else ("ps", ["chief", "worker", "worker"])
    )
    worker_index = [0, 0, 1]
    common = {"RS_JOB_TOKEN": "spec-token", "RS_BIND_HOST": "127.0.0.1", "RS_TIMEOUT": "60", "RS_CONNECT_TIMEOUT": "30"}
    reducers = []
    try:
        for i in range(len(ports)):
            env = child_env({**common, variable: make(ports, workers, reducer_type, i)})
            reducers.append(
                subprocess.Popen(
                    [sys.executable, "-m", "reduction_server", "serve"],
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            )
        for i, proc in enumerate(reducers):
            line = proc.stdout.readline()  # its log is read at the end: it is still running here
            assert f"reducer {i} listening on tcp://127.0.0.1:{ports[i]} " in line and f" workers={workers} " in line, (
                line
            )
        ranks = []
        for rank in range(workers):
            env = child_env({**common, variable: make(ports, workers, worker_types[rank], worker_index[rank])})
            ranks.append(
                subprocess.Popen(
                    [sys.executable, str(SCRIPTS / "allreduce_worker.py"), json.dumps(CASES)],
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            )
        results = collect(ranks, timeout=120)
        assert [r["rank"] for r in results] == [0, 1, 2]  # rank from the spec, in pool order
        for r in results:
            assert r["failures"] == [] and r["done"] == len(CASES["sequential"]) + workers
        assert all(p.poll() is None for p in reducers), "a reducer died"
    finally:
        for proc in reducers:
            proc.terminate()
        for proc in reducers:
            try:
                proc.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
