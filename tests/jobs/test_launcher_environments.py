"""Where a process stands, under each launcher as it really starts it (issue 38): the environment
each launcher sets, as its own source or documentation has it, to the (rank, world size, local
rank, local size) discovery finds, None where nothing says (docs/configuration.md, "How a process
finds its place"). Torch hands the backend its rank and world size itself, so a launcher that
leaves them to init_process_group's arguments (Lightning, Ray Train) is read as the backend
reads it (discover_worker(rank=, world_size=), as client/torch/process_group.py does).

Then Lightning's launcher for real: a 2-rank torch job through the backend and real reducers with
only the variables Lightning sets, which failed with "LOCAL_RANK is set but LOCAL_WORLD_SIZE is
not set" before the backend stopped asking for a local size it does not need.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Dict, Optional, Tuple

import pytest

from helpers.cluster import TOKEN, child_env, collect, reducers
from helpers.cluster_specs import VERTEX_REDUCERS, as_task, config_error, load, vertex
from helpers.ports import free_ports
from reduction_server.config import discovery, settings
from reduction_server.config.discovery import discover_worker

REDUCERS = {"RS_REDUCERS": "10.0.0.5:5555,10.0.0.6:5555"}  # what the job adds to any launcher's
MASTER = {"MASTER_ADDR": "10.0.0.2", "MASTER_PORT": "29500"}
# torchrun --nnodes 2 --nproc-per-node 4, the third process of the second node
# (torch/distributed/elastic/agent/server/local_elastic_agent.py, _start_workers)
TORCHRUN = {
    **MASTER,
    "RANK": "6",
    "LOCAL_RANK": "2",
    "GROUP_RANK": "1",
    "ROLE_RANK": "6",
    "ROLE_NAME": "default",
    "LOCAL_WORLD_SIZE": "4",
    "WORLD_SIZE": "8",
    "GROUP_WORLD_SIZE": "2",
    "ROLE_WORLD_SIZE": "8",
    "TORCHELASTIC_RESTART_COUNT": "0",
    "TORCHELASTIC_MAX_RESTARTS": "0",
    "TORCHELASTIC_RUN_ID": "none",
    "TORCHELASTIC_USE_AGENT_STORE": "True",
    "OMP_NUM_THREADS": "1",
}
# srun --nodes 4 --ntasks 7 (three nodes of two tasks, one of one), the task of the fourth node
# (Slurm's env.c: setup_env and env_array_for_step; srun(1), OUTPUT ENVIRONMENT VARIABLES)
SRUN = {
    "SLURM_JOB_ID": "4242",
    "SLURM_STEP_ID": "0",
    "SLURM_STEPID": "0",
    "SLURM_PROCID": "6",
    "SLURM_LOCALID": "0",
    "SLURM_NODEID": "3",
    "SLURM_NTASKS": "7",
    "SLURM_NPROCS": "7",
    "SLURM_NNODES": "4",
    "SLURM_STEP_NUM_TASKS": "7",
    "SLURM_STEP_NUM_NODES": "4",
    "SLURM_TASKS_PER_NODE": "2(x3),1",
    "SLURM_STEP_TASKS_PER_NODE": "2(x3),1",
    "SLURM_JOB_NODELIST": "node[01-04]",
    "SLURMD_NODENAME": "node04",
}
# the batch script of `sbatch --ntasks 4 --ntasks-per-node 2`, outside any srun step: sbatch(1)
SBATCH = {
    "SLURM_JOB_ID": "4242",
    "SLURM_PROCID": "0",
    "SLURM_LOCALID": "0",
    "SLURM_NODEID": "0",
    "SLURM_NTASKS": "4",
    "SLURM_NPROCS": "4",
    "SLURM_NNODES": "2",
    "SLURM_TASKS_PER_NODE": "2(x2)",
    "SLURM_NTASKS_PER_NODE": "2",
    "SLURM_JOB_NODELIST": "node[01-02]",
}

#: launcher -> (its environment, the rank and world size torch hands the backend or None,
#: the expected (rank, world size, local rank, local size); None: unknown)
Row = Tuple[Dict[str, str], Optional[Tuple[int, int]], Tuple[int, int, Optional[int], Optional[int]]]
LAUNCHERS: Dict[str, Row] = {
    "torchrun": (TORCHRUN, None, (6, 8, 2, 4)),
    # Lightning's own launcher, Trainer(devices=2): the process it starts for local rank 1
    # (lightning/fabric/strategies/launchers/subprocess_script.py, _call_children_scripts); no
    # RANK: Lightning calls init_process_group(backend, rank=, world_size=)
    # (lightning/fabric/utilities/distributed.py, _init_dist_connection)
    "lightning": (
        {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "NODE_RANK": "0", "LOCAL_RANK": "1", "WORLD_SIZE": "2"},
        (1, 2),
        (1, 2, 1, None),
    ),
    # `deepspeed --num_nodes 2 --num_gpus 2`, the second process of the second node
    # (deepspeed/launcher/launch.py, main)
    "deepspeed": (
        {
            **MASTER,
            "WORLD_SIZE": "4",
            "CROSS_RANK": "1",
            "CROSS_SIZE": "2",
            "LOCAL_SIZE": "2",
            "RANK": "3",
            "LOCAL_RANK": "1",
        },
        None,
        (3, 4, 1, 2),
    ),
    # Ray Train V2's TorchTrainer, 4 workers on 2 nodes: at init_process_group only MASTER_ADDR/
    # MASTER_PORT are set (TorchConfig(init_method="env"); ray/train/torch/config.py, _TorchBackend.on_start),
    # plus the job's runtime_env env_vars; rank and world size are arguments
    "ray train, init_process_group": ({**MASTER}, (3, 4), (3, 4, None, None)),
    # ... and inside the training function (_set_torch_distributed_env_vars, on_training_start)
    "ray train, train function": (
        {
            **MASTER,
            "LOCAL_RANK": "1",
            "RANK": "3",
            "LOCAL_WORLD_SIZE": "2",
            "WORLD_SIZE": "4",
            "NODE_RANK": "1",
            "ACCELERATE_TORCH_DEVICE": "cpu",
        },
        None,
        (3, 4, 1, 2),
    ),
    # mpirun -np 4 --map-by ppr:2:node (Open MPI), the fourth process
    "mpirun (open mpi)": (
        {
            "OMPI_COMM_WORLD_RANK": "3",
            "OMPI_COMM_WORLD_SIZE": "4",
            "OMPI_COMM_WORLD_LOCAL_RANK": "1",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
            "OMPI_COMM_WORLD_NODE_RANK": "1",
            "OMPI_UNIVERSE_SIZE": "4",
            "PMIX_RANK": "3",
        },
        None,
        (3, 4, 1, 2),
    ),
    # mpiexec -n 4 -ppn 2 (MPICH's or Intel MPI's Hydra), the fourth process
    "mpiexec (mpich, intel mpi)": (
        {"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2", "PMI_FD": "7"},
        None,
        (3, 4, 1, 2),
    ),
    "srun, a node of one task": (SRUN, None, (6, 7, 0, 1)),
    "srun, a node of two": (
        dict(SRUN, SLURM_PROCID="3", SLURM_LOCALID="1", SLURM_NODEID="1", SLURMD_NODENAME="node02"),
        None,
        (3, 7, 1, 2),
    ),
    # srun --ntasks-per-node 2 --nodes 2 within `sbatch --ntasks-per-node 2`: every node alike
    "srun --ntasks-per-node": (
        {**SBATCH, "SLURM_STEP_ID": "1", "SLURM_PROCID": "2", "SLURM_NODEID": "1"},
        None,
        (2, 4, 0, 2),
    ),
    # torchrun --nproc-per-node 4, one per node by `srun --ntasks-per-node 1`: torchrun's variables win
    "torchrun under srun": (
        {
            **SRUN,
            **TORCHRUN,
            "SLURM_PROCID": "1",
            "SLURM_NTASKS": "2",
            "SLURM_NODEID": "1",
            "SLURM_TASKS_PER_NODE": "1(x2)",
        },
        None,
        (6, 8, 2, 4),
    ),
    # Lightning's launcher in an sbatch script (no srun): Slurm's batch-step counts must not meet its LOCAL_RANK
    "lightning in an sbatch script": (
        {
            **SBATCH,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "29500",
            "NODE_RANK": "0",
            "LOCAL_RANK": "1",
            "WORLD_SIZE": "2",
        },
        (1, 2),
        (1, 2, 1, None),
    ),
    # a PyTorchJob of a Master and 2 Workers (training-operator, pkg/controller.v1/pytorch/envvar.go):
    # Worker 1 is rank 2; one process per pod, which nothing says
    "kubeflow pytorchjob": (
        {
            "PYTHONUNBUFFERED": "0",
            "MASTER_ADDR": "pytorchjob-master-0",
            "MASTER_PORT": "23456",
            "WORLD_SIZE": "3",
            "RANK": "2",
        },
        None,
        (2, 3, None, None),
    ),
    # Vertex AI: CLUSTER_SPEC and TF_CONFIG, workerpool1[1] (the third host); one process per host
    "vertex ai cluster_spec": (
        dict(vertex("workerpool1", 1), TF_CONFIG=as_task(load("vertex_tf_config.json"), "worker", 1)),
        None,
        (2, 3, 0, 1),
    ),
    # ... with torchrun --nproc-per-node 8 on each host: each process its own rank, host by host
    "vertex ai with torchrun": (
        dict(vertex("workerpool1", 1), LOCAL_RANK="3", LOCAL_WORLD_SIZE="8", RANK="3", WORLD_SIZE="8"),
        None,
        (2 * 8 + 3, 3 * 8, 3, 8),
    ),
}


def place(environ: Dict[str, str], given: Optional[Tuple[int, int]]):
    env = dict(environ) if "CLUSTER_SPEC" in environ else {**REDUCERS, **environ}
    if given is None:
        return discover_worker(env)
    return discover_worker(env, rank=given[0], world_size=given[1])


@pytest.mark.parametrize("launcher", list(LAUNCHERS))
def test_each_launcher_places_its_processes(launcher):
    environ, given, expected = LAUNCHERS[launcher]
    found = place(environ, given)
    assert (found.rank, found.world_size, found.local_rank, found.local_world_size) == expected
    reducers_given = VERTEX_REDUCERS if "CLUSTER_SPEC" in environ else tuple(REDUCERS["RS_REDUCERS"].split(","))
    assert found.reducers == reducers_given


def test_every_launcher_variable_discovery_reads_is_declared_in_the_registry():
    read = {
        discovery._SLURM_STEP,
        *(name for pair in discovery._LAUNCHER_VARIABLES for name in pair),
        *(name for rank, sizes in discovery._LOCAL_VARIABLES for name in (rank, *sizes)),
    }
    assert read - set(settings.BY_NAME) == set()
    assert {
        "LOCAL_SIZE",
        "PMI_RANK",
        "MPI_LOCALNRANKS",
        "SLURM_PROCID",
        "SLURM_TASKS_PER_NODE",
        "SLURM_NTASKS_PER_NODE",
    } <= read


def test_an_sbatch_script_is_no_rank_of_its_job():
    """The batch script's own process has SLURM_PROCID=0 and the job's SLURM_NTASKS, and is no
    task of any step: discovery says it has no rank rather than make it rank 0 of 4 (a hang)."""
    assert "no rank for this worker" in config_error(discover_worker, {**REDUCERS, **SBATCH})
    # ... while torch's rank stands, and its local place stays unknown
    found = discover_worker({**REDUCERS, **SBATCH}, rank=0, world_size=1)
    assert (found.rank, found.world_size, found.local_rank, found.local_world_size) == (0, 1, None, None)


@pytest.mark.parametrize(
    "tasks_per_node, node, local_size",
    [
        ("4", None, 4),
        ("4(x16)", None, 4),
        ("2(x3),1", "0", 2),
        ("2(x3),1", "2", 2),
        ("2(x3),1", "3", 1),
        ("1,3(x2),2", "2", 3),
        ("2(x3),1", None, None),  # which node's entry: unknown without SLURM_NODEID
    ],
)
def test_slurm_tasks_per_node(tasks_per_node, node, local_size):
    environ = {
        **REDUCERS,
        "SLURM_STEP_ID": "0",
        "SLURM_PROCID": "0",
        "SLURM_NTASKS": "16",
        "SLURM_LOCALID": "0",
        "SLURM_TASKS_PER_NODE": tasks_per_node,
        **({"SLURM_NODEID": node} if node is not None else {}),
    }
    assert discover_worker(environ).local_world_size == local_size


@pytest.mark.parametrize(
    "extra, variable",
    [
        ({"SLURM_TASKS_PER_NODE": "2(x)"}, "SLURM_TASKS_PER_NODE"),
        ({"SLURM_TASKS_PER_NODE": "two"}, "SLURM_TASKS_PER_NODE"),
        ({"SLURM_TASKS_PER_NODE": "2(x3),1", "SLURM_NODEID": "4"}, "SLURM_NODEID"),
        ({"SLURM_TASKS_PER_NODE": "2(x3),1", "SLURM_NODEID": "3", "SLURM_LOCALID": "1"}, "SLURM_LOCALID"),
        ({"SLURM_PROCID": "7"}, "SLURM_PROCID"),  # of SLURM_NTASKS=7
        ({"MPI_LOCALRANKID": "2", "MPI_LOCALNRANKS": "2", "PMI_RANK": "0", "PMI_SIZE": "2"}, "MPI_LOCALRANKID"),
        ({"LOCAL_RANK": "2", "LOCAL_SIZE": "2"}, "LOCAL_RANK"),
    ],
)
def test_malformed_or_contradictory_launcher_values_are_errors(extra, variable):
    environ = {
        **REDUCERS,
        "SLURM_STEP_ID": "0",
        "SLURM_PROCID": "6",
        "SLURM_NTASKS": "7",
        "SLURM_LOCALID": "0",
        **extra,
    }
    assert variable in config_error(discover_worker, environ)


def test_a_local_size_is_needed_only_to_number_a_cluster_spec_hosts_processes():
    # Lightning's launcher on a Vertex host: torch's rank stands; the spec's numbering would need the size
    environ = vertex("workerpool1", 1, LOCAL_RANK="1", NODE_RANK="0", WORLD_SIZE="2")
    assert discover_worker(environ, rank=5, world_size=8).local_world_size is None
    assert "LOCAL_WORLD_SIZE" in config_error(discover_worker, environ)
    # DeepSpeed's LOCAL_SIZE numbers them as LOCAL_WORLD_SIZE does
    found = discover_worker(dict(environ, LOCAL_SIZE="2"))
    assert (found.rank, found.world_size) == (2 * 2 + 1, 3 * 2)


# --- Lightning's launcher, for real ---------------------------------------------------------------

# What Lightning's DDPStrategy does in each process it starts: init_process_group with the global
# rank and world size as arguments (lightning/fabric/utilities/distributed.py), then collectives
# as DDP's. The backend is imported as today's docs say; self-registration: test_torch_autoload.py.
LIGHTNING_RANK = """
import json, os
import torch
import torch.distributed as dist
import reduction_server.client.torch  # noqa: F401

torch.set_num_threads(1)
world = int(os.environ["WORLD_SIZE"])
rank = int(os.environ["NODE_RANK"]) * world + int(os.environ["LOCAL_RANK"])  # one node: devices=world
dist.init_process_group("reduction_server", rank=rank, world_size=world)
x = torch.full((1000,), float(rank + 1))
dist.all_reduce(x)
gathered = [torch.zeros(2) for _ in range(world)]
dist.all_gather(gathered, torch.tensor([float(rank), float(world)]))
dist.barrier()
print(json.dumps({"rank": dist.get_rank(), "size": dist.get_world_size(), "sum": x[0].item(),
                  "gathered": [g.tolist() for g in gathered]}))
dist.destroy_process_group()
"""
# Every variable some launcher sets for placement: none of them may leak in from the test's own
# environment, so that each rank sees exactly what Lightning sets.
PLACEMENT = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "LOCAL_SIZE",
    "NODE_RANK",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "HOROVOD_RANK",
    "HOROVOD_SIZE",
    "HOROVOD_LOCAL_RANK",
    "HOROVOD_LOCAL_SIZE",
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "OMPI_COMM_WORLD_LOCAL_SIZE",
    "PMI_RANK",
    "PMI_SIZE",
    "MPI_LOCALRANKID",
    "MPI_LOCALNRANKS",
    "SLURM_STEP_ID",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "SLURM_LOCALID",
    "SLURM_NODEID",
    "SLURM_TASKS_PER_NODE",
    "SLURM_NTASKS_PER_NODE",
    "TORCHELASTIC_RESTART_COUNT",
)


def test_a_two_rank_job_under_lightnings_launcher_environment(tmp_path):
    """init_process_group("reduction_server") with only LOCAL_RANK, NODE_RANK, WORLD_SIZE,
    MASTER_ADDR and MASTER_PORT set, as Lightning's launcher sets them: both ranks complete
    their collectives (before: ConfigError, LOCAL_RANK is set but LOCAL_WORLD_SIZE is not)."""
    pytest.importorskip("torch", reason="torch is not installed (pip install torch) - the backend needs it")
    script = tmp_path / "lightning_rank.py"
    script.write_text(LIGHTNING_RANK)
    world = 2
    (master_port,) = free_ports(1)
    with reducers(1, workers=world) as group:
        procs = []
        for local_rank in range(world):
            env = {k: v for k, v in child_env().items() if k not in PLACEMENT}
            env.update(
                {
                    "RS_REDUCERS": group.spec,
                    "RS_JOB_TOKEN": TOKEN,
                    "RS_CONNECT_TIMEOUT": "30",
                    "RS_TIMEOUT": "60",
                    "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(master_port),
                    "NODE_RANK": "0",
                    "LOCAL_RANK": str(local_rank),
                    "WORLD_SIZE": str(world),
                }
            )
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(script)],
                    env=env,
                    cwd=tmp_path,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            )
        results = collect(procs, timeout=180)
    assert [(r["rank"], r["size"]) for r in results] == [(0, 2), (1, 2)]
    assert all(r["sum"] == 3.0 for r in results)
    assert all(r["gathered"] == [[0.0, 2.0], [1.0, 2.0]] for r in results)
