"""The reducer image, for real: build the Dockerfile, run two reducer containers that find their
place from a Vertex-style CLUSTER_SPEC (task type workerpool2) or a TF_CONFIG (task type ps), and
all-reduce through them from two local worker processes whose CLUSTER_SPEC makes them workerpool0
and workerpool1, checking every result against NumPy; and examples/compose's job (reducer and
worker containers on a network of their own, one reducer container killed mid-job) under Debian's
docker-compose.

Needs a Docker engine: the one `docker info` reaches, or, as root with dockerd installed, a
private dockerd this module starts (own data root, exec root, pidfile, socket, no bridge, no
iptables) and stops. The base image is made without pulling anything: debootstrap (Debian
bookworm, minbase, with python3 and python3-venv; started when the session begins,
helpers/base_rootfs.py) imported with `docker import`, passed as BASE_IMAGE;
RS_DOCKER_BASE_IMAGE names an image to use instead (e.g. python:3.12-slim-bookworm,
if it is already on the engine). Without an engine, debootstrap, or network access to the
Debian mirror and PyPI (the image installs numpy and pyzmq from PyPI), the tests skip and say
which. Deselect with `-m "not docker"`. Everything made here (containers, images, the private
engine's state, temporary files) is removed at the end.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from fnmatch import fnmatch
from pathlib import Path
from typing import Dict, Iterator, List, Optional

import pytest

from helpers import base_rootfs
from helpers.cluster import collect, unreachable
from helpers.ports import free_ports
from helpers.source_tree import ROOT

WORKER = ROOT / "tests" / "scripts" / "deploy_worker.py"
TAG = f"rs-test-{uuid.uuid4().hex[:10]}"
TOKEN = "docker-test-token"

pytestmark = [pytest.mark.docker, pytest.mark.timeout(1200)]


def _run(
    cmd: List[str], env: Dict[str, str], timeout: float = 60, check: bool = True, **kwargs
) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout, **kwargs
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd[:4])}... exited {proc.returncode}:\n{proc.stdout[-4000:]}")
    return proc


class Engine:
    """A Docker engine: the client's environment, and what to undo at the end."""

    def __init__(self, env: Dict[str, str], private: Optional[Path]) -> None:
        self.env = env
        self.private = private  # our own dockerd's directory, or None for an existing engine
        self.images: List[str] = []  # tags and ids to remove (existing engine only)
        self.containers: List[str] = []

    def docker(self, *args: str, timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess:
        return _run(["docker", *args], self.env, timeout=timeout, check=check)

    def image_ids(self, dangling: bool = False) -> set:
        args = ["images", "-q", "--no-trunc"] + (["--filter", "dangling=true"] if dangling else ["-a"])
        return set(self.docker(*args).stdout.split())


def _engine_answers(env: Dict[str, str]) -> bool:
    try:
        return (
            subprocess.run(
                ["docker", "info"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=20
            ).returncode
            == 0
        )
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.fixture(scope="module", autouse=True)
def _teardown_on_sigterm() -> Iterator[None]:
    """`timeout pytest ...` sends SIGTERM, which would end pytest without its teardowns and leave
    containers, images and a private dockerd behind: make it an interruption instead."""

    def interrupt(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    if shutil.which("docker") is None:
        pytest.skip("no docker client on PATH (install docker.io, or docker-ce-cli)")
    env = dict(os.environ)
    if _engine_answers(env):
        yield Engine(env, None)
        return
    dockerd = shutil.which("dockerd")
    if dockerd is None:
        pytest.skip(
            "`docker info` reaches no Docker engine and dockerd is not installed to start one "
            "(apt-get install docker.io)"
        )
    if os.geteuid() != 0:
        pytest.skip("`docker info` reaches no Docker engine, and starting dockerd needs root")
    # A short path: the socket path must fit in sun_path (108 bytes).
    private = Path(tempfile.mkdtemp(prefix="rsd-", dir="/tmp"))
    env["DOCKER_HOST"] = f"unix://{private}/docker.sock"
    log = open(private / "dockerd.log", "w")
    daemon = subprocess.Popen(
        [
            dockerd,
            "--data-root",
            str(private / "data"),
            "--exec-root",
            str(private / "exec"),
            "--pidfile",
            str(private / "dockerd.pid"),
            "-H",
            env["DOCKER_HOST"],
            # Host networking only: no docker0 bridge, no iptables rules, nothing shared with
            # another engine on this machine.
            "--bridge",
            "none",
            "--iptables=false",
            "--ip-masq=false",
            "--ip-forward=false",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not _engine_answers(env):
            if daemon.poll() is not None or time.monotonic() > deadline:
                log.flush()
                tail = (private / "dockerd.log").read_text()[-2000:]
                pytest.skip(f"dockerd could not be started here (exit {daemon.poll()}):\n{tail}")
            time.sleep(0.5)
        yield Engine(env, private)
    finally:
        if daemon.poll() is None:
            daemon.send_signal(signal.SIGTERM)
            try:
                daemon.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(daemon.pid, signal.SIGKILL)
                daemon.wait()
        log.close()
        base_rootfs.remove(private)


def _base_image(engine: Engine) -> str:
    """A Debian bookworm image with python3 and python3-venv, made without pulling."""
    given = os.environ.get("RS_DOCKER_BASE_IMAGE")
    if given:
        if engine.docker("image", "inspect", given, check=False).returncode != 0:
            pytest.skip(f"RS_DOCKER_BASE_IMAGE={given} is not on the engine")
        return given
    bootstrap = base_rootfs.take()  # started by conftest.py when the session began, as a rule
    try:
        rootfs = bootstrap.wait()
        return _imported(engine, rootfs)
    finally:
        bootstrap.discard()


def _imported(engine: Engine, rootfs: Path) -> str:
    """`rootfs` as the engine's image TAG-base:bookworm."""
    base = f"{TAG}-base:bookworm"
    tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
    imported = subprocess.run(
        ["docker", "import", "-", base],
        stdin=tar.stdout,
        env=engine.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=300,
    )
    tar.stdout.close()
    tar.wait()
    assert imported.returncode == 0 and tar.returncode == 0, imported.stdout
    engine.images.append(base)
    return base


def _context(work: Path) -> Path:
    """A copy of the build context (the repository, less .dockerignore) plus this machine's CA
    bundle, which pip inside the build uses where HTTPS is intercepted."""
    patterns = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]

    def ignored(relative: str) -> bool:
        name = relative.rsplit("/", 1)[-1]
        return any(fnmatch(relative, p) or (p.startswith("**/") and fnmatch(name, p[3:])) for p in patterns)

    context = work / "context"
    for directory, subdirs, files in os.walk(ROOT):
        base = Path(directory).relative_to(ROOT).as_posix()
        base = "" if base == "." else base + "/"
        subdirs[:] = [d for d in subdirs if not ignored(base + d)]
        for name in files:
            if not ignored(base + name):
                (context / base).mkdir(parents=True, exist_ok=True)
                shutil.copy2(Path(directory) / name, context / base / name)
    bundle = os.environ.get("PIP_CERT") or os.environ.get("SSL_CERT_FILE") or "/etc/ssl/certs/ca-certificates.crt"
    if os.path.isfile(bundle):
        shutil.copy(bundle, context / "build-ca.crt")
    return context


@pytest.fixture(scope="module")
def image(engine: Engine) -> Iterator[Dict]:
    """The reducer image built from the Dockerfile; removed afterwards."""
    why = unreachable("https://pypi.org/simple/pyzmq/")
    if why:
        pytest.skip(f"PyPI is unreachable, so the image cannot install its dependencies: {why}")
    work = Path(tempfile.mkdtemp(prefix="rs-docker-test-"))
    info: Dict = {"tag": f"{TAG}:latest"}
    before = engine.image_ids(dangling=True) if engine.private is None else set()
    try:
        started = time.monotonic()
        base = _base_image(engine)
        info["base_seconds"] = time.monotonic() - started
        context = _context(work)
        build_args = ["--build-arg", f"BASE_IMAGE={base}"]
        if not os.environ.get("RS_DOCKER_BASE_IMAGE"):  # Debian's Python: headers are a package
            build_args += ["--build-arg", "BUILD_PACKAGES=gcc libc6-dev python3-dev"]
        if (context / "build-ca.crt").exists():
            build_args += ["--build-arg", "PIP_CERT=/src/build-ca.crt"]
        started = time.monotonic()
        env = dict(engine.env, DOCKER_BUILDKIT="0")  # the legacy builder: no buildx needed
        engine.images.append(info["tag"])
        built = _run(
            [
                "docker",
                "build",
                "--network",
                "host",
                "--force-rm",
                "-f",
                str(ROOT / "Dockerfile"),
                *build_args,
                "-t",
                info["tag"],
                str(context),
            ],
            env,
            timeout=900,
            check=False,
        )
        assert built.returncode == 0, f"docker build failed:\n{built.stdout[-6000:]}"
        info["build_seconds"] = time.monotonic() - started
        inspect = json.loads(engine.docker("image", "inspect", info["tag"]).stdout)[0]
        info["config"] = inspect["Config"]
        info["size"] = inspect["Size"]
        info["base_size"] = json.loads(engine.docker("image", "inspect", base).stdout)[0]["Size"]
        yield info
    finally:
        if engine.private is None:  # an engine we did not start: remove exactly what we made
            for container in engine.containers:
                engine.docker("rm", "-f", container, check=False)
            # The legacy builder leaves the first stage as an untagged image.
            stages = engine.image_ids(dangling=True) - before
            for ref in [info["tag"], *reversed(engine.images), *stages]:
                engine.docker("rmi", "-f", ref, check=False)
        base_rootfs.remove(work)


def _cluster_spec(reducers: List[str], workers: List[str], task_type: str, index: int) -> str:
    """What Vertex AI sets: the four pools (no evaluators here), the task, and the job."""
    return json.dumps(
        {
            "cluster": {"workerpool0": workers[:1], "workerpool1": workers[1:], "workerpool2": reducers},
            "environment": "cloud",
            "task": {"type": task_type, "index": index},
            "job": {
                "workerPoolSpecs": [
                    {"replicaCount": "1"},
                    {"replicaCount": str(len(workers) - 1)},
                    {"replicaCount": str(len(reducers)), "containerSpec": {"imageUri": "reduction-server:test"}},
                ]
            },
        }
    )


def _tf_config(reducers: List[str], workers: List[str], task_type: str, index: int) -> str:
    """What a TFJob (or Vertex AI, besides CLUSTER_SPEC) sets: chief, worker, ps."""
    return json.dumps(
        {
            "cluster": {"chief": workers[:1], "worker": workers[1:], "ps": reducers},
            "task": {"type": task_type, "index": index},
            "environment": "cloud",
        }
    )


def test_image_is_small_non_root_and_serves(image: Dict, engine: Engine) -> None:
    config = image["config"]
    assert config["Entrypoint"] == ["reduction-server", "serve"]
    assert config["User"] == "10001:10001"
    assert config["Healthcheck"]["Test"][0] == "CMD"
    added = image["size"] - image["base_size"]
    print(
        f"\nimage {image['size'] / 1e6:.0f} MB ({added / 1e6:.0f} MB over the base); "
        f"base made in {image.get('base_seconds', 0):.0f} s, built in {image['build_seconds']:.0f} s"
    )
    # numpy + pyzmq + the package, with no compiler, headers or build requirements.
    assert added < 120e6, f"the image adds {added / 1e6:.0f} MB to its base"
    probe = engine.docker(
        "run",
        "--rm",
        "--network",
        "none",
        "--entrypoint",
        "python3",
        image["tag"],
        "-c",
        "import os, shutil, reduction_server._native, zmq, numpy; "
        "print(os.getuid(), shutil.which('gcc'), shutil.which('cython'))",
    )
    assert probe.stdout.split() == ["10001", "None", "None"], probe.stdout
    # Arguments after the image go to `reduction-server serve`.
    help_text = engine.docker("run", "--rm", "--network", "none", image["tag"], "--help").stdout
    assert "--port" in help_text


def test_reducer_containers_allreduce_with_cluster_spec_and_tf_config(image: Dict, engine: Engine) -> None:
    started = time.monotonic()
    ports = free_ports(4)
    reducers = [f"127.0.0.1:{p}" for p in ports[:2]]
    workers = [f"127.0.0.1:{p}" for p in ports[2:]]
    names = []
    try:
        for index in range(len(reducers)):
            name = f"{TAG}-reducer{index}"
            engine.containers.append(name)
            names.append(name)
            # Reducer 0 gets what Vertex AI sets (CLUSTER_SPEC, task workerpool2, and TF_CONFIG);
            # reducer 1 only TF_CONFIG (task ps), as in a TFJob. RS_JOB_ID makes one job of them
            # (CLUSTER_SPEC's "job" would otherwise name it, and TF_CONFIG has none).
            place = ["-e", f"TF_CONFIG={_tf_config(reducers, workers, 'ps', index)}"]
            if index == 0:
                place += ["-e", f"CLUSTER_SPEC={_cluster_spec(reducers, workers, 'workerpool2', index)}"]
            engine.docker(
                "run",
                "-d",
                "--name",
                name,
                "--network",
                "host",
                "--health-interval",
                "1s",
                "--health-start-period",
                "0s",
                "--health-retries",
                "30",
                *place,
                "-e",
                f"RS_JOB_TOKEN={TOKEN}",
                "-e",
                f"RS_JOB_ID={TAG}",
                "-e",
                "RS_BIND_HOST=127.0.0.1",
                image["tag"],
            )
        # Healthy: the image's own healthcheck reached each reducer's discovered port.
        deadline = time.monotonic() + 60
        for name in names:
            while True:
                state = json.loads(engine.docker("inspect", "--format", "{{json .State}}", name).stdout)
                if state.get("Health", {}).get("Status") == "healthy":
                    break
                assert state["Running"], f"{name} stopped:\n{engine.docker('logs', name).stdout}"
                assert time.monotonic() < deadline, f"{name} not healthy: {state.get('Health')}"
                time.sleep(0.5)
        for index, name in enumerate(names):
            logs = engine.docker("logs", name).stdout
            assert f"reducer {index} listening on tcp://{reducers[index]}" in logs, logs
            assert "workers=2" in logs and "auth=token" in logs, logs

        procs = []
        for rank, (task_type, index) in enumerate([("workerpool0", 0), ("workerpool1", 0)]):
            env = {
                k: v
                for k, v in os.environ.items()
                if k not in ("CLUSTER_SPEC", "TF_CONFIG", "RANK", "WORLD_SIZE") and not k.startswith("RS_")
            }
            env.update(
                CLUSTER_SPEC=_cluster_spec(reducers, workers, task_type, index),
                RS_JOB_TOKEN=TOKEN,
                RS_JOB_ID=TAG,
                RS_CHUNK_BYTES="65536",
                RS_CONNECT_TIMEOUT="30",
                RS_TIMEOUT="60",
                EXPECT_RANK=str(rank),
                EXPECT_WORLD="2",
                PYTHONUNBUFFERED="1",
            )
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(WORKER)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
                )
            )
        results = collect(procs, timeout=180)
        for rank, result in enumerate(results):
            assert result["rank"] == rank and result["world"] == 2, result
            assert result["source"] == "CLUSTER_SPEC", result
            assert result["reducers"] == reducers, result
            assert result["failures"] == [] and result["checks"] >= 10, result
        # Every worker was admitted by every reducer, and the reducers are still up.
        for name in names:
            state = json.loads(engine.docker("inspect", "--format", "{{json .State}}", name).stdout)
            assert state["Running"], engine.docker("logs", name).stdout
            assert engine.docker("logs", name).stdout.count("admitted ") >= 2
        # docker stop sends SIGTERM: the reducer stops cleanly, exit status 0.
        for name in names:
            engine.docker("stop", "--time", "20", name, timeout=40)
            state = json.loads(engine.docker("inspect", "--format", "{{json .State}}", name).stdout)
            assert state["ExitCode"] == 0, engine.docker("logs", name).stdout
        print(f"\nreducer containers + 2 workers: {time.monotonic() - started:.1f} s")
    finally:
        for name in names:
            engine.docker("rm", "-f", name, check=False)
            engine.containers.remove(name)


COMPOSE = ROOT / "examples" / "compose" / "docker-compose.yml"


ROUNDS = 80  # of the compose job's checks


def test_compose_job_on_its_own_network_survives_a_reducer_container_killed(image: Dict, engine: Engine) -> None:
    """examples/compose: 2 reducer and 2 worker containers from the image on the project's own
    network; the workers check every all-reduce against NumPy for 80 rounds, and reducer1's
    container is killed after round 2: its chunks move to reducer0, every result stays right.
    (Killed by the engine's own CLI: `docker-compose kill`, a Python program, once took longer to
    start than the workers took for 27 rounds on a loaded machine.)"""
    if shutil.which("docker-compose") is None:
        pytest.skip("docker-compose is not installed (apt-get install docker-compose)")
    started = time.monotonic()
    project = f"{TAG}-compose"
    env = dict(
        engine.env,
        IMAGE=image["tag"],
        RS_JOB_TOKEN=TOKEN,
        CHECK_ARGS=f"--rounds {ROUNDS} --mib 4 --iters 2",
        COMPOSE_PROJECT_NAME=project,
    )
    compose = ["docker-compose", "--ansi", "never", "-f", str(COMPOSE)]

    def logs(service: str) -> str:
        return _run([*compose, "logs", "--no-color", service], env).stdout

    def state(service: str) -> Dict:
        return json.loads(engine.docker("inspect", "--format", "{{json .State}}", f"{project}_{service}_1").stdout)

    try:
        _run([*compose, "up", "-d"], env, timeout=120)
        deadline = time.monotonic() + 90
        while f"round 2 of {ROUNDS} checked" not in logs("worker0"):
            assert time.monotonic() < deadline, logs("worker0") + logs("reducer0") + logs("reducer1")
            assert state("worker0")["Running"], logs("worker0")
            time.sleep(0.3)
        engine.docker("kill", f"{project}_reducer1_1")
        deadline = time.monotonic() + 120
        while any(state(w)["Running"] for w in ("worker0", "worker1")):
            assert time.monotonic() < deadline, logs("worker0") + logs("worker1")
            time.sleep(0.5)
        for rank, worker in enumerate(("worker0", "worker1")):
            text = logs(worker)
            assert state(worker)["ExitCode"] == 0, f"{text}\n{logs('reducer0')}\n{state('reducer0')}"
            assert f"rank {rank}: round {ROUNDS} of {ROUNDS} checked, 0 wrong so far" in text, text
            assert f"rank {rank}: OK" in text, text
            # it lost reducer 1 (both its shards) mid-job, and its chunks moved
            lost = text.index("reducer_lost")
            assert "address=reducer1:5555" in text and "failover=True" in text[lost:], text
            assert lost < text.index(f"rank {rank}: round {ROUNDS} of {ROUNDS} checked"), text
        assert "PASSED: every result of every rank was right" in logs("worker0")
        assert state("reducer0")["Running"] and not state("reducer1")["Running"]
        took = time.monotonic() - started
        print(f"\ncompose rehearsal (2 reducer + 2 worker containers, one reducer killed): {took:.1f} s")
    finally:
        _run([*compose, "down", "--volumes", "--remove-orphans", "--timeout", "5"], env, timeout=120, check=False)
