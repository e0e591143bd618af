"""One rank of the numerics suite: `python -m reduction_server.bench.numerics_job TASK VARIANT STEPS
EVERY OUT` under `reduction-server run -np W`. DDP trains TASK's model from one seed on this rank's
own batches, its gradients all-reduced as VARIANT says; rank 0 measures the held-out set every
EVERY steps and at the end, and writes OUT (JSON: the curve and the final figures).

Tasks, on data a package ships (nothing downloaded):
- charlm: a byte-level transformer language model on the standard library's own .py sources (the
  last tenth held out);
- digits: an MLP on scikit-learn's digits (8x8 images, 10 classes; a fifth held out).

Variants: float32 (this backend, no hook), bf16 (reduction_server_bf16_hook), int8-ef
(reduction_server_int8_hook, error feedback), int8 (the same without it), powersgd-gloo (torch's
PowerSGD hook, rank 4, over Gloo).
"""

import json
import os
import sys
from pathlib import Path
from typing import Callable, Dict, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from reduction_server.bench.numerics import BACKENDS

BATCH = {"charlm": 16, "digits": 32}  # per rank
CONTEXT = 64  # charlm's bytes per sample
_SOURCE_BYTES = 1 << 21  # charlm reads this much of the standard library


class CharLM(nn.Module):
    """Two causal transformer layers over bytes."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, width)
        self.position = nn.Parameter(torch.zeros(CONTEXT, width))
        layer = nn.TransformerEncoderLayer(width, 4, 2 * width, dropout=0.0, batch_first=True)
        self.layers = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.out = nn.Linear(width, 256)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(CONTEXT), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.layers(self.embed(x) + self.position, mask=self.mask, is_causal=True))


def _charlm() -> Tuple[nn.Module, Callable, Callable]:
    stdlib = Path(os.__file__).parent
    text = b"".join(path.read_bytes() for path in sorted(stdlib.glob("*.py")))[:_SOURCE_BYTES]
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
    split = len(data) * 9 // 10
    train, held = data[:split], data[split:]

    def windows(source: torch.Tensor, count: int, g: torch.Generator) -> Tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(0, len(source) - CONTEXT - 1, (count,), generator=g)
        rows = torch.stack([source[s : s + CONTEXT + 1] for s in starts.tolist()])
        return rows[:, :-1], rows[:, 1:]

    def batch(step: int, rank: int) -> Tuple[torch.Tensor, torch.Tensor]:
        return windows(train, BATCH["charlm"], torch.Generator().manual_seed(1_000_003 * step + rank))

    fixed = windows(held, 128, torch.Generator().manual_seed(0))

    def evaluate(model: nn.Module) -> Dict[str, float]:
        x, y = fixed
        return {"val_loss": nn.functional.cross_entropy(model(x).reshape(-1, 256), y.reshape(-1)).item()}

    return CharLM(), batch, evaluate


def _digits() -> Tuple[nn.Module, Callable, Callable]:
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise SystemExit("the digits task needs scikit-learn (pip install 'reduction-server[bench]')") from None
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16
    y = torch.tensor(digits.target)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    x, y = x[order], y[order]
    split = len(x) * 4 // 5

    def batch(step: int, rank: int) -> Tuple[torch.Tensor, torch.Tensor]:
        picks = torch.randint(
            0, split, (BATCH["digits"],), generator=torch.Generator().manual_seed(1_000_003 * step + rank)
        )
        return x[picks], y[picks]

    def evaluate(model: nn.Module) -> Dict[str, float]:
        logits = model(x[split:])
        return {
            "val_loss": nn.functional.cross_entropy(logits, y[split:]).item(),
            "accuracy": (logits.argmax(1) == y[split:]).float().mean().item(),
        }

    model = nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 128), nn.Tanh(), nn.Linear(128, 10))
    return model, batch, evaluate


def _hooked(model: DDP, variant: str) -> None:
    """Register the variant's comm hook (float32: DDP's own all-reduce over the group)."""
    if variant == "bf16":
        from reduction_server.client.torch.hooks import ReductionServerHookState, reduction_server_bf16_hook

        model.register_comm_hook(ReductionServerHookState.for_process_group(), reduction_server_bf16_hook)
    elif variant in ("int8-ef", "int8"):
        from reduction_server.client.torch.hooks import ReductionServerInt8HookState, reduction_server_int8_hook

        state = ReductionServerInt8HookState.for_process_group(error_feedback=variant == "int8-ef")
        model.register_comm_hook(state, reduction_server_int8_hook)
    elif variant == "powersgd-gloo":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

        state = powersgd.PowerSGDState(
            process_group=None, matrix_approximation_rank=4, start_powerSGD_iter=2, random_seed=0
        )
        model.register_comm_hook(state, powersgd.powerSGD_hook)


def main() -> None:
    task, variant, steps, every, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), Path(sys.argv[5])
    torch.set_num_threads(1)
    dist.init_process_group(BACKENDS[variant])
    rank = dist.get_rank()
    torch.manual_seed(1234)
    net, batch, evaluate = {"charlm": _charlm, "digits": _digits}[task]()
    model = DDP(net)
    _hooked(model, variant)
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-3)
    curve = []
    for step in range(1, steps + 1):
        x, y = batch(step, rank)
        logits = model(x)
        loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if rank == 0 and (step % every == 0 or step == steps):
            with torch.no_grad():
                curve.append({"step": step, **evaluate(net)})
    if rank == 0:
        out.write_text(json.dumps({"task": task, "variant": variant, "world": dist.get_world_size(), "curve": curve}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
