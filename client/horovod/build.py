"""Horovod's queries about how it was built, answered for the reduction server: no MPI, Gloo,
NCCL, DDL, oneCCL or ROCm inside (the reducers do the reductions; CUDA tensors are staged
through host memory, so there are no CUDA kernels either). Scripts that branch on them take
their portable path."""

from __future__ import annotations


def mpi_built() -> bool:
    """False: the reduction server runs without MPI."""
    return False


def mpi_enabled() -> bool:
    """False: MPI is not what carries the collectives."""
    return False


def mpi_threads_supported() -> bool:
    """Horovod raises ValueError when MPI is not in use; so does this."""
    raise ValueError("Horovod MPI is not enabled: the reduction server runs without MPI")


def gloo_built() -> bool:
    """False: the reducers carry the collectives, not Gloo."""
    return False


def gloo_enabled() -> bool:
    """False: the reducers carry the collectives, not Gloo."""
    return False


def nccl_built() -> int:
    """0 (Horovod returns the NCCL version it was built with, or 0)."""
    return 0


def ddl_built() -> bool:
    """False: no IBM DDL."""
    return False


def ccl_built() -> bool:
    """False: no oneCCL."""
    return False


def cuda_built() -> bool:
    """False: no CUDA kernels (CUDA tensors are staged through pinned host memory)."""
    return False


def rocm_built() -> bool:
    """False: no ROCm kernels."""
    return False
