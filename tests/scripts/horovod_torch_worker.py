"""One rank of a Horovod-style PyTorch job (reduction_server.client.horovod.torch): the
collectives, submitted in a different order on every rank, then training runs with
DistributedOptimizer in several configurations, on RS_TEST_DEVICE's tensors (cpu, or cuda in the
tests' GPU runs). Prints one JSON line."""

import json
import random
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from report import report  # noqa: E402
from torch_model import DEVICE, LR, STEPS, batch, make_model  # noqa: E402

import reduction_server.client.horovod.torch as hvd  # noqa: E402


def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist()


def collectives(rank, world):
    out = {}
    ops = {"sum": hvd.Sum, "average": hvd.Average, "min": hvd.Min, "max": hvd.Max, "product": hvd.Product}
    inputs = {name: torch.arange(6, dtype=torch.float64) + rank + 1 for name in ops}
    order = list(ops)
    random.Random(rank).shuffle(order)  # every rank submits in its own order: matched by name
    handles = {name: hvd.allreduce_async(inputs[name], name=f"op.{name}", op=ops[name]) for name in order}
    assert all(isinstance(h, int) for h in handles.values())
    out["ops"] = {name: hvd.synchronize(handles[name]).tolist() for name in ops}
    out["input_untouched"] = inputs["sum"].tolist()

    t = torch.full((3,), float(rank))
    h = hvd.allreduce_async_(t, name="inplace", op=hvd.Sum)
    while not hvd.poll(h):
        pass
    out["inplace"] = [hvd.synchronize(h) is t, t.tolist()]
    out["scaled"] = hvd.allreduce(
        torch.ones(2), name="scaled", op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.25
    ).tolist()
    out["average_flag"] = hvd.allreduce(torch.ones(2) * rank, average=True, name="avgflag").tolist()
    out["fp16"] = hvd.allreduce(
        torch.full((4,), 0.5 + rank, dtype=torch.float32), name="fp16", compression=hvd.Compression.fp16, op=hvd.Sum
    )
    out["fp16"] = [str(out["fp16"].dtype), out["fp16"].tolist()]
    grouped = hvd.grouped_allreduce(
        [torch.ones(2) * rank, torch.ones(3, dtype=torch.int64) * rank], name="grouped", op=hvd.Sum
    )
    out["grouped"] = [g.tolist() for g in grouped]

    b = torch.full((2, 2), float(rank))
    out["broadcast"] = hvd.broadcast(b, root_rank=world - 1, name="bcast").tolist()
    out["broadcast_input_untouched"] = b.tolist()
    hvd.broadcast_(b, root_rank=1, name="bcast_")
    out["broadcast_"] = b.tolist()
    # A script that sets another default device (torch.set_default_device("cuda")) still gets
    # host buffers on the host ("meta" stands in for "cuda" here): a column of a CPU matrix goes
    # through a contiguous buffer of the backend's own.
    column = torch.full((3, 2), float(rank), device="cpu")[:, 1]
    with torch.device("meta"):
        hvd.broadcast_(column, root_rank=0, name="bcast.default_device")
        pieces = hvd.alltoall(torch.arange(2 * world, device="cpu") + 100 * rank, name="alltoall.default_device")
    out["default_device"] = [column.tolist(), pieces.tolist()]

    gathered = hvd.allgather(torch.full((rank + 1, 2), rank, dtype=torch.bfloat16), name="gather.bf16")
    out["allgather_bf16"] = [str(gathered.dtype), gathered.float().tolist()]
    out["allgather_bool"] = hvd.allgather(torch.tensor([rank % 2 == 0]), name="gather.bool").tolist()
    out["allgather_scalar"] = hvd.allgather(torch.tensor(rank * 10), name="gather.scalar").tolist()
    out["object"] = hvd.broadcast_object({"from": rank, "list": [rank] * 3}, root_rank=1)
    out["objects"] = hvd.allgather_object(("rank", rank))

    def scaled(x):  # a local function, as Horovod's cloudpickle carries it
        return x * (rank + 1)

    out["function"] = hvd.broadcast_object(lambda x: x + 100 * rank, root_rank=world - 1)(1)
    out["functions"] = [f(1) for f in hvd.allgather_object(scaled)]
    for call in (
        lambda: hvd.broadcast_object(threading.Lock(), root_rank=1),  # nothing can serialize a lock
        lambda: hvd.allgather_object(threading.Lock() if rank == 0 else rank),
    ):
        try:
            call()
            out.setdefault("unserializable", []).append(None)
        except Exception as exc:  # noqa: BLE001 - reported to the test
            out.setdefault("unserializable", []).append(f"{type(exc).__name__}: {exc}")
    layer = torch.nn.Linear(2, 2)
    with torch.no_grad():
        for p in layer.parameters():
            p.fill_(rank)
    hvd.broadcast_parameters(list(layer.parameters()), root_rank=world - 1)  # bare tensors, named by position
    out["parameters"] = [p.tolist() for p in layer.parameters()]
    try:
        hvd.allreduce(torch.zeros(rank + 1), name="mismatch")
        out["mismatch"] = None
    except Exception as exc:  # noqa: BLE001 - reported to the test
        out["mismatch"] = f"{type(exc).__name__}: {exc}"
    out["after_mismatch"] = hvd.allreduce(torch.ones(1), name="after", op=hvd.Sum).tolist()
    int8_compressed(rank, out)
    return out


def int8_inputs(rank):
    """This rank's inputs of the int8 collectives (the test makes the same): 300 and 768 floats."""
    g = torch.Generator().manual_seed(rank)  # on the CPU, also where the caller's default device is cuda
    return torch.randn(300, generator=g, device="cpu") * 10.0 ** (rank % 3), torch.randn(768, generator=g, device="cpu")


def int8_compressed(rank, out):
    """Compression.int8: allreduce, grouped_allreduce (blocks of 256 whether fused or not), an
    int64 tensor (sent as it is), ranks that disagree on the compression, and reducescatter."""
    one, two = (t.to(DEVICE) for t in int8_inputs(rank))
    summed = hvd.allreduce(one, name="int8", compression=hvd.Compression.int8, op=hvd.Sum)
    grouped = hvd.grouped_allreduce([two[:256], two[256:]], name="int8.grouped", compression=hvd.Compression.int8)
    counts = hvd.allreduce(torch.arange(3) + rank, name="int8.int64", compression=hvd.Compression.int8, op=hvd.Sum)
    out["int8"] = [str(summed.dtype), summed.tolist(), torch.cat(grouped).tolist(), counts.tolist()]
    for name, call in (
        (
            "disagree",
            lambda: hvd.allreduce(
                one, name="int8.disagree", compression=[hvd.Compression.int8, hvd.Compression.none][rank % 2]
            ),
        ),
        ("reducescatter", lambda: hvd.reducescatter(one, compression=hvd.Compression.int8)),
    ):
        try:
            call()
            out[f"int8_{name}"] = None
        except Exception as exc:  # noqa: BLE001 - reported to the test
            out[f"int8_{name}"] = f"{type(exc).__name__}: {exc}"


def train(rank, world, config):
    model = make_model(seed=1000 + rank)  # a different start on every rank
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    initial = flat(model)
    summing = config.get("op") == "sum"  # summed gradients with the rate divided by W: the same steps
    opt = torch.optim.SGD(model.parameters(), lr=LR / world if summing else LR, momentum=config.get("momentum", 0.0))
    passes = config.get("passes", 1)
    started = []  # per backward: the all-reduces already started when the first layer's grads arrive
    for p in model.a.parameters():  # registered before the optimizer's hooks: these run first
        p.register_post_accumulate_grad_hook(
            lambda p: started.append(sum(h is not None for h, _ in dist_opt._handles.values()))
        )
    opt = dist_opt = hvd.DistributedOptimizer(
        opt,
        named_parameters=model.named_parameters(),
        backward_passes_per_step=passes,
        compression=hvd.Compression.int8
        if config.get("int8")
        else hvd.Compression.fp16
        if config.get("fp16")
        else hvd.Compression.none,
        op=hvd.Sum if summing else hvd.Average,
        gradient_predivide_factor=config.get("predivide", 1.0),
        error_feedback=config.get("error_feedback", True),
    )
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    x, y = batch(world)
    per = x.shape[0] // world
    x, y = x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]
    for _ in range(STEPS):
        opt.zero_grad()
        for part in range(passes):  # gradient accumulation: the mean over this rank's rows
            rows = slice(part * per // passes, (part + 1) * per // passes)
            loss = torch.nn.functional.mse_loss(model(x[rows]), y[rows]) / passes
            loss.backward()
        if config.get("explicit_sync"):  # e.g. to clip the reduced gradients before stepping
            opt.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1e9)
            with opt.skip_synchronize():
                opt.step()
        else:
            opt.step()
    residuals = {
        name: dist_opt._residuals[p].tolist() for name, p in model.named_parameters() if p in dist_opt._residuals
    }
    return {"initial": initial, "final": flat(model), "started_before_first_layer": started, "residuals": residuals}


def main():
    configs = json.loads(sys.argv[1])
    torch.set_num_threads(1)
    try:
        hvd.init(process_sets="static")
        refused = None
    except ValueError as exc:  # refused before anything connects
        refused = str(exc)
    hvd.init(process_sets="dynamic")  # Horovod's switch: here process sets may always come and go
    rank, world = hvd.rank(), hvd.size()
    with torch.device(DEVICE):  # every tensor made below: on the GPU in the tests' CUDA runs
        result = {
            "refused": refused,
            "rank": rank,
            "size": world,
            "local_rank": hvd.local_rank(),
            "local_size": hvd.local_size(),
            "cross_size": hvd.cross_size(),
            "collectives": collectives(rank, world),
            "train": {name: train(rank, world, config) for name, config in configs.items()},
        }
    hvd.shutdown()
    report(result)


if __name__ == "__main__":
    main()
