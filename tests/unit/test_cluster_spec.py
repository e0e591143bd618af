"""Discovery from the cluster specs, from every task's point of view: Vertex AI's and AI
Platform's CLUSTER_SPEC and TF_CONFIG (helpers/cluster_specs.py has the documents).
Tests pass `environ` dicts and never touch os.environ."""

from __future__ import annotations

import json

import pytest

from helpers.cluster_specs import (
    CHIEF_PS,
    FIXTURES,
    VERTEX_REDUCERS,
    as_task,
    config_error,
    hash64,
    load,
    tf_config,
    vertex,
)
from reduction_server.config.discovery import ReducerPlace, WorkerPlace, discover_reducer, discover_worker

# --- Vertex AI CLUSTER_SPEC, from each task's point of view ---------------------------------


def test_vertex_fixture_as_given_is_the_primary():
    place = discover_worker({"CLUSTER_SPEC": (FIXTURES / "vertex_cluster_spec.json").read_text()})
    assert isinstance(place, WorkerPlace)
    assert (place.rank, place.world_size, place.source) == (0, 3, "CLUSTER_SPEC")
    assert place.reducers == VERTEX_REDUCERS
    assert (place.local_rank, place.local_world_size) == (0, 1)
    assert (place.job_token, place.generation) == ("", 0)


@pytest.mark.parametrize("index, rank", [(0, 1), (1, 2)])
def test_vertex_workerpool1_follows_the_primary(index, rank):
    place = discover_worker(vertex("workerpool1", index))
    assert (place.rank, place.world_size, place.source) == (rank, 3, "CLUSTER_SPEC")
    assert place.reducers == VERTEX_REDUCERS


@pytest.mark.parametrize("task_type, index", [("workerpool0", 0), ("workerpool1", 0), ("workerpool1", 1)])
def test_vertex_workers_are_not_reducers(task_type, index):
    assert discover_reducer(vertex(task_type, index)) is None


@pytest.mark.parametrize("index", [0, 1])
def test_vertex_workerpool2_are_the_reducers(index):
    place = discover_reducer(vertex("workerpool2", index))
    assert isinstance(place, ReducerPlace)
    assert (place.index, place.num_reducers, place.host, place.port) == (index, 2, "0.0.0.0", 2222)
    assert (place.world_size, place.source) == (3, "CLUSTER_SPEC")


def test_a_reducer_with_several_processes_per_host_is_told_it_is_a_reducer():
    """The role is checked before the per-host settings, whose errors would mislead."""
    message = config_error(discover_worker, {**vertex("workerpool2", 0), "RS_PROCS_PER_HOST": "8"})
    assert "is a reducer" in message and "LOCAL_RANK" not in message


@pytest.mark.parametrize("index", [0, 1])
def test_vertex_reducer_is_not_a_worker(index):
    message = config_error(discover_worker, vertex("workerpool2", index))
    assert "CLUSTER_SPEC" in message and "reducer" in message and "not a worker" in message


@pytest.mark.parametrize("index", [0, 1, 2])
def test_vertex_evaluators_take_no_part(index):
    message = config_error(discover_worker, vertex("workerpool3", index))
    assert "CLUSTER_SPEC" in message and "evaluator" in message and "not a worker" in message
    assert discover_reducer(vertex("workerpool3", index)) is None


def test_vertex_every_task_agrees_on_the_job():
    tasks = [("workerpool0", 0), ("workerpool1", 0), ("workerpool1", 1)]
    workers = [discover_worker(vertex(*task)) for task in tasks]
    reducers = [discover_reducer(vertex("workerpool2", index)) for index in (0, 1)]
    assert sorted(w.rank for w in workers) == list(range(3))
    assert {w.world_size for w in workers} == {r.world_size for r in reducers} == {3}
    expected = hash64(json.dumps(load("vertex_cluster_spec.json")["job"], sort_keys=True, separators=(",", ":")))
    assert {p.job_id for p in workers + reducers} == {expected}


def test_vertex_job_id_ignores_key_order():
    document = load("vertex_cluster_spec.json")
    reordered = dict(document, job=dict(reversed(list(document["job"].items()))))
    reordered["job"]["workerPoolSpecs"] = [
        dict(reversed(list(spec.items()))) for spec in document["job"]["workerPoolSpecs"]
    ]
    assert (
        discover_worker({"CLUSTER_SPEC": json.dumps(reordered)}).job_id
        == discover_worker({"CLUSTER_SPEC": json.dumps(document)}).job_id
    )


def test_vertex_without_workerpool1_is_primary_plus_reducers():
    # Document 003's second example: the primary and the third pool only.
    document = load("vertex_cluster_spec.json")
    del document["cluster"]["workerpool1"], document["cluster"]["workerpool3"]
    place = discover_worker({"CLUSTER_SPEC": json.dumps(document)})
    assert (place.rank, place.world_size, place.reducers) == (0, 1, VERTEX_REDUCERS)
    assert discover_reducer({"CLUSTER_SPEC": as_task(document, "workerpool2", 1)}).world_size == 1


def test_vertex_without_reducer_pool_needs_rs_reducers():
    document = load("vertex_cluster_spec.json")
    del document["cluster"]["workerpool2"]
    environ = {"CLUSTER_SPEC": as_task(document, "workerpool1", 0)}
    message = config_error(discover_worker, environ)
    assert "RS_REDUCERS" in message and "workerpool2" in message
    place = discover_worker(dict(environ, RS_REDUCERS="10.0.0.9:7000"))
    assert (place.rank, place.world_size, place.reducers) == (1, 3, ("10.0.0.9:7000",))


def test_rs_reducers_overrides_the_spec_for_workers_and_reducers():
    override = "r0.example:6000,r1.example:6001"
    assert discover_worker(vertex("workerpool1", 0, RS_REDUCERS=override)).reducers == tuple(override.split(","))
    place = discover_reducer(vertex("workerpool2", 1, RS_REDUCERS=override))
    assert (place.index, place.port, place.source) == (1, 6001, "CLUSTER_SPEC")


def test_rs_reducers_shorter_than_the_spec_index():
    message = config_error(discover_reducer, vertex("workerpool2", 1, RS_REDUCERS="r0:6000"))
    assert "CLUSTER_SPEC task.index=1" in message and "RS_REDUCERS lists 1" in message


# --- AI Platform CLUSTER_SPEC (master/worker/ps/evaluator) ---------------------------------


@pytest.mark.parametrize("task_type, index, rank", [("master", 0, 0), ("worker", 0, 1), ("worker", 1, 2)])
def test_ai_platform_cluster_spec_workers(task_type, index, rank):
    environ = {"CLUSTER_SPEC": as_task(load("ai_platform_cluster_spec.json"), task_type, index)}
    place = discover_worker(environ)
    assert (place.rank, place.world_size, place.source) == (rank, 3, "CLUSTER_SPEC")
    assert place.reducers == ("cmle-training-ps-9e0f1a2b-0:2222",)


def test_ai_platform_cluster_spec_ps_and_evaluator():
    document = load("ai_platform_cluster_spec.json")
    place = discover_reducer({"CLUSTER_SPEC": as_task(document, "ps", 0)})
    assert (place.index, place.port, place.world_size, place.source) == (0, 2222, 3, "CLUSTER_SPEC")
    assert "evaluator" in config_error(discover_worker, {"CLUSTER_SPEC": as_task(document, "evaluator", 0)})


# --- TF_CONFIG -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fixture, head", [("ai_platform_tf_config_chief.json", "chief"), ("ai_platform_tf_config_master.json", "master")]
)
@pytest.mark.parametrize("task_type, index, rank", [("head", 0, 0), ("worker", 0, 1), ("worker", 1, 2)])
def test_tf_config_chief_or_master_is_host_zero(fixture, head, task_type, index, rank):
    place = discover_worker(tf_config(fixture, head if task_type == "head" else task_type, index))
    assert (place.rank, place.world_size, place.source) == (rank, 3, "TF_CONFIG")
    assert place.reducers == CHIEF_PS
    assert place.job_id == 0  # only CLUSTER_SPEC's "job" names the job


@pytest.mark.parametrize("fixture", ["ai_platform_tf_config_chief.json", "ai_platform_tf_config_master.json"])
def test_tf_config_ps_is_the_reducer(fixture):
    place = discover_reducer(tf_config(fixture, "ps", 0))
    assert (place.index, place.num_reducers, place.port, place.world_size, place.source) == (0, 1, 2222, 3, "TF_CONFIG")
    message = config_error(discover_worker, tf_config(fixture, "ps", 0))
    assert "TF_CONFIG" in message and "reducer" in message and "not a worker" in message


@pytest.mark.parametrize("fixture", ["ai_platform_tf_config_chief.json", "tf_config_no_chief.json"])
def test_tf_config_evaluator_takes_no_part(fixture):
    # TF_CONFIG never lists evaluators in "cluster"; the evaluator still knows what it is.
    environ = tf_config(fixture, "evaluator", 0)
    message = config_error(discover_worker, environ)
    assert "TF_CONFIG" in message and "evaluator" in message and "not a worker" in message
    assert discover_reducer(environ) is None


def test_tf_config_as_given_on_vertex():
    place = discover_worker({"TF_CONFIG": (FIXTURES / "vertex_tf_config.json").read_text()})
    assert (place.rank, place.world_size, place.reducers) == (1, 3, ("training-workerpool2-7c4e2a91-0:2222",))


@pytest.mark.parametrize("index", [0, 1, 2])
def test_tf_config_without_chief_worker_i_is_rank_i(index):
    place = discover_worker(tf_config("tf_config_no_chief.json", "worker", index))
    assert (place.rank, place.world_size) == (index, 3)
    assert place.reducers == ("host4:2222", "host5:2222")


@pytest.mark.parametrize("index", [0, 1])
def test_tf_config_without_chief_ps_reducers(index):
    place = discover_reducer(tf_config("tf_config_no_chief.json", "ps", index))
    assert (place.index, place.num_reducers, place.port, place.world_size) == (index, 2, 2222, 3)


def test_tf_config_without_ps_needs_rs_reducers():
    document = load("ai_platform_tf_config_chief.json")
    del document["cluster"]["ps"]
    message = config_error(discover_worker, {"TF_CONFIG": json.dumps(document)})
    assert "RS_REDUCERS" in message and "TF_CONFIG has no ps" in message
