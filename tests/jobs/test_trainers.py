"""The training frameworks people run, each passing the backend as its own documentation says to
pass a custom one (issue 38, scope 3; docs/frameworks.md, "Trainers"): 2 ranks on CPU through a real
reducer, the final parameters compared with the same training on Gloo (1e-5), and with each other.

Every job is a script of tests/scripts/trainer_*.py that never imports reduction_server: the
installed package's `torch.backends` entry point registers the backend. Each rank of a job sees its
own part of the data (asserted), so ranks whose gradients were not all-reduced would diverge.

- PyTorch Lightning: DDPStrategy(process_group_backend=...) with Lightning's own launcher (it
  starts rank 1 itself, as `_SubprocessScriptLauncher` does on CPU with devices=2) and under
  torchrun; ModelParallelStrategy (FSDP2 fully_shard) on CPU. (FSDPStrategy, FSDP1, refuses a CPU
  accelerator in Lightning itself.)
- Hugging Face Accelerate on CPU: the group initialised first, then Accelerator(cpu=True);
  Accelerate's own InitProcessGroupKwargs(backend=) is refused on CPU (asserted, as documented).
- Hugging Face Transformers' Trainer: the group initialised first, ddp_backend unset; its
  ddp_backend list refuses the name (asserted, as documented).

The Gloo reference of each is the framework's own way to run Gloo, run once per module. Deselect
them all with -m "not trainers"; a framework that is not installed skips, naming its package.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Callable, Dict, List, Optional

import psutil
import pytest

from helpers.cluster import SCRIPTS, TOKEN, child_env, once, reducers

pytestmark = [pytest.mark.trainers, pytest.mark.timeout(240)]

TOLERANCE = 1e-5
JOB_TIMEOUT = 180  # seconds; a job takes 10-30 s on 2 free cores
#: every variable through which a launcher places a process: none may leak in from the test's own
#: environment, so that each job sees only what its launcher sets
PLACEMENT_PREFIXES = (
    "TORCHELASTIC_",
    "SLURM_",
    "OMPI_",
    "PMI_",
    "PMIX_",
    "MPI_LOCAL",
    "HOROVOD_",
    "PL_",
    "ACCELERATE_",
)
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
    "TORCH_DEVICE_BACKEND_AUTOLOAD",
    "CLUSTER_SPEC",
    "TF_CONFIG",
)
_references: Dict[str, List[dict]] = {}


def needs(*packages: str) -> None:
    """Skip, naming what to install, unless each package is importable (found, not imported: the
    frameworks take seconds to import, and only the jobs need them)."""
    for package in ("torch", *packages):
        if importlib.util.find_spec(package) is None:
            pytest.skip(f"{package} is not installed (pip install {package}, or pip install '.[test]')")


def job_env(extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    env = {k: v for k, v in child_env().items() if k not in PLACEMENT and not k.startswith(PLACEMENT_PREFIXES)}
    env.update(
        {
            "OMP_NUM_THREADS": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
            **(extra or {}),
        }
    )
    return env


def run_job(command: List[str], out: Path, env: Dict[str, str], world: int = 2) -> List[dict]:
    """Run one job (a launcher and the ranks it starts) in its own session, so that nothing it
    started outlives it; each rank's OUT/rank<r>.json, by rank."""
    proc = subprocess.Popen(
        command,
        env=env,
        cwd=out.parent,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=JOB_TIMEOUT)
    except subprocess.TimeoutExpired:
        output = None
    finally:
        stop_tree(proc)
    assert output is not None, f"{command} did not finish within {JOB_TIMEOUT} s"
    assert proc.returncode == 0, f"{command} exited {proc.returncode}:\n{output[-6000:]}"
    missing = [r for r in range(world) if not (out / f"rank{r}.json").exists()]
    assert not missing, f"ranks {missing} wrote no result:\n{output[-6000:]}"
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def stop_tree(proc: subprocess.Popen) -> None:
    """Kill `proc`, every process it started (torchrun's workers start sessions of their own), and
    its session's process group; reap what is ours."""
    with contextlib.suppress(psutil.NoSuchProcess):
        for child in psutil.Process(proc.pid).children(recursive=True):
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    if proc.poll() is None:
        proc.kill()
    proc.wait(10)


def torchrun(script: str, *args: str) -> List[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(SCRIPTS / script),
        *args,
    ]


def on_reducers(command: List[str], out: Path) -> List[dict]:
    """The job through one real reducer, its rank processes given only RS_REDUCERS and the token."""
    with reducers(1, workers=2) as group:
        env = job_env(
            {"RS_REDUCERS": group.spec, "RS_JOB_TOKEN": TOKEN, "RS_CONNECT_TIMEOUT": "30", "RS_TIMEOUT": "60"}
        )
        results = run_job(command, out, env)
        assert group.alive(), "the reducer died during the job"
    return results


def reference(key: str, command: Callable[[Path], List[str]], tmp_path_factory) -> List[dict]:
    """The same training on Gloo (the job that command(OUT) starts), run once per module."""

    def run() -> List[dict]:
        out = tmp_path_factory.mktemp(key.replace(" ", "-")) / "out"
        return run_job(command(out), out, job_env())

    results = once(_references, key, run)
    assert [r["backend"] for r in results] == ["gloo", "gloo"]
    return results


def max_difference(a: List[float], b: List[float]) -> float:
    assert len(a) == len(b) and a, (len(a), len(b))
    return max(abs(x - y) for x, y in zip(a, b))


def check(results: List[dict], gloo: List[dict]) -> float:
    """Both ranks on the backend, trained the same steps on different data, equal to each other and
    to Gloo's within TOLERANCE; the largest difference from Gloo."""
    assert [(r["rank"], r["world"], r["backend"]) for r in results] == [
        (0, 2, "reduction_server"),
        (1, 2, "reduction_server"),
    ]
    assert [r["steps"] for r in results] == [r["steps"] for r in gloo] and results[0]["steps"] > 0
    assert results[0]["seen"] != results[1]["seen"], "both ranks saw the same data: synchronisation is unproven"
    assert [r["seen"] for r in results] == [r["seen"] for r in gloo]
    between_ranks = max_difference(results[0]["params"], results[1]["params"])
    assert between_ranks <= TOLERANCE, f"the ranks diverged: {between_ranks}"
    assert max_difference(gloo[0]["params"], gloo[1]["params"]) <= TOLERANCE
    worst = max(max_difference(r["params"], g["params"]) for r, g in zip(results, gloo))
    print(f"max |parameter - Gloo's| = {worst:.3g}")
    assert worst <= TOLERANCE, f"diverged from Gloo: max difference {worst}"
    return worst


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
