"""Where the torch tests' rank processes put their tensors (RS_TEST_DEVICE, read by
tests/scripts/torch_model.py): the CPU everywhere, and a CUDA device where torch sees one, so that
the same checks cover the backend's staging of CUDA tensors through pinned host buffers. Two ranks
share one GPU."""

from typing import Dict, Tuple

import pytest

#: (rtol, atol) of a run's weights against the single-process reference, computed on the CPU:
#: a GPU rounds its matrix products differently
TOLERANCE = {"cpu": (1e-5, 1e-7), "cuda": (1e-4, 1e-6)}


def on_device(device: str) -> Dict[str, str]:
    """The environment that has a worker script put its tensors on `device`; skips the test
    where that device is a GPU and torch sees none."""
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            pytest.skip("no CUDA device here (torch.cuda.is_available() is False): the CUDA path runs on GPU machines")
    return {"RS_TEST_DEVICE": device}


def label(key: Tuple[int, str]) -> str:
    """A test id for a job (world size, device): "W2", or "W2-cuda" off the CPU."""
    world, device = key
    return f"W{world}" + ("" if device == "cpu" else f"-{device}")
