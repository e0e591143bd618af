"""Self-registration (issue 38): the installed package declares a `torch.backends` entry point
(setup.py; reduction_server_torch_autoload.py), which torch calls at the end of `import torch`.

- An unmodified torchrun script, whose backend is an argument and which never imports this
  project, runs on "reduction_server" through real reducers.
- A process that imports torch and never asks for the backend gets nothing but the name: no
  thread, no socket, no log line, torch's own env:// rendezvous handler, and neither
  reduction_server.client.torch nor even reduction_server imported.
- RS_TORCH_AUTOLOAD=0, and torch's TORCH_DEVICE_BACKEND_AUTOLOAD=0, turn it off: the backend is
  then unknown to torch.
- The hook never raises, whatever it meets, so a broken install cannot break `import torch`.
"""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
from typing import Dict

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install torch) - the backend needs it")
dist = pytest.importorskip("torch.distributed", reason="this torch build has no torch.distributed")
if not dist.is_available():
    pytest.skip("this torch build has no torch.distributed", allow_module_level=True)

from helpers.cluster import TOKEN, child_env, reducers, torchrun  # noqa: E402
from reduction_server.config import settings  # noqa: E402

HOOK = "reduction_server_torch_autoload"
OFF = {"RS_TORCH_AUTOLOAD": "0", "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}

# A process that imports torch, never asks for the backend, and reports what it has.
PROBE = r"""
import json, os, sys, threading
import torch
import torch.distributed as dist

rdzv = sys.modules["torch.distributed.rendezvous"]  # the module: its package re-exports a function of that name
handler = rdzv._rendezvous_handlers["env"]
def is_socket(fd):
    try:
        return os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
    except OSError:  # the directory's own descriptor, closed by now
        return False
report = {
    "registered": "REDUCTION_SERVER" in dist.Backend._plugins,
    "known": "reduction_server" in dist.Backend.backend_list,
    "threads": sorted(t.name for t in threading.enumerate()),
    "os_threads": len(os.listdir("/proc/self/task")),
    "sockets": sum(is_socket(fd) for fd in os.listdir("/proc/self/fd")),
    "env_handler": f"{handler.__module__}.{handler.__qualname__}",
    "modules": sorted(m for m in sys.modules if m.split(".")[0] in ("reduction_server", "zmq")),
    "hook": "reduction_server_torch_autoload" in sys.modules,
}
if "--try-init" in sys.argv:  # only where the backend is expected to be unknown
    try:
        dist.init_process_group("reduction_server", store=dist.HashStore(), rank=0, world_size=1)
        report["init"] = "created"
    except Exception as exc:
        report["init"] = f"{type(exc).__name__}: {exc}"
print(json.dumps(report))
"""
_reports: Dict[str, dict] = {}


def probe(mode: str) -> dict:
    """The probe's report in a fresh process: "on" (the default), or with one of OFF set."""
    if mode not in _reports:
        env = child_env(OFF if mode == "all off" else {mode: OFF[mode]} if mode in OFF else {})
        for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
            env.pop(name, None)
        if mode == "on":
            env.pop("TORCH_DEVICE_BACKEND_AUTOLOAD", None)
        args = ["--try-init"] if mode in OFF else []
        proc = subprocess.run(
            [sys.executable, "-c", PROBE, *args], env=env, capture_output=True, text=True, timeout=180
        )
        assert proc.returncode == 0, proc.stderr[-4000:]
        _reports[mode] = dict(json.loads(proc.stdout.strip().splitlines()[-1]), stderr=proc.stderr)
    return _reports[mode]


def test_the_package_declares_the_torch_backends_entry_point():
    points = [p for p in importlib.metadata.entry_points(group="torch.backends") if p.name == "reduction_server"]
    assert [p.value for p in points] == [f"{HOOK}:register"]


def test_import_torch_registers_the_backend_and_nothing_else():
    on, off = probe("on"), probe("all off")
    assert on["registered"] and on["known"] and on["hook"]
    # nothing of the package imported, not even its top level (nor pyzmq)
    assert on["modules"] == [] and off["modules"] == []
    # torch's own env:// handler, not the adapter's (which needs no MASTER_ADDR)
    assert on["env_handler"] == off["env_handler"] == "torch.distributed.rendezvous._env_rendezvous_handler"
    # no thread, no socket, no log line more than without the hook
    assert (on["threads"], on["os_threads"], on["sockets"]) == (off["threads"], off["os_threads"], off["sockets"])
    assert on["sockets"] == 0
    assert on["stderr"] == off["stderr"]


@pytest.mark.parametrize("variable", list(OFF))
def test_each_switch_turns_it_off(variable):
    report = probe(variable)
    assert not report["registered"] and not report["known"]
    assert report["hook"] == (variable == "RS_TORCH_AUTOLOAD")  # torch's switch loads no entry point at all
    assert report["init"] != "created" and "reduction_server" in report["init"], report["init"]


def test_the_hooks_off_values_are_the_registrys():
    hook = pytest.importorskip(HOOK)  # a plain ImportError before self-registration existed
    for word in ("0", "false", "no", "off", "1", "true", "yes", "on", "", "  OFF "):
        assert (word.strip().lower() in hook._OFF) == (
            settings.read("RS_TORCH_AUTOLOAD", {"RS_TORCH_AUTOLOAD": word}) is False
        ), word
    assert settings.BY_NAME["RS_TORCH_AUTOLOAD"].kind is bool


def test_the_hook_never_raises(monkeypatch):
    import reduction_server_torch_autoload as hook

    class Broken:
        def __getattr__(self, name):
            raise RuntimeError(f"a broken torch.distributed: {name}")

    monkeypatch.setitem(sys.modules, "torch.distributed", Broken())
    assert hook.register() is None
    monkeypatch.setenv("RS_TORCH_AUTOLOAD", "not a switch")
    assert hook.register() is None


def test_the_hook_imports_only_the_standard_library():
    code = (
        "import json, sys; before = set(sys.modules); import reduction_server_torch_autoload; "
        "print(json.dumps(sorted(set(sys.modules) - before)))"
    )
    proc = subprocess.run([sys.executable, "-c", code], env=child_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == [HOOK]


def test_a_malformed_switch_is_an_error_once_the_backend_is_asked_for():
    code = (
        "import torch, torch.distributed as dist\n"
        "assert 'REDUCTION_SERVER' in dist.Backend._plugins\n"
        "dist.init_process_group('reduction_server', store=dist.HashStore(), rank=0, world_size=1)\n"
    )
    env = child_env({"RS_TORCH_AUTOLOAD": "sometimes", "RS_REDUCERS": "127.0.0.1:1"})
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode != 0 and "RS_TORCH_AUTOLOAD='sometimes' is not a switch" in proc.stderr, proc.stderr[-3000:]


# An unmodified torchrun script in the style of pytorch/examples: the backend is an argument, and
# nothing of this project is imported.
TORCHRUN_SCRIPT = """
import argparse, json, sys
import torch
import torch.distributed as dist

parser = argparse.ArgumentParser()
parser.add_argument("--backend", default="gloo")
args = parser.parse_args()
before = sorted(m for m in sys.modules if m.split(".")[0] == "reduction_server")
torch.set_num_threads(1)
dist.init_process_group(args.backend)
rank, world = dist.get_rank(), dist.get_world_size()
x = torch.arange(6, dtype=torch.float32) * (rank + 1)
dist.all_reduce(x)
y = torch.tensor([float(rank)])
dist.broadcast(y, src=1)
dist.barrier()
report = {"rank": rank, "world": world, "sum": x.tolist(), "broadcast": y.item(), "before": before,
          "backend": dist.get_backend(), "adapter": "reduction_server.client.torch" in sys.modules}
with open(f"result-{rank}.json", "w") as out:  # a file each: the ranks' stdout lines may interleave
    json.dump(report, out)
dist.destroy_process_group()
"""


def test_an_unmodified_torchrun_script_runs_on_the_backend(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(TORCHRUN_SCRIPT)
    with reducers(1, workers=2) as group:
        env = child_env(
            {"RS_REDUCERS": group.spec, "RS_JOB_TOKEN": TOKEN, "RS_CONNECT_TIMEOUT": "30", "RS_TIMEOUT": "60"}
        )
        env.pop("TORCH_DEVICE_BACKEND_AUTOLOAD", None)
        proc = subprocess.run(
            torchrun(script, "--backend", "reduction_server"),
            env=env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=240,
        )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    results = [json.loads((tmp_path / f"result-{rank}.json").read_text()) for rank in range(2)]
    assert [(r["rank"], r["world"], r["backend"]) for r in results] == [
        (0, 2, "reduction_server"),
        (1, 2, "reduction_server"),
    ]
    assert all(r["sum"] == [0.0, 3.0, 6.0, 9.0, 12.0, 15.0] and r["broadcast"] == 1.0 for r in results)
    assert all(r["before"] == [] and r["adapter"] for r in results)  # imported by torch, when it made the backend
