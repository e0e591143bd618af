"""The `reduction-server` command: serve (a reducer), run (a local job)."""
from __future__ import annotations

import argparse
import math
import sys
from typing import Callable, List, Optional

from .errors import ConfigError
from .settings import TUNING


def _serve(args: argparse.Namespace) -> int:
    from .reducer import serve

    return serve(host=args.host, port=args.port, workers=args.workers, index=args.index,
                 deterministic=args.deterministic, metrics_port=args.metrics_port)


def _run(args: argparse.Namespace) -> int:
    from .launcher import run_job

    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    return run_job(np=args.np, reducers=args.reducers, command=command, port_base=args.port_base,
                   host=args.host, metrics_port=args.metrics_port)


def _size(args: argparse.Namespace) -> int:
    from .sizing import explain, measure

    measured = measure(args.measure_workers, args.measure_mib, args.measure_iters) if args.measure else None
    print("\n".join(explain(args.workers, args.worker_gbps, args.reducer_gbps, measured)))
    return 0


def _positive_list(kind: type) -> Callable[[str], tuple]:
    """An argparse type: comma-separated positive, finite numbers."""
    def parse(text: str) -> tuple:
        try:
            values = tuple(kind(part) for part in text.split(","))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of {kind.__name__} values") from None
        if any(not (value > 0 and math.isfinite(value)) for value in values):
            raise argparse.ArgumentTypeError(f"{text!r}: every value must be positive and finite")
        return values
    return parse


def _bench(args: argparse.Namespace) -> int:
    from pathlib import Path

    from .bench.suites import SWEEPS
    from .bench.suites import main as bench

    # the options' dest names are run()'s keywords; --rounds and --variant are taken apart below
    sweep = {key: getattr(args, key) for key in SWEEPS if key not in ("rounds", "variants")
             and getattr(args, key) is not None}
    try:
        if args.variant:
            from .bench.netem import parse_variant

            sweep["variants"] = [parse_variant(text) for text in args.variant]
        bench(args.suite, Path(args.out), quick=args.quick, rounds=args.rounds, sweep=sweep)
    except (OSError, ValueError) as exc:  # no root, no netem qdisc, an option the suite does not take
        print(f"reduction-server bench {args.suite}: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:  # a process of the run failed: its own words say why
        print(f"reduction-server bench {args.suite}: {exc}", file=sys.stderr)
        return 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="reduction-server", description=__doc__)
    sub = parser.add_subparsers(dest="verb", required=True)

    serve = sub.add_parser("serve", help="run one reducer process")
    serve.add_argument("--host", default=None,
                       help="address to bind (default: from the cluster spec, else 0.0.0.0)")
    serve.add_argument("--port", type=int, default=None,
                       help="port to bind; 0 picks a free one (default: from the cluster spec, else 0)")
    serve.add_argument("--workers", type=int, default=None,
                       help="number of worker ranks W (default: RS_WORLD_SIZE or the cluster spec, else the first HELLO's)")
    serve.add_argument("--index", type=int, default=None,
                       help="this reducer's index, for logs and errors (default: from the cluster spec, else 0)")
    serve.add_argument("--deterministic", action="store_true", default=None,
                       help="sum contributions in rank order, so results are bitwise reproducible whatever "
                            "their arrival order (default: RS_DETERMINISTIC, else off)")
    serve.add_argument("--metrics-port", type=int, default=None,
                       help="serve Prometheus metrics at http://HOST:PORT/metrics (default: RS_METRICS_PORT; "
                            "0 or unset: off)")
    serve.set_defaults(func=_serve)

    run = sub.add_parser("run", help="start R reducers and W copies of a command on this machine")
    run.add_argument("-np", "--np", type=int, required=True, dest="np", help="number of worker processes W")
    run.add_argument("--reducers", type=int, default=1, help="number of reducer processes R (default 1)")
    run.add_argument("--port-base", type=int, default=None,
                     help="reducer i listens on PORT_BASE+i (default: free ports)")
    run.add_argument("--host", default="127.0.0.1", help="address the reducers bind (default 127.0.0.1)")
    run.add_argument("--metrics-port", type=int, default=None,
                     help="reducer i serves Prometheus metrics on METRICS_PORT+i (default: off)")
    run.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD ARGS...")
    run.set_defaults(func=_run)

    size = sub.add_parser("size", help="how many reducers a job needs, from bandwidths (and a measurement)")
    size.add_argument("--workers", type=int, required=True, help="number of worker hosts")
    size.add_argument("--worker-gbps", type=float, required=True, help="each worker host's network bandwidth, Gbit/s")
    size.add_argument("--reducer-gbps", type=float, required=True, help="each reducer host's network bandwidth, Gbit/s")
    size.add_argument("--measure", action="store_true",
                      help="also measure what one reducer process can sum on this host, and say which limit binds")
    size.add_argument("--measure-workers", type=int, default=2, help="local worker processes for --measure (default 2)")
    size.add_argument("--measure-mib", type=float, default=64, help="all-reduce size for --measure (default 64)")
    size.add_argument("--measure-iters", type=int, default=5, help="timed steps for --measure (default 5)")
    size.set_defaults(func=_size)

    bench = sub.add_parser("bench", help="run a benchmark suite beside its peers: table, JSON and PNG plots")
    bench.add_argument("suite", choices=["kernels", "loopback", "netem", "ddp"],
                       help="kernels: native kernels vs NumPy; loopback: all-reduce vs Gloo (and MPI) on this "
                            "machine; netem: vs Gloo's ring on an emulated network of shaped links (needs root); "
                            "ddp: DDP training steps/s vs DDP over Gloo on that network (needs root and torch)")
    bench.add_argument("--out", default="bench/out", help="directory for the JSON and PNG files (default bench/out)")
    bench.add_argument("--quick", action="store_true", help="a small, fast configuration (a smoke run)")
    bench.add_argument("--rounds", type=int, default=1,
                       help="netem and ddp: run the peers in turns this many times on the same emulated network "
                            "and report medians (default 1; a shared machine's noise needs 3 or more)")
    sweep = "replaces the suite's (or --quick's) configuration"
    bench.add_argument("--workers", type=_positive_list(int), default=None, dest="worlds", metavar="W,...",
                       help=f"worker counts W to sweep (loopback, netem, ddp); {sweep}")
    bench.add_argument("--reducers", type=_positive_list(int), default=None, metavar="R,...",
                       help=f"reducer counts R to sweep (loopback, netem, ddp; default R = W on the emulated network); {sweep}")
    bench.add_argument("--rate-mbit", type=_positive_list(float), default=None, dest="rates_mbit", metavar="MBIT,...",
                       help=f"link rates to sweep, Mbit/s each way (netem, ddp); {sweep}")
    bench.add_argument("--mib", type=_positive_list(float), default=None, dest="sizes_mib", metavar="MIB,...",
                       help=f"all-reduce sizes (kernels: accumulator sizes) to sweep, MiB (kernels, loopback, netem); {sweep}")
    bench.add_argument("--delay-ms", type=float, default=None, metavar="MS",
                       help="netem, ddp: delay each direction of each link this long (a round trip between two hosts "
                            "crosses it four times; needs the kernel's netem qdisc; default 0)")
    bench.add_argument("--variant", action="append", default=[], metavar="NAME=VALUE[,...]",
                       help=f"netem, ddp: run this project once more with these settings ({', '.join(TUNING)}), in "
                            "the same turns on the same network, as rows of their own; repeat for more variants")
    bench.set_defaults(func=_bench)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as exc:  # a bad value the user can fix: the message, not a traceback
        print(f"reduction-server {args.verb}: {exc}", file=sys.stderr)
        return 2
