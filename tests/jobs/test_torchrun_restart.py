"""DDP on the reduction_server backend under `torchrun --max-restarts 1`: a worker SIGKILLed in
the middle of a run, torchrun's agent restarts the group (TORCHELASTIC_RESTART_COUNT, which the
workers add to their generation), the same reducers serve it, it resumes from the checkpoint, and
the final model equals an undisturbed run's bit for bit."""

import subprocess

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install torch) - the backend needs it")

from helpers.cluster import TOKEN, child_env, reducers, torchrun  # noqa: E402

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
