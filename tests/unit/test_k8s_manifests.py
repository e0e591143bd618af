"""The Kubernetes manifests, without a cluster: they validate offline against the Kubernetes
schemas (kubernetes-validate, which ships them), and the Kubeflow kinds against a schema written
from the training-operator's kubeflow.org/v1 CRD fields, whose pod templates are checked with
the real Kubernetes PodTemplateSpec schema; and the environment the platform would give every
replica (the operator's RANK and TF_CONFIG; the StatefulSet's pod index) gives every process its
right role through reduction_server.config.discovery; and each reducer container declares exactly
the ports its `reduction-server serve` listens on (its shards' and its metrics port), resolved from
its arguments and environment as `serve` resolves them, with its probes on the metrics port.
"""

from __future__ import annotations

import copy
import json
import os
from typing import Callable, Dict, Iterator, List, Optional, Tuple
from unittest import mock

import pytest

yaml = pytest.importorskip("yaml", reason="PyYAML is installed with the test extra (pip install '.[test]')")

from helpers.source_tree import ROOT  # noqa: E402
from reduction_server.cli import build_parser  # noqa: E402
from reduction_server.config import settings  # noqa: E402
from reduction_server.config.discovery import discover_reducer, discover_worker  # noqa: E402
from reduction_server.errors import ConfigError  # noqa: E402
from reduction_server.reducer.metrics import HEALTH_PATH, READY_PATH  # noqa: E402
from reduction_server.reducer.options import ReducerConfig  # noqa: E402

K8S = ROOT / "examples" / "k8s"
TOKEN = "manifest-test-token"
KUBERNETES_VERSION = "1.30"  # the oldest version the manifests claim (pod-index label: 1.28+)


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


def listening_ports(container: dict, env: Dict[str, str]) -> Dict[int, str]:
    """The TCP ports `reduction-server serve` (the image's entry point) listens on in `container`
    with environment `env`, each with what it is: resolved from its arguments and environment as
    serve resolves them (reducer/options.py). Its shard count must be pinned (`auto` would count
    the node's cores, unknown here)."""
    assert "command" not in container, "the image's entry point, `reduction-server serve`, runs"
    args = build_parser().parse_args(["serve", *container.get("args", [])])
    shards = args.shards if args.shards is not None else env.get("RS_SHARDS", "auto")
    assert shards.strip().lower() != "auto", "pin the shard count (--shards N): its ports are declared"
    with mock.patch.dict(os.environ, env, clear=True):
        config = ReducerConfig.resolve(
            host=args.host, port=args.port, index=args.index, workers=args.workers,
            metrics_port=args.metrics_port, shards=args.shards,
        )  # fmt: skip
    ports = {config.port + s: f"shard {s}" for s in range(config.shards)}
    if config.metrics_port:
        ports[config.metrics_port] = "metrics"
    return ports


def port_mismatch(container: dict, env: Dict[str, str]) -> Optional[str]:
    """What is wrong with the ports `container` declares against those its reducer listens on
    (listening_ports) and with its probes, or None."""
    listening = listening_ports(container, env)
    declared = {p["containerPort"]: p.get("name") for p in container.get("ports", [])}
    if any(p.get("protocol", "TCP") != "TCP" for p in container.get("ports", [])):
        return "a reducer listens on TCP only"
    if set(declared) != set(listening):
        missing = {port: what for port, what in listening.items() if port not in declared}
        extra = sorted(set(declared) - set(listening))
        return (
            f"declared ports {sorted(declared)}, but it listens on {sorted(listening)}: "
            f"missing {missing}, extra {extra}"
        )
    for probe, path in (("readinessProbe", READY_PATH), ("livenessProbe", HEALTH_PATH)):
        get = container.get(probe, {}).get("httpGet")
        if get is None or get.get("path") != path:
            return f"its {probe} is not an httpGet of {path}"
        port = get["port"] if isinstance(get["port"], int) else next(
            (p for p, name in declared.items() if name == get["port"]), None
        )  # fmt: skip
        if listening.get(port) != "metrics":
            return f"its {probe} asks port {get['port']!r}, not the metrics port"
    return None


# -- Kubernetes schemas --------------------------------------------------------------------------

# Where kubernetes-validate's schemas define the Kubernetes types (its _definitions.json's $id).
_K8S_DEFS = "https://kubernetes.io/api/_definitions.json#/$defs/"


def _replica_spec(types: List[str]) -> dict:
    return {
        "type": "object",
        "minProperties": 1,
        "propertyNames": {"enum": types},
        "additionalProperties": {
            "type": "object",
            "additionalProperties": False,
            "required": ["template"],
            "properties": {
                "replicas": {"type": "integer", "minimum": 0},
                "restartPolicy": {"enum": ["Always", "OnFailure", "Never", "ExitCode"]},
                "template": {"$ref": _K8S_DEFS + "io.k8s.api.core.v1.PodTemplateSpec"},
            },
        },
    }


# kubeflow.org/v1 PyTorchJob and TFJob, from the training-operator's CRD (v1.7-1.9) fields.
_RUN_POLICY = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "cleanPodPolicy": {"enum": ["All", "Running", "None"]},
        "ttlSecondsAfterFinished": {"type": "integer"},
        "activeDeadlineSeconds": {"type": "integer"},
        "backoffLimit": {"type": "integer"},
        "suspend": {"type": "boolean"},
        "managedBy": {"type": "string"},
        "schedulingPolicy": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "minAvailable": {"type": "integer"},
                "queue": {"type": "string"},
                "minResources": {"type": "object"},
                "priorityClass": {"type": "string"},
                "scheduleTimeoutSeconds": {"type": "integer"},
            },
        },
    },
}
_METADATA = {"$ref": _K8S_DEFS + "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"}


def _kubeflow_job(kind: str, replica_specs: str, roles: list, **spec_fields) -> dict:
    """The strict schema of one Kubeflow training job kind: its replica specs, runPolicy and extra spec fields."""
    return {
        "type": "object",
        "additionalProperties": False,
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"const": "kubeflow.org/v1"},
            "kind": {"const": kind},
            "metadata": _METADATA,
            "spec": {
                "type": "object",
                "additionalProperties": False,
                "required": [replica_specs],
                "properties": {replica_specs: _replica_spec(roles), "runPolicy": _RUN_POLICY, **spec_fields},
            },
        },
    }


KUBEFLOW_SCHEMAS = {
    "PyTorchJob": _kubeflow_job(
        "PyTorchJob",
        "pytorchReplicaSpecs",
        ["Master", "Worker"],
        nprocPerNode={"type": "string"},
        elasticPolicy={
            "type": "object",
            "additionalProperties": False,
            "properties": {
                name: {"type": kind}
                for name, kind in [
                    ("minReplicas", "integer"),
                    ("maxReplicas", "integer"),
                    ("maxRestarts", "integer"),
                    ("nProcPerNode", "integer"),
                    ("rdzvBackend", "string"),
                    ("rdzvHost", "string"),
                    ("rdzvId", "string"),
                    ("rdzvPort", "integer"),
                    ("standalone", "boolean"),
                    ("rdzvConf", "array"),
                    ("metrics", "array"),
                ]
            },
        },
    ),
    "TFJob": _kubeflow_job(
        "TFJob",
        "tfReplicaSpecs",
        ["Chief", "Master", "Worker", "PS", "Evaluator"],
        successPolicy={"enum": ["", "AllWorkers"]},
        enableDynamicWorker={"type": "boolean"},
    ),
}


@pytest.fixture(scope="module")
def validate():
    """validate(document) -> None, raising on any schema violation; strict (unknown fields fail)."""
    pytest.importorskip(
        "kubernetes_validate", reason="kubernetes-validate is installed with the test extra (pip install '.[test]')"
    )
    import jsonschema
    from kubernetes_validate import utils
    from packaging.version import Version
    from referencing import Registry, Resource

    # The schemas of KUBERNETES_VERSION, or the oldest the installed release still ships.
    older = [v for v in utils.all_versions() if Version(utils.major_minor(v)) <= Version(KUBERNETES_VERSION)]
    version = (older or utils.all_versions())[-1 if older else 0]

    def check(document: dict) -> None:
        if document["apiVersion"].startswith("kubeflow.org/"):
            definitions = utils.schema_contents(
                f"kubernetes-json-schema/v{version}-local-strict/_definitions.json", version
            )
            registry = Registry().with_resource(definitions["$id"], Resource.from_contents(definitions))
            schema = KUBEFLOW_SCHEMAS.get(document["kind"])
            assert schema is not None, f"no schema for {document['kind']}"
            jsonschema.Draft202012Validator(schema, registry=registry).validate(document)
        else:
            utils.validate(document, version, strict=True)

    check.version = version
    return check


@pytest.mark.parametrize(
    "file,index",
    [
        (name, i)
        for name in sorted(p.name for p in K8S.glob("*.yaml"))
        for i in range(sum(1 for d in yaml.safe_load_all((K8S / name).read_text()) if d))
    ],
)
def test_kubernetes_manifest_validates(validate, file: str, index: int) -> None:
    document = [d for d in yaml.safe_load_all((K8S / file).read_text()) if d][index]
    validate(document)


def _typo(document: dict) -> dict:
    """A copy with one misspelt field deep in the pod template (or the spec)."""
    bad = copy.deepcopy(document)
    spec = bad["spec"]
    templates = (
        [spec["template"]]
        if "template" in spec
        else [r["template"] for r in (spec.get("pytorchReplicaSpecs") or spec.get("tfReplicaSpecs") or {}).values()]
    )
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
    (statefulset,) = by_kind("StatefulSet", "reducers.yaml")
    (service,) = by_kind("Service", "reducers.yaml")
    return statefulset, service


def test_statefulset_reducers_find_their_place() -> None:
    statefulset, service = _reducer_set()
    name, replicas = statefulset["metadata"]["name"], statefulset["spec"]["replicas"]
    assert statefulset["spec"]["serviceName"] == service["metadata"]["name"]
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"].items() <= statefulset["spec"]["template"]["metadata"]["labels"].items()
    port = service["spec"]["ports"][0]["port"]
    (container,) = statefulset["spec"]["template"]["spec"]["containers"]
    assert container["ports"][0]["containerPort"] == port
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
    (job,) = by_kind(kind, file)
    specs = job["spec"]["pytorchReplicaSpecs" if kind == "PyTorchJob" else "tfReplicaSpecs"]
    world = sum(s["replicas"] for s in specs.values())
    assert int(reducers_env["RS_WORLD_SIZE"]) == world
    ranks = []
    for role, spec in specs.items():
        (container,) = spec["template"]["spec"]["containers"]
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
    cluster = {
        rtype.lower(): [f"{name}-{rtype.lower()}-{i}.{namespace}.svc:{port}" for i in range(spec["replicas"])]
        for rtype, spec in job["spec"]["tfReplicaSpecs"].items()
        if rtype != "Evaluator"
    }
    return json.dumps({"cluster": cluster, "task": {"type": role.lower(), "index": index}, "environment": "cloud"})


def test_tfjob_with_ps_reducers_gives_every_pod_its_role() -> None:
    (job,) = by_kind("TFJob", "tfjob-ps-reducers.yaml")
    specs = job["spec"]["tfReplicaSpecs"]
    world = specs["Chief"]["replicas"] + specs["Worker"]["replicas"]
    reducers = json.loads(_tf_config(job, "PS", 0))["cluster"]["ps"]
    ranks = []
    for role, spec in specs.items():
        (container,) = spec["template"]["spec"]["containers"]
        assert container["name"] == "tensorflow"
        for i in range(spec["replicas"]):
            env = dict(container_env(container), TF_CONFIG=_tf_config(job, role, i))
            if role == "PS":
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


def _reducer_pods() -> Iterator[Tuple[str, dict, Callable[[dict], Dict[str, str]]]]:
    """(where, pod spec, its container's environment of its first replica) for every reducer pod."""
    statefulset, _ = _reducer_set()
    yield "reducers.yaml", statefulset["spec"]["template"]["spec"], container_env
    (job,) = by_kind("TFJob", "tfjob-ps-reducers.yaml")
    yield (
        "tfjob-ps-reducers.yaml",
        job["spec"]["tfReplicaSpecs"]["PS"]["template"]["spec"],
        lambda container: dict(container_env(container), TF_CONFIG=_tf_config(job, "PS", 0)),
    )


def _reducer_containers() -> Iterator[Tuple[str, dict, Dict[str, str]]]:
    """(where, container, environment of its first replica) for every reducer container."""
    for where, pod, env in _reducer_pods():
        (container,) = pod["containers"]
        yield where, container, env(container)


def test_reducer_pods_give_a_draining_reducer_more_time_than_its_drain_timeout() -> None:
    """On SIGTERM a reducer drains for up to RS_DRAIN_TIMEOUT (docs/reliability.md); the pod's
    grace period (Kubernetes' default 30 s when unset) leaves it that and more before SIGKILL."""
    for where, pod, env in _reducer_pods():
        (container,) = pod["containers"]
        with mock.patch.dict(os.environ, env(container), clear=True):
            drain = settings.read("RS_DRAIN_TIMEOUT")
        grace = pod.get("terminationGracePeriodSeconds", 30)
        assert grace >= drain + 10, f"{where}: terminationGracePeriodSeconds {grace} for a drain of {drain:g} s"


def test_reducers_declare_exactly_the_ports_they_listen_on_and_probe_the_metrics_port() -> None:
    """Every shard's port and the metrics port, nothing else (a NetworkPolicy or a firewall
    built from the declared ports admits every connection the workers make), with a shard per
    requested core; the probes are the reducer's own /readyz and /healthz."""
    for where, container, env in _reducer_containers():
        assert port_mismatch(container, env) is None, f"{where}: {port_mismatch(container, env)}"
        shards = sum(1 for what in listening_ports(container, env).values() if what.startswith("shard"))
        assert shards == int(container["resources"]["requests"]["cpu"]), f"{where}: a shard per requested core"
    (_, service) = _reducer_set()
    (_, container, _) = next(_reducer_containers())
    assert {p["port"] for p in service["spec"]["ports"]} <= {p["containerPort"] for p in container["ports"]}


def test_a_port_mismatch_fails_the_check() -> None:
    """The check is not vacuous: another shard count, a port missing, a TCP probe, a probe of a
    shard's port, and an unpinned shard count are each caught."""
    (_, container, env) = next(_reducer_containers())
    fewer = dict(copy.deepcopy(container), args=["--shards", "4"])
    assert "extra [5559, 5560, 5561, 5562]" in port_mismatch(fewer, env)
    no_metrics = copy.deepcopy(container)
    no_metrics["ports"] = [p for p in no_metrics["ports"] if p["name"] != "metrics"]
    assert "missing {9100: 'metrics'}" in port_mismatch(no_metrics, env)
    tcp_probe = dict(copy.deepcopy(container), readinessProbe={"tcpSocket": {"port": "reducer"}})
    assert "not an httpGet of /readyz" in port_mismatch(tcp_probe, env)
    shard_probe = copy.deepcopy(container)
    shard_probe["livenessProbe"]["httpGet"]["port"] = 5555
    assert "not the metrics port" in port_mismatch(shard_probe, env)
    with pytest.raises(AssertionError, match="pin the shard count"):
        listening_ports({k: v for k, v in container.items() if k != "args"}, env)
