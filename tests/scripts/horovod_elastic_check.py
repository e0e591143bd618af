"""Runs Horovod's pytorch_mnist_elastic.py (`python horovod_elastic_check.py SCRIPT ARGS...`) as
its own `__main__`, then checks what the example itself cannot print: that every rank ends with
the same committed model. Rank 0 prints one JSON line: the final world size, the epoch, and
whether the ranks' model digests agree."""

import hashlib
import json
import runpy
import sys

import reduction_server.client.horovod.torch as hvd


def main() -> None:
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    names = runpy.run_path(script, run_name="__main__")
    model, state = names["model"], names["state"]
    digest = hashlib.sha256(b"".join(t.detach().numpy().tobytes() for t in model.state_dict().values())).hexdigest()
    digests = hvd.allgather_object(digest)
    if hvd.rank() == 0:
        print(
            json.dumps(
                {
                    "size": hvd.size(),
                    "epoch": state.epoch,
                    "same_model": len(set(digests)) == 1,
                    "digests": len(digests),
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
