"""Ray Train with the backend (issue 38, scope 3; docs/frameworks.md, "Ray Train"): a TorchTrainer
of 2 CPU workers with `TorchConfig(backend="reduction_server")`, no `worker_process_setup_hook` and
nothing of reduction_server imported (torch's `torch.backends` entry point registers the backend in
Ray's workers), the reducers reached through `runtime_env={"env_vars": ...}` only; its final
parameters compared with the same TorchTrainer on Gloo (1e-5), and with each other.

Ray's start takes most of the time, so one local Ray cluster (one driver, tests/scripts/
trainer_ray.py) runs both trainers, Gloo's and the backend's, side by side. Deselect with
-m "not trainers". The test extra installs Ray Train; where it is missing the test skips, saying
how to install it.
"""

from __future__ import annotations

import secrets
import sys
import tempfile

import pytest

from helpers.cluster import SCRIPTS
from helpers.trainers import check, needs, on_reducers, written

pytestmark = [pytest.mark.trainers, pytest.mark.timeout(420)]
#: Ray's start and the two trainers' worker groups: 1-2 minutes on 2 busy cores
TIMEOUT = 360


def test_ray_train_torch_trainer_with_env_vars_only(tmp_path):
    needs("ray", "pyarrow", "pandas", install="'ray[train]'")
    # Ray's session files (with sockets, whose paths must stay short) in a folder of this test; the
    # cluster's token given, so that Ray writes none to ~/.ray; the cluster on loopback (Ray's
    # one-host mode, its default on Windows and macOS: node address 127.0.0.1, servers bound there)
    with tempfile.TemporaryDirectory(prefix="rs-ray-") as ray_tmp:
        ray = {
            "RAY_TMPDIR": ray_tmp,
            "RAY_AUTH_TOKEN": secrets.token_hex(16),
            "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
            "RAY_USAGE_STATS_ENABLED": "0",
        }
        command = [sys.executable, str(SCRIPTS / "trainer_ray.py"), str(tmp_path), "gloo", "reduction_server"]
        results = on_reducers(command, tmp_path / "reduction_server", ray, TIMEOUT)
    gloo = written(tmp_path / "gloo")
    assert [r["backend"] for r in gloo] == ["gloo", "gloo"]
    check(results, gloo)
