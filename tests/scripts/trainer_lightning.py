"""A PyTorch Lightning job as Lightning's documentation writes it, with the backend passed as
Lightning says to pass a custom one: `process_group_backend=` of the strategy. Nothing of
reduction_server is imported: torch's `torch.backends` entry point registers the backend.

A small MLP trained for a few steps on fixed random data (Lightning's DistributedSampler gives each
rank its own half), 2 CPU devices; each rank then writes its final parameters (gathered in full
under FSDP2) and the backend its process group has to OUT/rank<r>.json.

argv: backend (e.g. "reduction_server" or "gloo"), strategy ("ddp": DDPStrategy; "fsdp2":
ModelParallelStrategy with fully_shard in configure_model), OUT (a directory).
Run as `python trainer_lightning.py ...` (Lightning's own launcher starts rank 1 itself) or under
`torchrun --nproc-per-node 2` (Lightning then starts nothing).
"""

import json
import os
import sys
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

SAMPLES, BATCH, FEATURES, WIDTH = 64, 8, 8, 16  # 2 ranks x 8 per batch: 4 steps per epoch


class MLP(L.LightningModule):
    def __init__(self, out: Path, shard: bool) -> None:
        super().__init__()
        self.out, self.shard, self.seen = out, shard, 0.0
        self.net = nn.Sequential(
            nn.Linear(FEATURES, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, 1)
        )

    def configure_model(self) -> None:
        if self.shard:  # FSDP2 over the data-parallel mesh, each layer then the root
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for layer in self.net:
                if isinstance(layer, nn.Linear):
                    fully_shard(layer, mesh=mesh)
            fully_shard(self.net, mesh=mesh)

    def training_step(self, batch, _index):
        x, y = batch
        self.seen += x.sum().item()  # the inputs this rank trained on: the ranks' data differ
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    def on_fit_end(self) -> None:
        flat = []
        for _name, p in self.named_parameters():
            p = p.detach()
            if hasattr(p, "full_tensor"):  # an FSDP2 DTensor shard: every rank gathers the whole
                p = p.full_tensor()
            flat += p.reshape(-1).tolist()
        rank = self.global_rank
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / f"rank{rank}.json").write_text(
            json.dumps(
                {
                    "rank": rank,
                    "world": self.trainer.world_size,
                    "backend": dist.get_backend(),
                    "steps": self.trainer.global_step,
                    "seen": self.seen,
                    "params": flat,
                }
            )
        )


def main() -> None:
    backend, strategy_name, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    torch.set_num_threads(1)
    L.seed_everything(1234, verbose=False)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(SAMPLES, FEATURES, generator=g)
    y = x.sum(dim=1, keepdim=True).sin() + 0.1 * torch.randn(SAMPLES, 1, generator=g)
    data = DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=False)
    if strategy_name == "ddp":
        strategy = DDPStrategy(process_group_backend=backend)
    else:
        strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1, process_group_backend=backend)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_epochs=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=os.getcwd(),
    )
    trainer.fit(MLP(out, shard=strategy_name == "fsdp2"), data)


if __name__ == "__main__":
    main()
