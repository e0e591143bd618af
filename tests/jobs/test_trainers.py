"""The training frameworks people run, each passing the backend as its own documentation says to
pass a custom one (issue 38, scope 3; docs/frameworks.md, "Trainers"): 2 ranks on CPU through a real
reducer, the final parameters compared with the same training on Gloo (1e-5), and with each other.

Every job is a script of tests/scripts/trainer_*.py that never imports reduction_server: the
installed package's `torch.backends` entry point registers the backend. Each rank of a job sees its
own part of the data (asserted), so ranks whose gradients were not all-reduced would diverge.

- PyTorch Lightning: DDPStrategy(process_group_backend=...) with Lightning's own launcher (it
  starts rank 1 itself, as `_SubprocessScriptLauncher` does on CPU with devices=2) and under
  torchrun; ModelParallelStrategy (FSDP2 fully_shard) on CPU, with both launchers too. (FSDPStrategy,
  FSDP1, refuses a CPU accelerator in Lightning itself.)
- Hugging Face Accelerate on CPU: the group initialised first, then Accelerator(cpu=True), under
  torchrun and under Accelerate's own multi-CPU launcher (`accelerate launch --mpirun_hostfile`);
  Accelerate's own InitProcessGroupKwargs(backend=) is refused on CPU (asserted, as documented).
- Hugging Face Transformers' Trainer: the group initialised first, ddp_backend unset; its
  ddp_backend list refuses the name (asserted, as documented).

The Gloo reference of each is the framework's own way to run Gloo, run once per module. Deselect
them all with -m "not trainers"; a framework that is not installed skips, naming its package.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import List

import pytest

from helpers.cluster import SCRIPTS, torchrun
from helpers.ports import free_ports
from helpers.trainers import check, job_env, needs, on_reducers, reference, run_job

pytestmark = [pytest.mark.trainers, pytest.mark.timeout(240)]
ACCELERATE = [sys.executable, "-m", "accelerate.commands.accelerate_cli"]  # the `accelerate` command


# --- PyTorch Lightning ----------------------------------------------------------------------------


def lightning(backend: str, strategy: str, out: Path) -> List[str]:
    # `python train.py`: Lightning's launcher starts the second process itself
    return [sys.executable, str(SCRIPTS / "trainer_lightning.py"), backend, strategy, str(out)]


def test_lightning_ddp_with_lightnings_own_launcher(tmp_path, tmp_path_factory):
    needs("lightning")
    gloo = reference("lightning ddp", lambda out: lightning("gloo", "ddp", out), tmp_path_factory)
    out = tmp_path / "out"
    check(on_reducers(lightning("reduction_server", "ddp", out), out), gloo)


def test_lightning_ddp_under_torchrun(tmp_path, tmp_path_factory):
    needs("lightning")
    gloo = reference("lightning ddp", lambda out: lightning("gloo", "ddp", out), tmp_path_factory)
    out = tmp_path / "out"
    check(on_reducers(torchrun("trainer_lightning.py", "reduction_server", "ddp", str(out)), out), gloo)


def test_lightning_fsdp2_model_parallel_strategy_on_cpu(tmp_path, tmp_path_factory):
    needs("lightning")
    gloo = reference("lightning fsdp2", lambda out: lightning("gloo", "fsdp2", out), tmp_path_factory)
    out = tmp_path / "out"
    check(on_reducers(lightning("reduction_server", "fsdp2", out), out), gloo)


def test_lightning_fsdp2_model_parallel_strategy_under_torchrun(tmp_path, tmp_path_factory):
    needs("lightning")
    gloo = reference("lightning fsdp2", lambda out: lightning("gloo", "fsdp2", out), tmp_path_factory)
    out = tmp_path / "out"
    check(on_reducers(torchrun("trainer_lightning.py", "reduction_server", "fsdp2", str(out)), out), gloo)


# --- Hugging Face Accelerate ----------------------------------------------------------------------


def test_accelerate_cpu_recipe_group_first(tmp_path, tmp_path_factory):
    needs("accelerate")
    gloo = reference("accelerate", lambda out: torchrun("trainer_accelerate.py", "gloo", str(out)), tmp_path_factory)
    out = tmp_path / "out"
    results = on_reducers(torchrun("trainer_accelerate.py", "reduction_server", str(out)), out)
    check(results, gloo)
    # Accelerate took the group for its own: multi-CPU data parallel, the model in DDP
    assert all(
        r["accelerate"]
        == {"distributed_type": "DistributedType.MULTI_CPU", "num_processes": 2, "wrapped": "DistributedDataParallel"}
        for r in results + gloo
    )


def test_accelerate_launch_multi_cpu_through_mpirun(tmp_path, tmp_path_factory):
    """Accelerate's own multi-CPU launcher, `accelerate launch --mpirun_hostfile`: mpirun starts the
    ranks and sets no RANK, only its own OMPI_COMM_WORLD_*; the script imports the package, whose
    env:// handler reads them, before init_process_group (docs/frameworks.md)."""
    needs("accelerate")
    if shutil.which("mpirun") is None:
        pytest.skip("mpirun is not installed (apt-get install openmpi-bin): Accelerate's multi-CPU launcher needs it")
    gloo = reference("accelerate", lambda out: torchrun("trainer_accelerate.py", "gloo", str(out)), tmp_path_factory)
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=2\n")
    out = tmp_path / "out"
    command = [
        *ACCELERATE,
        "launch",
        "--cpu",
        "--num_processes",
        "2",
        "--mpirun_hostfile",
        str(hostfile),
        "--main_process_port",
        str(free_ports(1)[0]),
        str(SCRIPTS / "trainer_accelerate.py"),
        "reduction_server",
        str(out),
    ]
    root = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"} if os.geteuid() == 0 else {}
    results = on_reducers(command, out, root)
    check(results, gloo)
    assert all(r["backend"] == "reduction_server" and r["accelerate"]["num_processes"] == 2 for r in results)


def test_accelerate_refuses_a_custom_backend_on_cpu(tmp_path):
    """What docs/frameworks.md says blocks the documented way: InitProcessGroupKwargs(backend=) on
    CPU is replaced by Accelerate's own rule (gloo, or mpi) and refused."""
    needs("accelerate")
    out = tmp_path / "out"
    env = job_env({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"})
    (result,) = run_job(
        [sys.executable, str(SCRIPTS / "trainer_accelerate.py"), "kwargs:reduction_server", str(out)], out, env, world=1
    )
    assert result["error"] == (
        "ValueError: Your assigned backend reduction_server is not available, please use gloo"
    ), result


# --- Hugging Face Transformers' Trainer -----------------------------------------------------------


def test_transformers_trainer_on_a_group_initialised_first(tmp_path, tmp_path_factory):
    needs("transformers", "accelerate")
    gloo = reference(
        "transformers", lambda out: torchrun("trainer_transformers.py", "gloo", str(out)), tmp_path_factory
    )
    out = tmp_path / "out"
    results = on_reducers(torchrun("trainer_transformers.py", "reduction_server", str(out)), out)
    check(results, gloo)
    assert all(
        r["trainer"]
        == {"parallel_mode": "ParallelMode.DISTRIBUTED", "world_size": 2, "wrapped": "DistributedDataParallel"}
        for r in results + gloo
    )


def test_transformers_ddp_backend_refuses_the_name(tmp_path):
    """What docs/frameworks.md says blocks `ddp_backend`: its argparse choices, and on CPU
    Accelerate's rule (the same ValueError as Accelerate's own)."""
    needs("transformers", "accelerate")
    out = tmp_path / "out"
    env = job_env({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"})
    (result,) = run_job(
        [sys.executable, str(SCRIPTS / "trainer_transformers.py"), "ddp_backend:reduction_server", str(out)],
        out,
        env,
        world=1,
    )
    assert result["error"] == (
        "ValueError: Your assigned backend reduction_server is not available, please use gloo"
    ), result
    assert "invalid choice: 'reduction_server'" in result["parser"], result
