"""DeepSpeed on CPU with the backend (issue 38, scope 3; docs/frameworks.md, "DeepSpeed"): ZeRO
stage 1 and stage 2, the backend passed as DeepSpeed's documentation says to pass one,
`deepspeed.init_distributed(dist_backend="reduction_server")`, 2 ranks on CPU (DS_ACCELERATOR=cpu)
through a real reducer, under torchrun and under DeepSpeed's own launcher (`deepspeed
--num_accelerators 2`, which places its ranks with LOCAL_SIZE, not LOCAL_WORLD_SIZE); the final
parameters of each stage compared with the same training on Gloo (1e-5), and with each other.

One launch trains both stages (tests/scripts/trainer_deepspeed.py), and the one Gloo reference,
under torchrun, serves both launchers: a job costs DeepSpeed's import and start-up, so there are
three. Deselect with -m "not trainers". The test extra installs DeepSpeed; where it is missing
they skip, saying how to install it beside the torch installed.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Dict, List

import pytest

from helpers.cluster import SCRIPTS, torchrun
from helpers.ports import free_ports
from helpers.trainers import check, needs, on_reducers, reference

pytestmark = [pytest.mark.trainers, pytest.mark.timeout(240)]

SCRIPT = "trainer_deepspeed.py"
#: DeepSpeed's CPU accelerator, as its documentation for CPU says to select it
CPU = {"DS_ACCELERATOR": "cpu"}
STAGES = ("1", "2")


def deepspeed_launcher(*args: str) -> List[str]:
    """`deepspeed --num_accelerators 2 --master_port P SCRIPT ARGS`: the launcher's console script
    beside this Python (the one a user's PATH finds), on a free port (its default is 29500)."""
    (port,) = free_ports(1)
    launcher = Path(sys.executable).parent / "deepspeed"
    return [str(launcher), "--num_accelerators", "2", "--master_port", str(port), str(SCRIPTS / SCRIPT), *args]


def needs_deepspeed() -> None:
    # its requirements name torch unpinned: pinned beside it, pip keeps the torch installed
    needs("deepspeed", install="deepspeed torch==<the torch installed>")


def gloo(tmp_path_factory) -> List[dict]:
    return reference("deepspeed", lambda out: torchrun(SCRIPT, "gloo", str(out)), tmp_path_factory, CPU)


def stage(results: List[dict], zero: str) -> List[dict]:
    """Each rank's result of one ZeRO stage, as check() reads one job's."""
    return [{"rank": r["rank"], "world": r["world"], "backend": r["backend"], **r["zero"][zero]} for r in results]


def check_stages(results: List[dict], reference_results: List[dict]) -> Dict[str, float]:
    return {zero: check(stage(results, zero), stage(reference_results, zero)) for zero in STAGES}


def test_deepspeed_zero_1_and_2_under_torchrun(tmp_path, tmp_path_factory):
    needs_deepspeed()
    out = tmp_path / "out"
    results = on_reducers(torchrun(SCRIPT, "reduction_server", str(out)), out, CPU)
    check_stages(results, gloo(tmp_path_factory))
    assert all(r["placement"] == {"LOCAL_WORLD_SIZE": "2", "LOCAL_SIZE": None} for r in results)


def test_deepspeed_zero_1_and_2_with_deepspeeds_own_launcher(tmp_path, tmp_path_factory):
    needs_deepspeed()
    out = tmp_path / "out"
    results = on_reducers(deepspeed_launcher("reduction_server", str(out)), out, CPU)
    check_stages(results, gloo(tmp_path_factory))
    # placed by DeepSpeed's launcher, which gives the local size as LOCAL_SIZE only
    assert all(r["placement"] == {"LOCAL_WORLD_SIZE": None, "LOCAL_SIZE": "2"} for r in results)
