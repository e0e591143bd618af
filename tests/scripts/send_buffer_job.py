"""One rank for tests/jobs/test_socket_buffer.py on an emulated network: `python send_buffer_job.py MIB
ITERS HOLD`. All-reduces MIB MiB of float32 ITERS times (checking each sum), then prints one JSON
line: the send buffers its engine gave each reducer connection (reduction_server/wire/send_buffers.py)
and the kernel's view of them (ss's `tb`, per reducer port); then keeps its connections HOLD
seconds (the test reads the reducers' ends meanwhile)."""

import json
import re
import subprocess
import sys
import time

import numpy as np

import reduction_server.client as rs


def main() -> None:
    mib, iters = float(sys.argv[1]), int(sys.argv[2])
    with rs.Communicator.from_env() as comm:
        x = np.full(int(mib * (1 << 20)) // 4, comm.rank + 1, np.float32)
        want = sum(range(1, comm.world_size + 1))
        right = all(np.all(comm.all_reduce(x) == want) for _ in range(iters))
        buffers = comm._engine.connections.send_buffers
        locked = {comm._engine.connections.addresses[r]: size for r, size in buffers.locked.items()}
        out = subprocess.run(["ss", "-tmnH", "state", "established"], capture_output=True, text=True, check=True).stdout
        kernel, peer = {}, None
        for line in out.splitlines():  # "Recv-Q Send-Q local peer", then its " skmem:(... tbN ...)"
            fields = line.split()
            if fields and not fields[0].startswith("skmem"):
                peer = fields[3]
            elif fields and peer is not None:
                kernel[peer] = int(re.search(r"\btb(\d+)", line).group(1))
        print(
            json.dumps(
                {"rank": comm.rank, "right": bool(right), "locked": locked, "kernel": kernel, "found": len(buffers.fds)}
            ),
            flush=True,
        )
        time.sleep(float(sys.argv[3]))
        comm.barrier()


if __name__ == "__main__":
    main()
