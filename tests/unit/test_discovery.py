"""Cluster discovery from the environment (docs/design.md, "Roles"): launcher variables, several
processes per host, precedence, explicit variables, job identity, addresses, and errors.
The cluster specs themselves: test_cluster_spec.py. Tests pass `environ` dicts and never touch
os.environ.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from typing import Dict

import pytest

from helpers.cluster_specs import VERTEX_REDUCERS, as_task, config_error, hash64, load, tf_config, vertex
from reduction_server import job_token
from reduction_server.config.discovery import discover_reducer, discover_worker, parse_address, run_id
from reduction_server.errors import ConfigError

# --- launcher variables -----------------------------------------------------------------------


def test_torchrun():
    place = discover_worker(
        {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "RS_REDUCERS": "r0:5555,r1:5556"}
    )
    assert (place.rank, place.world_size, place.source) == (5, 8, "RANK")
    assert (place.local_rank, place.local_world_size) == (1, 4)
    assert place.reducers == ("r0:5555", "r1:5556")


def test_run_id_from_the_launcher_first_set_wins():
    """One run's name, shared by its ranks without talking: RS_RUN_ID (the user's, or `run`'s),
    torchrun's rendezvous id, a Slurm job step, a Vertex AI job; "" when none says."""
    slurm = {"SLURM_JOB_ID": "812", "SLURM_STEP_ID": "3", "CLOUD_ML_JOB_ID": "vertex-9"}
    assert run_id({}) == ""
    assert run_id({"CLOUD_ML_JOB_ID": "vertex-9"}) == "vertex-9"
    assert run_id(slurm) == "812.3"
    assert run_id({"SLURM_JOB_ID": "812"}) == ""  # an sbatch script outside a step names no run
    assert run_id({**slurm, "TORCHELASTIC_RUN_ID": "rdzv"}) == "rdzv"
    assert run_id({**slurm, "TORCHELASTIC_RUN_ID": "rdzv", "RS_RUN_ID": " mine "}) == "mine"
    with pytest.raises(ConfigError, match="RS_RUN_ID is set but empty"):
        run_id({"RS_RUN_ID": " "})


def test_horovod():
    place = discover_worker(
        {
            "HOROVOD_RANK": "3",
            "HOROVOD_SIZE": "4",
            "HOROVOD_LOCAL_RANK": "1",
            "HOROVOD_LOCAL_SIZE": "2",
            "RS_REDUCERS": "r0:5555",
        }
    )
    assert (place.rank, place.world_size, place.source) == (3, 4, "HOROVOD_RANK")
    assert (place.local_rank, place.local_world_size) == (1, 2)


def test_open_mpi():
    place = discover_worker(
        {
            "OMPI_COMM_WORLD_RANK": "6",
            "OMPI_COMM_WORLD_SIZE": "16",
            "OMPI_COMM_WORLD_LOCAL_RANK": "2",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "8",
            "RS_REDUCERS": "r0:5555",
        }
    )
    assert (place.rank, place.world_size, place.source) == (6, 16, "OMPI_COMM_WORLD_RANK")
    assert (place.local_rank, place.local_world_size) == (2, 8)


def test_launcher_order_rank_then_horovod_then_ompi():
    # horovodrun over mpirun sets both Horovod's and Open MPI's variables.
    environ = {
        "HOROVOD_RANK": "1",
        "HOROVOD_SIZE": "2",
        "OMPI_COMM_WORLD_RANK": "0",
        "OMPI_COMM_WORLD_SIZE": "2",
        "RS_REDUCERS": "r0:5555",
    }
    assert discover_worker(environ).source == "HOROVOD_RANK"
    assert discover_worker(dict(environ, RANK="0", WORLD_SIZE="2")).source == "RANK"
    del environ["HOROVOD_RANK"], environ["HOROVOD_SIZE"]
    assert discover_worker(environ).source == "OMPI_COMM_WORLD_RANK"


def test_local_placement_order():
    environ = {
        "RANK": "0",
        "WORLD_SIZE": "8",
        "RS_REDUCERS": "r0:5555",
        "HOROVOD_LOCAL_RANK": "3",
        "HOROVOD_LOCAL_SIZE": "4",
    }
    assert discover_worker(environ).local_rank == 3
    environ.update(OMPI_COMM_WORLD_LOCAL_RANK="2", OMPI_COMM_WORLD_LOCAL_SIZE="4")
    assert discover_worker(environ).local_rank == 2
    environ.update(LOCAL_RANK="1", LOCAL_WORLD_SIZE="4")
    assert discover_worker(environ).local_rank == 1


def test_launcher_variables_need_rs_reducers():
    message = config_error(discover_worker, {"RANK": "0", "WORLD_SIZE": "2"})
    assert "RS_REDUCERS" in message and "not set" in message


# --- several processes per host ---------------------------------------------------------------


def test_vertex_eight_gpus_per_host():
    place = discover_worker(vertex("workerpool1", 1, LOCAL_RANK="3", LOCAL_WORLD_SIZE="8"))
    assert (place.rank, place.world_size) == (2 * 8 + 3, 3 * 8)
    assert (place.local_rank, place.local_world_size) == (3, 8)


def test_every_process_of_a_multi_process_job_gets_its_own_rank():
    ranks = [
        discover_worker(vertex(task_type, index, LOCAL_RANK=str(local), LOCAL_WORLD_SIZE="4")).rank
        for task_type, index in [("workerpool0", 0), ("workerpool1", 0), ("workerpool1", 1)]
        for local in range(4)
    ]
    assert sorted(ranks) == list(range(12))


def test_rs_procs_per_host_with_tf_config():
    place = discover_worker(
        tf_config("ai_platform_tf_config_chief.json", "worker", 1, RS_PROCS_PER_HOST="4", LOCAL_RANK="2")
    )
    assert (place.rank, place.world_size, place.local_world_size) == (2 * 4 + 2, 3 * 4, 4)


def test_mpirun_local_size_counts_as_processes_per_host():
    place = discover_worker(vertex("workerpool1", 0, OMPI_COMM_WORLD_LOCAL_RANK="1", OMPI_COMM_WORLD_LOCAL_SIZE="2"))
    assert (place.rank, place.world_size) == (3, 6)


def test_reducer_world_size_counts_processes_per_host():
    assert discover_reducer(vertex("workerpool2", 0, RS_PROCS_PER_HOST="8")).world_size == 24
    assert discover_reducer(vertex("workerpool2", 0, RS_PROCS_PER_HOST="8", RS_WORLD_SIZE="5")).world_size == 5


@pytest.mark.parametrize(
    "extra, variable",
    [
        ({"LOCAL_RANK": "8", "LOCAL_WORLD_SIZE": "8"}, "LOCAL_RANK"),
        ({"LOCAL_RANK": "4", "RS_PROCS_PER_HOST": "4"}, "LOCAL_RANK"),
        ({"RS_PROCS_PER_HOST": "4"}, "LOCAL_RANK"),
        ({"LOCAL_RANK": "1"}, "LOCAL_WORLD_SIZE"),
        ({"LOCAL_WORLD_SIZE": "2"}, "LOCAL_RANK"),
        ({"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "RS_PROCS_PER_HOST": "4"}, "RS_PROCS_PER_HOST"),
        ({"RS_PROCS_PER_HOST": "0"}, "RS_PROCS_PER_HOST"),
        ({"LOCAL_RANK": "-1", "LOCAL_WORLD_SIZE": "2"}, "LOCAL_RANK"),
    ],
)
def test_bad_local_placement(extra, variable):
    assert variable in config_error(discover_worker, vertex("workerpool1", 0, **extra))


# --- precedence -------------------------------------------------------------------------------


def test_explicit_beats_cluster_spec_and_takes_its_reducers():
    place = discover_worker(vertex("workerpool3", 0, RS_RANK="4", RS_WORLD_SIZE="5"))
    assert (place.rank, place.world_size, place.source) == (4, 5, "RS_RANK")
    assert place.reducers == VERTEX_REDUCERS


def test_cluster_spec_beats_tf_config():
    # Vertex AI sets both; CLUSTER_SPEC decides (its two reducers, not TF_CONFIG's one ps).
    environ = dict(vertex("workerpool1", 1), TF_CONFIG=as_task(load("vertex_tf_config.json"), "worker", 0))
    place = discover_worker(environ)
    assert (place.rank, place.source, place.reducers) == (2, "CLUSTER_SPEC", VERTEX_REDUCERS)


def test_tf_config_beats_launcher_variables():
    environ = tf_config("tf_config_no_chief.json", "worker", 2, RANK="0", WORLD_SIZE="9")
    place = discover_worker(environ)
    assert (place.rank, place.world_size, place.source) == (2, 3, "TF_CONFIG")


def test_explicit_beats_launcher_variables():
    place = discover_worker(
        {"RS_RANK": "1", "RS_WORLD_SIZE": "2", "RANK": "0", "WORLD_SIZE": "4", "RS_REDUCERS": "r0:5555"}
    )
    assert (place.rank, place.world_size, place.source) == (1, 2, "RS_RANK")


def test_explicit_reducer_index_beats_the_spec():
    place = discover_reducer(vertex("workerpool0", 0, RS_REDUCER_INDEX="1"))
    assert (place.index, place.port, place.source, place.world_size) == (1, 2222, "RS_REDUCER_INDEX", 3)


# --- explicit variables -----------------------------------------------------------------------


def test_explicit_worker():
    place = discover_worker({"RS_RANK": "2", "RS_WORLD_SIZE": "4", "RS_REDUCERS": " a:5000, [::1]:5001 ,10.0.0.3:5002"})
    assert (place.rank, place.world_size, place.source) == (2, 4, "RS_RANK")
    assert place.reducers == ("a:5000", "[::1]:5001", "10.0.0.3:5002")


def test_explicit_reducer():
    environ = {"RS_REDUCER_INDEX": "1", "RS_REDUCERS": "a:5000,b:5001"}
    place = discover_reducer(environ)
    assert (place.index, place.num_reducers, place.host, place.port) == (1, 2, "0.0.0.0", 5001)
    assert (place.world_size, place.source) == (None, "RS_REDUCER_INDEX")
    place = discover_reducer(dict(environ, RS_BIND_HOST="10.1.2.3", RS_WORLD_SIZE="4"))
    assert (place.host, place.world_size) == ("10.1.2.3", 4)


@pytest.mark.parametrize(
    "environ", [{}, {"RS_REDUCERS": "a:5000"}, {"RS_RANK": "0", "RS_WORLD_SIZE": "1"}, {"RANK": "0", "WORLD_SIZE": "1"}]
)
def test_no_reducer_role(environ):
    assert discover_reducer(environ) is None


def test_a_reducer_is_not_a_worker():
    message = config_error(discover_worker, {"RS_REDUCER_INDEX": "0", "RS_REDUCERS": "a:5000", "RS_WORLD_SIZE": "2"})
    assert "RS_REDUCER_INDEX" in message and "not a worker" in message


def test_nothing_set_is_an_error():
    message = config_error(discover_worker, {})
    assert "RS_RANK" in message and "CLUSTER_SPEC" in message and "TF_CONFIG" in message


# --- job identity -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value, job_id",
    [
        ("42", 42),
        ("0x2A", 42),
        ("18446744073709551615", 2**64 - 1),
        ("0xffffffffffffffff", 2**64 - 1),
        ("run-7", hash64("run-7")),
        ("-5", hash64("-5")),
    ],
)
def test_rs_job_id(value, job_id):
    environ = vertex("workerpool0", 0, RS_JOB_ID=value, CLOUD_ML_JOB_ID="123")
    assert discover_worker(environ).job_id == job_id
    assert discover_reducer(dict(environ, CLUSTER_SPEC=vertex("workerpool2", 0)["CLUSTER_SPEC"])).job_id == job_id


def test_cloud_ml_job_id_beats_the_spec_job():
    assert discover_worker(vertex("workerpool0", 0, CLOUD_ML_JOB_ID="1234567890")).job_id == hash64("1234567890")


def test_job_id_from_token_then_zero():
    environ = {"RS_RANK": "0", "RS_WORLD_SIZE": "1", "RS_REDUCERS": "a:5000"}
    assert discover_worker(environ).job_id == 0
    place = discover_worker(dict(environ, RS_JOB_TOKEN="s3cret"))
    assert (place.job_token, place.job_id) == ("s3cret", job_token.job_id("s3cret"))
    assert discover_reducer(dict(environ, RS_JOB_TOKEN="s3cret", RS_REDUCER_INDEX="0")).job_id == place.job_id


def test_the_job_id_of_a_token_is_no_fast_function_of_it():
    """Issue 37, item 3: the id travels in clear; it is an HMAC under the scrypt-stretched token
    (the handshake's key), never a plain hash a stranger could test guesses against."""
    expected = hmac.new(
        hashlib.scrypt(b"s3cret", salt=b"reduction-server job token v2", n=1 << 14, r=8, p=1, dklen=32),
        b"reduction-server job id v1\0",
        hashlib.sha256,
    ).digest()[:8]
    assert job_token.job_id("s3cret") == int.from_bytes(expected, "big")
    assert job_token.job_id("s3cret") != hash64("s3cret")
    assert job_token.job_id("s3cret") != job_token.job_id("s3cret2")


def test_generation():
    environ = {"RS_RANK": "0", "RS_WORLD_SIZE": "1", "RS_REDUCERS": "a:5000"}
    assert discover_worker(environ).generation == 0
    assert discover_worker(dict(environ, RS_GENERATION="3")).generation == 3
    assert discover_reducer(dict(environ, RS_REDUCER_INDEX="0", RS_GENERATION="7")).generation == 7


# --- parse_address --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ("host:1", ("host", 1)),
        ("10.0.0.1:65535", ("10.0.0.1", 65535)),
        (" a-b.c_d:2222 ", ("a-b.c_d", 2222)),
        ("[::1]:5555", ("::1", 5555)),
        ("[fe80::1%eth0]:80", ("fe80::1%eth0", 80)),
        ("cmle-training-workerpool2-ab-0:2222", ("cmle-training-workerpool2-ab-0", 2222)),
    ],
)
def test_parse_address(text, expected):
    assert parse_address(text, "RS_REDUCERS") == expected


@pytest.mark.parametrize(
    "text, why",
    [
        ("host", "no :port"),
        ("host:", "not a number"),
        (":5555", "host"),
        ("host:0", "1..65535"),
        ("host:65536", "1..65535"),
        ("host:-1", "not a number"),
        ("host:http", "not a number"),
        ("::1:5555", "brackets"),
        ("[::1]", "[ipv6]:port"),
        ("[::1:5555", "closing"),
        ("[host]:1", "IPv6"),
        ("tcp://host:5555", "host"),
        ("a b:1", "host"),
        ("cmle-training-[ID]-0:2222", "host"),
    ],
)
def test_parse_address_rejects(text, why):
    with pytest.raises(ConfigError) as caught:
        parse_address(text, "SOME_VARIABLE")
    assert "SOME_VARIABLE" in str(caught.value) and why in str(caught.value)


# --- every error names its variable ---------------------------------------------------------

GOOD = {"RS_REDUCERS": "a:5000"}


def spec_with(variable: str, fixture: str, change) -> Dict[str, str]:
    document = load(fixture)
    change(document)
    return {variable: json.dumps(document)}


@pytest.mark.parametrize(
    "environ, variable, fragment",
    [
        # explicit rank and world
        (dict(GOOD, RS_RANK="x", RS_WORLD_SIZE="2"), "RS_RANK", "non-negative integer"),
        (dict(GOOD, RS_RANK="-1", RS_WORLD_SIZE="2"), "RS_RANK", "non-negative integer"),
        (dict(GOOD, RS_RANK="1.0", RS_WORLD_SIZE="2"), "RS_RANK", "non-negative integer"),
        (dict(GOOD, RS_RANK="2", RS_WORLD_SIZE="2"), "RS_RANK", "less than RS_WORLD_SIZE"),
        (dict(GOOD, RS_RANK="0", RS_WORLD_SIZE="0"), "RS_WORLD_SIZE", ">= 1"),
        (dict(GOOD, RS_RANK="0"), "RS_WORLD_SIZE", "RS_WORLD_SIZE is not set"),
        (dict(GOOD, RS_WORLD_SIZE="2"), "RS_RANK", "RS_RANK is not set"),
        (dict(GOOD, RS_RANK="", RS_WORLD_SIZE="2"), "RS_RANK", "empty"),
        # launcher variables
        (dict(GOOD, RANK="0"), "WORLD_SIZE", "WORLD_SIZE is not set"),
        (dict(GOOD, HOROVOD_SIZE="2"), "HOROVOD_RANK", "HOROVOD_RANK is not set"),
        (dict(GOOD, OMPI_COMM_WORLD_RANK="4", OMPI_COMM_WORLD_SIZE="4"), "OMPI_COMM_WORLD_RANK", "less than"),
        (dict(GOOD, RANK="0", WORLD_SIZE="two"), "WORLD_SIZE", ">= 1"),
        # the reducer list
        ({"RS_RANK": "0", "RS_WORLD_SIZE": "1"}, "RS_REDUCERS", "not set"),
        ({"RS_RANK": "0", "RS_WORLD_SIZE": "1", "RS_REDUCERS": "a:1,,b:2"}, "RS_REDUCERS", "empty entry at position 1"),
        ({"RS_RANK": "0", "RS_WORLD_SIZE": "1", "RS_REDUCERS": "a:1,b:2,"}, "RS_REDUCERS", "empty entry at position 2"),
        ({"RS_RANK": "0", "RS_WORLD_SIZE": "1", "RS_REDUCERS": "a:1,b:2,A:1"}, "RS_REDUCERS", "twice"),
        ({"RS_RANK": "0", "RS_WORLD_SIZE": "1", "RS_REDUCERS": "a:1,b"}, "RS_REDUCERS", "no :port"),
        ({"RS_RANK": "0", "RS_WORLD_SIZE": "1", "RS_REDUCERS": " "}, "RS_REDUCERS", "empty"),
        # identity
        (dict(GOOD, RS_RANK="0", RS_WORLD_SIZE="1", RS_GENERATION="-1"), "RS_GENERATION", "non-negative integer"),
        (dict(GOOD, RS_RANK="0", RS_WORLD_SIZE="1", RS_GENERATION="new"), "RS_GENERATION", "non-negative integer"),
        (dict(GOOD, RS_RANK="0", RS_WORLD_SIZE="1", RS_JOB_ID=str(2**64)), "RS_JOB_ID", "64 bits"),
        (dict(GOOD, RS_RANK="0", RS_WORLD_SIZE="1", RS_JOB_ID="0x1" + "0" * 16), "RS_JOB_ID", "64 bits"),
        # CLUSTER_SPEC
        ({"CLUSTER_SPEC": '{"cluster": {"workerpool0": ["a:1"]},'}, "CLUSTER_SPEC", "not valid JSON"),
        ({"CLUSTER_SPEC": "[1, 2]"}, "CLUSTER_SPEC", "JSON object"),
        (
            spec_with("CLUSTER_SPEC", "vertex_cluster_spec.json", lambda d: d.pop("cluster")),
            "CLUSTER_SPEC",
            '"cluster"',
        ),
        (spec_with("CLUSTER_SPEC", "vertex_cluster_spec.json", lambda d: d.pop("task")), "CLUSTER_SPEC", '"task"'),
        (
            spec_with(
                "CLUSTER_SPEC", "vertex_cluster_spec.json", lambda d: d["task"].update(index=2, type="workerpool1")
            ),
            "CLUSTER_SPEC",
            "workerpool1[2] is beyond",
        ),
        (
            spec_with("CLUSTER_SPEC", "vertex_cluster_spec.json", lambda d: d["task"].update(index=1)),
            "CLUSTER_SPEC",
            "workerpool0[1] is beyond",
        ),
        (
            spec_with("CLUSTER_SPEC", "vertex_cluster_spec.json", lambda d: d["task"].update(type="workerpool4")),
            "CLUSTER_SPEC",
            "task type 'workerpool4'",
        ),
        (
            spec_with("CLUSTER_SPEC", "vertex_cluster_spec.json", lambda d: d["task"].update(index="first")),
            "CLUSTER_SPEC",
            "task.index",
        ),
        (
            spec_with("CLUSTER_SPEC", "vertex_cluster_spec.json", lambda d: d["task"].update(index=True)),
            "CLUSTER_SPEC",
            "task.index",
        ),
        (
            spec_with("CLUSTER_SPEC", "vertex_cluster_spec.json", lambda d: d["task"].pop("type")),
            "CLUSTER_SPEC",
            "task.type",
        ),
        (
            spec_with("CLUSTER_SPEC", "vertex_cluster_spec.json", lambda d: d["cluster"].update(worker=["w:1"])),
            "CLUSTER_SPEC",
            "unknown pool 'worker'",
        ),
        (
            spec_with("CLUSTER_SPEC", "vertex_cluster_spec.json", lambda d: d["cluster"]["workerpool0"].append("b:2")),
            "CLUSTER_SPEC",
            "exactly one primary",
        ),
        (
            spec_with("CLUSTER_SPEC", "vertex_cluster_spec.json", lambda d: d["cluster"].update(workerpool1="w:1")),
            "CLUSTER_SPEC",
            "list of",
        ),
        (
            spec_with("CLUSTER_SPEC", "vertex_cluster_spec.json", lambda d: d["cluster"]["workerpool2"].append("bad")),
            "CLUSTER_SPEC cluster.workerpool2",
            "no :port",
        ),
        (
            spec_with(
                "CLUSTER_SPEC",
                "vertex_cluster_spec.json",
                lambda d: d["cluster"]["workerpool2"].append(d["cluster"]["workerpool2"][0]),
            ),
            "CLUSTER_SPEC cluster.workerpool2",
            "twice",
        ),
        ({"CLUSTER_SPEC": " "}, "CLUSTER_SPEC", "empty"),
        # TF_CONFIG
        ({"TF_CONFIG": "{'cluster': {}}"}, "TF_CONFIG", "not valid JSON"),
        (
            spec_with("TF_CONFIG", "ai_platform_tf_config_chief.json", lambda d: d.pop("cluster")),
            "TF_CONFIG",
            '"cluster"',
        ),
        (spec_with("TF_CONFIG", "ai_platform_tf_config_chief.json", lambda d: d.pop("task")), "TF_CONFIG", '"task"'),
        (
            spec_with("TF_CONFIG", "ai_platform_tf_config_chief.json", lambda d: d["cluster"]["chief"].append("c:1")),
            "TF_CONFIG",
            "one chief",
        ),
        (
            spec_with("TF_CONFIG", "ai_platform_tf_config_chief.json", lambda d: d["cluster"].update(master=["m:1"])),
            "TF_CONFIG",
            "both chief and master",
        ),
        (
            spec_with("TF_CONFIG", "ai_platform_tf_config_chief.json", lambda d: d["task"].update(type="master")),
            "TF_CONFIG",
            "master[0] is beyond",
        ),
        (
            spec_with("TF_CONFIG", "ai_platform_tf_config_chief.json", lambda d: d["task"].update(index=2)),
            "TF_CONFIG",
            "worker[2] is beyond",
        ),
        (
            spec_with("TF_CONFIG", "ai_platform_tf_config_chief.json", lambda d: d["task"].update(type="workerpool1")),
            "TF_CONFIG",
            "task type 'workerpool1'",
        ),
        (
            spec_with(
                "TF_CONFIG", "ai_platform_tf_config_chief.json", lambda d: d["cluster"].update(controller=["x:1"])
            ),
            "TF_CONFIG",
            "unknown pool 'controller'",
        ),
        (
            spec_with("TF_CONFIG", "tf_config_no_chief.json", lambda d: d["cluster"].pop("worker")),
            "TF_CONFIG",
            "no chief, master or worker",
        ),
    ],
)
def test_worker_errors_name_the_variable(environ, variable, fragment):
    message = config_error(discover_worker, environ)
    assert variable in message and fragment in message


def test_json_error_says_where():
    message = config_error(discover_worker, {"CLUSTER_SPEC": '{\n  "cluster": {,\n}'})
    assert "CLUSTER_SPEC is not valid JSON" in message and "line 2 column" in message


@pytest.mark.parametrize(
    "environ, variable, fragment",
    [
        ({"RS_REDUCER_INDEX": "2", "RS_REDUCERS": "a:1,b:2"}, "RS_REDUCER_INDEX", "out of range"),
        ({"RS_REDUCER_INDEX": "one", "RS_REDUCERS": "a:1"}, "RS_REDUCER_INDEX", "non-negative integer"),
        ({"RS_REDUCER_INDEX": "0"}, "RS_REDUCERS", "not set"),
        ({"RS_REDUCER_INDEX": "0", "RS_REDUCERS": "a:0"}, "RS_REDUCERS", "1..65535"),
        ({"RS_REDUCER_INDEX": "0", "RS_REDUCERS": "a:1", "RS_WORLD_SIZE": "0"}, "RS_WORLD_SIZE", ">= 1"),
        ({"RS_REDUCER_INDEX": "0", "RS_REDUCERS": "a:1", "RS_BIND_HOST": ""}, "RS_BIND_HOST", "empty"),
        (vertex("workerpool2", 0, RS_PROCS_PER_HOST="-2"), "RS_PROCS_PER_HOST", ">= 1"),
        (vertex("workerpool2", 5), "CLUSTER_SPEC", "workerpool2[5] is beyond"),
        (tf_config("tf_config_no_chief.json", "ps", 2), "TF_CONFIG", "ps[2] is beyond"),
        (spec_with("CLUSTER_SPEC", "vertex_cluster_spec.json", lambda d: d.pop("task")), "CLUSTER_SPEC", '"task"'),
    ],
)
def test_reducer_errors_name_the_variable(environ, variable, fragment):
    message = config_error(discover_reducer, environ)
    assert variable in message and fragment in message
