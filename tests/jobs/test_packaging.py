"""What users install: `python -m build` makes an sdist and, from it, a wheel; the wheel installed
into a fresh virtualenv holds and imports every module of the source tree; the suite itself
imports the installed package, not the checkout."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path
from typing import Dict, Iterator

import pytest

import reduction_server
from helpers.cluster import unreachable
from helpers.source_tree import ROOT, source_modules

# Not imported in the check: running it is running the command line.
NOT_IMPORTED = {"reduction_server.__main__"}
# Built from native/ rather than copied from a .py file.
COMPILED = ["reduction_server._native"]
# What a module may lack in the check: the optional extras (torch, tensorflow) and what only they bring.
OPTIONAL = {"torch", "tensorflow", "keras", "tf_keras", "ml_dtypes", "matplotlib"}
# Copied for the build: everything but what a build or a run leaves behind.
_IGNORED = shutil.ignore_patterns(
    ".git",
    "build",
    "dist",
    "*.egg-info",
    "__pycache__",
    "*.so",
    ".venv",
    "venv",
    ".pytest_cache",
    ".hypothesis",
    ".benchmarks",
    "out",
    "_native.c",
)

_IMPORT_ALL = """
import importlib, json, sys, traceback
found = {}
for name in sys.argv[1:]:
    try:
        found[name] = {"file": importlib.import_module(name).__file__}
    except ImportError as exc:  # an optional extra (torch, tensorflow) is fine to lack; ours is not
        found[name] = {"missing": exc.name or "", "error": traceback.format_exc(limit=3)}
print(json.dumps(found))
"""


@pytest.fixture(scope="module")
def distributions(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Path]:
    """An sdist and a wheel, built as `python -m build` builds them (the wheel from the sdist),
    from a copy of the checkout so that nothing lands in the tree."""
    work = tmp_path_factory.mktemp("build")
    source = work / "source"
    shutil.copytree(ROOT, source, ignore=_IGNORED)
    out = work / "dist"
    proc = subprocess.run(
        [sys.executable, "-m", "build", "--outdir", str(out), str(source)], capture_output=True, text=True, timeout=600
    )
    if proc.returncode != 0 and (why := unreachable("https://pypi.org/simple/cython/")):
        pytest.skip(f"python -m build could not make its isolated build environment, and PyPI is unreachable: {why}")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    (sdist,) = out.glob("*.tar.gz")
    (wheel,) = out.glob("*.whl")
    return {"sdist": sdist, "wheel": wheel}


@pytest.fixture(scope="module")
def venv(distributions: Dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A fresh virtualenv with the wheel installed. It sees the site-packages this interpreter
    sees (a .pth file lists them) for the dependencies (numpy, pyzmq, torch, tensorflow), never
    for reduction_server: the wheel is installed into the venv, whose site-packages come first."""
    env_dir = tmp_path_factory.mktemp("venv") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(env_dir)], check=True, timeout=120)
    outer = [entry for entry in sys.path if entry.endswith("site-packages")]
    (site_packages(env_dir) / "_outer_site_packages.pth").write_text("\n".join(outer) + "\n")
    python = env_dir / "bin" / "python"
    proc = subprocess.run(
        [
            str(python),
            "-m",
            "pip",
            "install",
            "--no-deps",
            "--ignore-installed",
            "--no-index",
            "--no-build-isolation",
            str(distributions["wheel"]),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    yield env_dir
    shutil.rmtree(env_dir, ignore_errors=True)


def site_packages(env_dir: Path) -> Path:
    return next((env_dir / "lib").glob("python3*/site-packages"))


def test_the_suite_imports_the_installed_package():
    where = Path(reduction_server.__file__).resolve()
    installed = {Path(sysconfig.get_paths()[kind]).resolve() for kind in ("purelib", "platlib")}
    assert where.parent != ROOT / "reduction_server" and installed & set(where.parents), (
        f"reduction_server was imported from {where}, not from this interpreter's site-packages ({installed}): "
        "install it (pip install .) and run pytest"
    )
    assert (where.parent / "client").is_dir() and list(where.parent.glob("_native*.so"))


def test_sdist_carries_what_builds_the_wheel(distributions: Dict[str, Path]):
    import tarfile

    with tarfile.open(distributions["sdist"]) as sdist:
        names = {name.split("/", 1)[1] for name in sdist.getnames() if "/" in name}
    for needed in (
        "setup.py",
        "pyproject.toml",
        "README.md",
        "native/_native.pyx",
        "native/kernels.h",
        "client/horovod/torch/optimizer.py",
        "reduction_server/_version.py",
        "tests/conftest.py",
    ):
        assert needed in names, f"the sdist lacks {needed}"
    assert "native/_native.c" not in names  # generated from the .pyx at build time, never shipped stale


def test_wheel_holds_every_module_of_the_source_tree(distributions: Dict[str, Path]):
    with zipfile.ZipFile(distributions["wheel"]) as wheel:
        files = set(wheel.namelist())
    in_wheel = {name[:-3].replace("/", ".").removesuffix(".__init__") for name in files if name.endswith(".py")}
    missing = sorted(set(source_modules()) - in_wheel)
    assert not missing, f"the wheel lacks {missing}"
    assert any(name.startswith("reduction_server/_native") and name.endswith(".so") for name in files)
    assert "reduction_server/py.typed" in files


def test_wheel_imports_every_module_in_a_fresh_venv(venv: Path, tmp_path: Path):
    modules = [name for name in source_modules() if name not in NOT_IMPORTED] + COMPILED
    assert "reduction_server.client.horovod.torch" in modules
    # From an empty directory, so that nothing but the venv can supply reduction_server.
    proc = subprocess.run(
        [str(venv / "bin" / "python"), "-c", _IMPORT_ALL, *modules],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    site = site_packages(venv).resolve()
    for name, what in found.items():
        if "missing" in what:
            assert what["missing"].split(".")[0] in OPTIONAL, f"{name} does not import from the wheel:\n{what['error']}"
            continue
        assert site in Path(what["file"]).resolve().parents, f"{name} came from {what['file']}, not the venv"
    imported = [name for name, what in found.items() if "file" in what]
    assert "reduction_server.client.horovod" in imported and "reduction_server._native" in imported


def test_version_comes_from_one_place(venv: Path):
    proc = subprocess.run(
        [str(venv / "bin" / "reduction-server"), "--version"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"reduction-server {reduction_server.__version__}"
    metadata = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import importlib.metadata as m; print(m.version('reduction-server'))"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=venv,
    )
    assert metadata.stdout.strip() == reduction_server.__version__
