"""What the trainer jobs share (tests/jobs/test_trainers*.py): each job a launcher and the rank
processes it starts, with only what that launcher sets for placement, run once through a real reducer
and once on Gloo (the reference, once per session), their final parameters compared (1e-5)."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import subprocess
from pathlib import Path
from typing import Callable, Dict, List, Optional

import psutil
import pytest

from .cluster import TOKEN, child_env, once, reducers

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


def needs(*packages: str, install: Optional[str] = None) -> None:
    """Skip, naming what to install (`install`: the pip arguments, where the test extra lacks
    them), unless each package is importable (found, not imported: the frameworks take seconds to
    import, and only the jobs need them)."""
    for package in ("torch", *packages):
        if importlib.util.find_spec(package) is None:
            how = f"pip install {install}" if install else f"pip install {package}, or pip install '.[test]'"
            pytest.skip(f"{package} is not installed ({how})")


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


def run_job(
    command: List[str], out: Path, env: Dict[str, str], world: int = 2, timeout: float = JOB_TIMEOUT
) -> List[dict]:
    """Run one job (a launcher and the ranks it starts) in its own session, so that nothing it
    started outlives it, within `timeout` seconds; each rank's OUT/rank<r>.json, by rank."""
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
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        output = None
    finally:
        stop_tree(proc)
    assert output is not None, f"{command} did not finish within {timeout} s"
    assert proc.returncode == 0, f"{command} exited {proc.returncode}:\n{output[-6000:]}"
    return written(out, world, output)


def written(out: Path, world: int = 2, output: str = "") -> List[dict]:
    """Each rank's OUT/rank<r>.json, by rank; a rank that wrote none fails, with the job's output."""
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


def on_reducers(
    command: List[str], out: Path, extra: Optional[Dict[str, str]] = None, timeout: float = JOB_TIMEOUT
) -> List[dict]:
    """The job through one real reducer, its rank processes given only RS_REDUCERS and the token
    (and `extra`: the framework's own settings); as run_job() runs it."""
    with reducers(1, workers=2) as group:
        env = job_env(
            {
                "RS_REDUCERS": group.spec,
                "RS_JOB_TOKEN": TOKEN,
                "RS_CONNECT_TIMEOUT": "30",
                "RS_TIMEOUT": "60",
                **(extra or {}),
            }
        )
        results = run_job(command, out, env, timeout=timeout)
        assert group.alive(), "the reducer died during the job"
    return results


def reference(
    key: str, command: Callable[[Path], List[str]], tmp_path_factory, extra: Optional[Dict[str, str]] = None
) -> List[dict]:
    """The same training on Gloo (the job that command(OUT) starts, with `extra` in its
    environment), run once per session."""

    def run() -> List[dict]:
        out = tmp_path_factory.mktemp(key.replace(" ", "-")) / "out"
        return run_job(command(out), out, job_env(extra))

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
