"""DDP on the reduction_server backend under `torchrun --max-restarts 1`: a worker SIGKILLed in
the middle of a run, torchrun's agent restarts the group (TORCHELASTIC_RESTART_COUNT, which the
workers add to their generation), the same reducers serve it, it resumes from the checkpoint, and
the final model equals an undisturbed run's bit for bit. And a group that its platform starts again
with the same environment (a pod restart: the same TORCHELASTIC_RUN_ID, MASTER_ADDR and
MASTER_PORT) is a new run to the reducers: its ranks agree on a run id of their own through the
rendezvous store."""

import subprocess

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install torch) - the backend needs it")

from helpers.cluster import TOKEN, child_env, reducers, run_workers, torchrun  # noqa: E402
from helpers.ports import free_ports  # noqa: E402

STEPS = 12


def restartable_run(group, directory, kill_step: int) -> subprocess.CompletedProcess:
    env = child_env({"RS_REDUCERS": group.spec, "RS_JOB_TOKEN": TOKEN, "RS_TIMEOUT": "30"})
    return subprocess.run(
        torchrun("torchrun_restart.py", str(directory), str(STEPS), str(kill_step), options=("--max-restarts", "1")),
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        cwd=directory,
    )


def test_a_worker_killed_mid_run_is_restarted_and_training_ends_as_undisturbed(tmp_path):
    undisturbed, disturbed = tmp_path / "undisturbed", tmp_path / "disturbed"
    undisturbed.mkdir()
    disturbed.mkdir()
    with reducers(2, workers=2) as group:
        calm = restartable_run(group, undisturbed, -1)
        assert calm.returncode == 0, calm.stdout[-3000:] + calm.stderr[-3000:]
        hit = restartable_run(group, disturbed, 5)
        assert hit.returncode == 0, hit.stdout[-3000:] + hit.stderr[-3000:]
        assert group.alive(), "a reducer died"
    assert "rank 0 attempt 0 resumed from 0" in calm.stdout and "attempt 1" not in calm.stdout
    # Rank 1 died before step 5's all-reduce, which rank 0 then never finished: both ranks of the
    # restarted group resume from the checkpoint rank 0 wrote after step 4.
    resumed = sorted(line for line in hit.stdout.splitlines() if " attempt 1 resumed from " in line)
    assert resumed == ["rank 0 attempt 1 resumed from 5", "rank 1 attempt 1 resumed from 5"], hit.stdout
    final_calm = torch.load(undisturbed / "final.pt")
    final_hit = torch.load(disturbed / "final.pt")
    assert final_calm.keys() == final_hit.keys()
    for name in final_calm:
        assert torch.equal(final_calm[name], final_hit[name]), name


def test_a_group_started_again_with_the_same_environment_is_a_new_run():
    """Two starts of one job with the same variables, as a PyTorchJob's pod restart gives them:
    each start's ranks name it alike (the launcher's run id and a nonce rank 0 put in the store),
    and the two starts differently, so that a reducer never takes the second start's ranks for
    late ranks of the first (docs/reliability.md, "Restarts"; the reducer's side is
    test_communicator_lifetime's run-id tests)."""
    env = {"TORCHELASTIC_RUN_ID": "pytorchjob-7", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_ports(1)[0])}
    with reducers(1, workers=2) as group:
        starts = [run_workers(2, group, "torch_run_id.py", [], extra_env=env, timeout=120) for _ in range(2)]
    names = []
    for ranks in starts:
        assert [r["sum"] for r in ranks] == [[2.0] * 4] * 2
        (name,) = {r["run_id"] for r in ranks}
        assert name.startswith("pytorchjob-7/") and len(name) > len("pytorchjob-7/"), name
        names.append(name)
    assert names[0] != names[1]
