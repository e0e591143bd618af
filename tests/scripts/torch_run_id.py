"""One rank of a torch job on the reduction_server backend over env:// (MASTER_ADDR and
MASTER_PORT set, as a PyTorchJob pod has them): one all-reduce, then the run id its Communicator
says to the reducers, as one JSON line."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from report import report  # noqa: E402

from reduction_server.client.torch import ReductionServerHookState  # noqa: E402  (registers the backend)


def main() -> None:
    dist.init_process_group("reduction_server")
    x = torch.ones(4)
    dist.all_reduce(x)
    communicator = ReductionServerHookState.for_process_group().communicator  # the default group's
    report({"rank": dist.get_rank(), "sum": x.tolist(), "run_id": communicator.run_id})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
