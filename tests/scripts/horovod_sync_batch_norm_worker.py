"""One rank of a job that trains hvd.SyncBatchNorm layers (reduction_server.client.horovod.torch)
on its slice of one batch, for each case of CASES, then evaluates them. Prints one JSON line.

The cases and their data live here so that the test builds the same batches for its reference:
one torch.nn.BatchNorm1d/2d in one process over the whole (concatenated) batch.
"""

import sys
from pathlib import Path
from typing import Dict, List, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

#: per case: the shape of one sample (C first), how the batch is split over the ranks, and the
#: layer's arguments. "even": 3 rows each; "uneven": 1, 3, 5, ... rows; "empty": rank 0 has none.
#: One rank (plain BatchNorm) holds 3 rows in every case.
CASES = {
    "2d": {"sample": [4], "split": "even"},
    "4d": {"sample": [3, 2, 3], "split": "even"},
    "2d_uneven": {"sample": [4], "split": "uneven", "momentum": None},
    "4d_uneven": {"sample": [3, 2, 3], "split": "uneven", "momentum": 0.3},
    "4d_empty_rank": {"sample": [3, 2, 3], "split": "empty"},
    "2d_no_affine_no_running_stats": {"sample": [5], "split": "uneven", "affine": False, "track": False},
}
#: the case that W=3 also runs in a process set of ranks 0 and 2, split as over two ranks
PROCESS_SET_CASE = "4d_uneven"
#: training steps (each a forward and a backward on a new batch) before the evaluation batch
STEPS = 2


def rows(case: str, world: int) -> List[int]:
    """How many rows of the batch each rank holds."""
    split = CASES[case]["split"]
    if split == "even" or world == 1:  # one rank holds the whole batch (of more than one row)
        return [3] * world
    if split == "uneven":  # rank 0's single row has a variance of 0 of its own
        return [2 * r + 1 for r in range(world)]
    return [0] + [2 + r for r in range(1, world)]


def batch(case: str, world: int, step: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The whole batch of `step` and the gradient of the loss with respect to the layer's output
    (the loss is sum(output * grad)), the same in every process."""
    gen = torch.Generator().manual_seed(1000 * step + sorted(CASES).index(case))
    shape = [sum(rows(case, world))] + CASES[case]["sample"]
    x = torch.randn(shape, generator=gen) * 2 + torch.arange(shape[1]).view([1, -1] + [1] * (len(shape) - 2))
    return x, torch.randn(shape, generator=gen)


def parameters(case: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """The layer's weight and bias (not torch's ones and zeros, which hide mistakes)."""
    gen = torch.Generator().manual_seed(7)
    channels = CASES[case]["sample"][0]
    return 1 + 0.5 * torch.randn(channels, generator=gen), torch.randn(channels, generator=gen)


def layer_args(case: str) -> Dict:
    config = CASES[case]
    return {
        "momentum": config.get("momentum", 0.1),
        "affine": config.get("affine", True),
        "track_running_stats": config.get("track", True),
    }


def flat(t):
    return None if t is None else t.detach().reshape(-1).tolist()


def run_case(hvd, case: str, rank: int, world: int, process_set=None) -> Dict:
    """Train and evaluate one layer on this rank's slice; `rank` and `world` count the ranks of
    `process_set` (None: the global set)."""
    sets = {} if process_set is None else {"process_set": process_set}
    bn = hvd.SyncBatchNorm(CASES[case]["sample"][0], **layer_args(case), **sets)
    if bn.affine:
        weight, bias = parameters(case)
        with torch.no_grad():
            bn.weight.copy_(weight)
            bn.bias.copy_(bias)
    lo = sum(rows(case, world)[:rank])
    mine = slice(lo, lo + rows(case, world)[rank])
    steps = []
    for step in range(STEPS):
        x, grad = batch(case, world, step)
        x = x[mine].clone().requires_grad_()
        bn.zero_grad(set_to_none=True)
        out = bn(x)
        (out * grad[mine]).sum().backward()
        # Horovod leaves the weight and bias gradients local (DistributedOptimizer sums them):
        # their sum over the ranks is the whole batch's.
        grads = (
            {}
            if not bn.affine
            else {
                "weight": flat(hvd.allreduce(bn.weight.grad, op=hvd.Sum, name=f"{case}.{step}.weight", **sets)),
                "bias": flat(hvd.allreduce(bn.bias.grad, op=hvd.Sum, name=f"{case}.{step}.bias", **sets)),
            }
        )
        steps.append(
            {
                "out": flat(out),
                "x_grad": flat(x.grad),
                **grads,
                "running_mean": flat(bn.running_mean),
                "running_var": flat(bn.running_var),
                "batches": None if bn.num_batches_tracked is None else int(bn.num_batches_tracked),
            }
        )
    bn.eval()
    x, _ = batch(case, world, STEPS)
    with torch.no_grad():
        evaluated = bn(x[mine])
    return {"steps": steps, "eval": flat(evaluated)}


def main() -> None:
    # Imported here: the test imports this file for its data.
    from report import report

    import reduction_server.client.horovod.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    rank, world = hvd.rank(), hvd.size()
    result = {"rank": rank, "size": world, "cases": {case: run_case(hvd, case, rank, world) for case in CASES}}
    if world == 3:  # ranks 0 and 2 share statistics; rank 1 computes none of them
        pair = hvd.add_process_set([0, 2])
        if rank in pair.ranks:
            result["process_set"] = run_case(hvd, PROCESS_SET_CASE, pair.rank(), 2, pair)
        hvd.remove_process_set(pair)
    try:
        hvd.SyncBatchNorm(4)(torch.zeros(4))
        result["1d_input"] = None
    except ValueError as exc:
        result["1d_input"] = str(exc)
    hvd.shutdown()
    report(result)


if __name__ == "__main__":
    main()
