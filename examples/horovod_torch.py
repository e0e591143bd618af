"""Train a small model with the Horovod-style PyTorch API over the reduction server.

Run it under the local launcher (reducers and workers on this machine):

    reduction-server run -np 2 --reducers 1 -- python examples/horovod_torch.py

A Horovod script needs one change: ``import horovod.torch as hvd`` becomes the import below.
Synthetic data: each rank draws its own batches of a fixed linear problem; the loss falls and
the weights stay identical on every rank.
"""

import argparse
import os
import time

try:
    import torch
except ModuleNotFoundError as missing:  # the framework is an extra of the package: say which
    if missing.name != "torch":
        raise
    raise SystemExit(f'{__file__} needs torch: pip install "reduction-server[torch]"') from None

import reduction_server.client.horovod.torch as hvd


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batch", type=int, default=64, help="per-rank batch size")
    parser.add_argument("--fp16-allreduce", action="store_true", help="compress gradients to float16 on the wire")
    args = parser.parse_args()

    hvd.init()
    # Ranks (and reducers) on one host share its cores; spinning intra-op threads would starve them.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // (hvd.local_size() + 1)))
    if torch.cuda.is_available():
        torch.cuda.set_device(hvd.local_rank())

    torch.manual_seed(hvd.rank())  # different on every rank: broadcast_parameters makes them equal
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1)
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size(), momentum=0.9)  # scaled by workers
    opt = hvd.DistributedOptimizer(
        opt,
        named_parameters=model.named_parameters(),
        compression=hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none,
    )
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)

    truth = torch.randn(32, 1, generator=torch.Generator().manual_seed(0))  # the same on every rank
    data = torch.Generator().manual_seed(100 + hvd.rank())  # each rank its own samples
    start = time.perf_counter()
    for step in range(args.steps):
        x = torch.randn(args.batch, 32, generator=data)
        y = x @ truth + 0.01 * torch.randn(args.batch, 1, generator=data)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 10 == 0 or step == args.steps - 1:
            mean_loss = hvd.allreduce(loss.detach(), name="loss")  # averaged over ranks
            if hvd.rank() == 0:
                print(f"step {step:4d}  loss {mean_loss.item():.5f}", flush=True)
    elapsed = time.perf_counter() - start

    checksum = torch.stack([p.detach().double().sum() for p in model.parameters()]).sum().reshape(1)
    sums = hvd.allgather(checksum, name="checksum")
    same = bool((sums == sums[0]).all())
    if hvd.rank() == 0:
        print(f"{args.steps} steps on {hvd.size()} ranks in {elapsed:.2f} s; weights identical on all ranks: {same}")
    hvd.shutdown()
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
