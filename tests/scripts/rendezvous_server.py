"""An elastic job's rendezvous in a process of its own, as the launcher serves it, for the attack
tests (tests/jobs/test_rendezvous_attacks.py): argv is the token, a JSON object of the server's
bounds (constructor arguments; {} for the defaults) and the ids of its members. Prints its address,
then `round N formed: [ids]` for each round; stops when its standard input closes."""

from __future__ import annotations

import json
import sys

from reduction_server.launch.rendezvous import Rendezvous


def main() -> None:
    token, bounds, members = sys.argv[1], json.loads(sys.argv[2]), [int(m) for m in sys.argv[3:]]
    rendezvous = Rendezvous(
        token,
        "127.0.0.1",
        on_round=lambda number, workers: print(f"round {number} formed: {workers}", flush=True),
        **bounds,
    ).start()
    for worker in members:
        rendezvous.add(worker)
    print(rendezvous.address, flush=True)
    sys.stdin.read()
    rendezvous.close()


if __name__ == "__main__":
    main()
