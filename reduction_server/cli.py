"""The `reduction-server` command: serve (a reducer), run (a local job), size (a reducer pool),
bench (the benchmark suites), chaos (failure injection)."""

from __future__ import annotations

import argparse
import math
import os
import sys
import textwrap
import traceback
from typing import Callable, List, Optional, Sequence

from ._version import __version__
from .config.settings import BENCH, LAUNCHER, REDUCERS, TUNING, variables_read_by
from .errors import ConfigError, ListenError


def _serve(args: argparse.Namespace) -> int:
    from .reducer import serve

    return serve(
        host=args.host,
        port=args.port,
        workers=args.workers,
        index=args.index,
        deterministic=args.deterministic,
        metrics_port=args.metrics_port,
        ready_fd=args.ready_fd,
        shards=args.shards,
        shard=args.shard,
        insecure_no_token=args.insecure_no_token,
    )


def _run(args: argparse.Namespace) -> int:
    from .launch.launcher import run_job

    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    return run_job(
        np=args.np,
        reducers=args.reducers,
        command=command,
        port_base=args.port_base,
        host=args.host,
        metrics_port=args.metrics_port,
        max_restarts=args.max_restarts,
        min_np=args.min_np,
        max_np=args.max_np,
        discovery=args.host_discovery_script,
        shards=args.shards,
    )


def _chaos(args: argparse.Namespace) -> int:
    from .tools.chaos import Target, inject, parse_match

    return inject(
        Target.parse(args.target),
        args.signal,
        at=args.at,
        between=args.between,
        hold=args.hold,
        wait=args.wait,
        seed=args.seed,
        match=parse_match(args.match),
    )


def _simulate(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from .client.chunking import plan_chunks
    from .config.settings import tuning
    from .tools import simulate
    from .tools.gradient_formats import wire_format
    from .tools.model_catalogue import model
    from .tools.pool_model import Chunking
    from .tools.svg_chart import line_chart

    if (args.mib is None) == (args.model is None):
        raise ConfigError("--simulate needs the gradient's size: --mib or --model, one of them")
    if args.mib is not None and not (args.mib > 0 and math.isfinite(args.mib)):
        raise ConfigError(f"--mib must be a positive size, got {args.mib:g}")
    if args.plot and Path(args.plot).suffix.lower() != ".svg":
        raise ConfigError(f"--plot writes SVG: name a .svg file, got {args.plot!r}")
    elements = int(model(args.model).parameters) if args.model else int(args.mib * (1 << 20) // 4)
    chunking = Chunking(tuning("RS_CHUNK_BYTES"), tuning("RS_PIPELINE_DEPTH"), tuning("RS_WINDOW"))
    job = simulate.make_job(
        workers=args.workers,
        worker_gbps=args.worker_gbps,
        reducer_gbps=args.reducer_gbps,
        rtt_ms=args.rtt_ms,
        elements=elements,
        fmt=wire_format(args.compression),
        chunking=chunking,
        compute_ms=args.step_compute_ms,
        optimizer_ms=args.optimizer_ms,
        bucket_mib=args.bucket_mib,
        reducer_cores=args.reducer_cores,
    )
    reducers = simulate.parse_reducers(args.reducers or str(job.network.workers))
    rows = simulate.simulate(job, reducers, plan_chunks)
    if args.json:
        print(json.dumps(simulate.as_json(job, rows), indent=1))
    else:
        print("\n".join(simulate.explain(job, rows)))
    if args.plot:
        path = line_chart(
            [row.reducers for row in rows],
            {"reducer pool": simulate.seconds(rows, "pool"), "ring": simulate.seconds(rows, "ring")},
            xlabel="reducer hosts R",
            ylabel="step time, s",
            title=f"W={job.network.workers}: predicted step time",
            path=Path(args.plot),
        )
        print(f"wrote {path}", file=sys.stderr)
    return 0


def _size(args: argparse.Namespace) -> int:
    from .tools.sizing import explain, measure

    if args.simulate:
        if args.measure:
            raise ConfigError("--simulate and --measure are two questions: ask one at a time")
        return _simulate(args)
    if args.reducer_cores and not args.measure:
        raise ConfigError("--reducer-cores needs --measure (without a measurement the NIC alone sizes a reducer host)")
    measured, cores = None, None
    if args.measure:
        from .reducer.options import ReducerConfig
        from .reducer.shards import usable_cores

        # The reducer it starts reads the environment's settings: a bad one is said here, in one line.
        ReducerConfig.resolve(host="127.0.0.1", port=0, index=0, workers=args.measure_workers, shards=1)

        measured = measure(args.measure_workers, args.measure_mib, args.measure_iters)
        cores = args.reducer_cores or usable_cores()
    print("\n".join(explain(args.workers, args.worker_gbps, args.reducer_gbps, measured, cores)))
    return 0


def _port(text: str) -> int:
    """An argparse type: a TCP port number, 0 to 65535 (0: a free one)."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is outside 0-65535")
    return port


def _at_least(least: int) -> Callable[[str], int]:
    """An argparse type: an integer, `least` or more."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"{value} is less than {least}")
        return value

    return parse


def _shard_count(text: str) -> str:
    """An argparse type: `auto` or a shard count of at least 1, as text for `serve --shards`."""
    if text.strip().lower() == "auto":
        return "auto"
    return str(_at_least(1)(text))


def _subcommand(
    sub: argparse._SubParsersAction, name: str, summary: str, example: str, readers: Sequence[str], note: str = ""
) -> argparse.ArgumentParser:
    """A subcommand whose --help gives its one-line summary, an example, and the environment
    variables it reads (from the registry in settings.py)."""
    variables = "\n".join(
        textwrap.fill(
            f"{v.name:<26} {v.meaning} (default: {v.default})".replace("`", ""),
            100,
            initial_indent="  ",
            subsequent_indent=" " * 29,
        )
        for v in variables_read_by(*readers)
    )
    epilog = f"example:\n  {example}\n\nenvironment variables it reads:\n{variables or '  none of its own'}" + (
        f"\n\n{textwrap.fill(note, 100)}" if note else ""
    )
    return sub.add_parser(
        name, help=summary, description=summary, epilog=epilog, formatter_class=argparse.RawDescriptionHelpFormatter
    )


def _positive_list(kind: type) -> Callable[[str], tuple]:
    """An argparse type: comma-separated positive, finite numbers."""

    def parse(text: str) -> tuple:
        try:
            values = tuple(kind(part) for part in text.split(","))
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not a comma-separated list of {kind.__name__} values"
            ) from None
        if any(not (value > 0 and math.isfinite(value)) for value in values):
            raise argparse.ArgumentTypeError(f"{text!r}: every value must be positive and finite")
        return values

    return parse


#: the extra that installs a module an entry point may miss: `pip install "reduction-server[EXTRA]"`
EXTRAS = {
    "tqdm": "bench",
    "matplotlib": "bench",
    "pytest_benchmark": "bench",
    "torch": "torch",
    "tensorflow": "tensorflow",
    "horovod": "torch",
}


def missing_extra(exc: ImportError) -> Optional[str]:
    """What to install for the module `exc` did not find, in one line; None for any other module."""
    name = (getattr(exc, "name", None) or "").split(".")[0]
    extra = EXTRAS.get(name)
    if extra is None:
        return None
    return f'needs {name}, which is not installed: pip install "reduction-server[{extra}]"'


def _bench(args: argparse.Namespace) -> int:
    try:
        return _run_bench(args)
    except ImportError as exc:  # an extra that is not installed: say which
        missing = missing_extra(exc)
        if missing is None:
            raise
        print(f"reduction-server bench {args.suite}: {missing}", file=sys.stderr)
        if _debugging(args):
            traceback.print_exc()
        return 2


def _run_bench(args: argparse.Namespace) -> int:
    from pathlib import Path

    from .bench.suites import SWEEPS
    from .bench.suites import main as bench

    # the options' dest names are run()'s keywords; --rounds and --variant are taken apart below
    sweep = {
        key: getattr(args, key)
        for key in SWEEPS
        if key not in ("rounds", "variants") and getattr(args, key) is not None
    }
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


_DEBUG_HELP = "on an error, print its traceback too (as RS_LOG_LEVEL=DEBUG does)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="reduction-server", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument("--debug", action="store_true", help=_DEBUG_HELP)
    sub = parser.add_subparsers(dest="verb", required=True)

    serve = _subcommand(
        sub,
        "serve",
        "Run one reducer: sum the gradient chunks the job's workers send it, and send the sums back.",
        "RS_JOB_TOKEN=$(openssl rand -hex 16) reduction-server serve --port 5555 --index 0 --workers 4",
        [REDUCERS],
        "Without --host, --port and --index it finds its place in CLUSTER_SPEC (task type workerpool2) or "
        "TF_CONFIG (task type ps).",
    )
    serve.add_argument("--host", default=None, help="address to bind (default: from the cluster spec, else 0.0.0.0)")
    serve.add_argument(
        "--port",
        type=_port,
        default=None,
        help="port to bind, 0-65535; 0 picks a free one (default: from the cluster spec, else 0)",
    )
    serve.add_argument(
        "--workers",
        type=_at_least(1),
        default=None,
        help="number of worker ranks W (default: RS_WORLD_SIZE or the cluster spec, else the first HELLO's)",
    )
    serve.add_argument(
        "--index",
        type=_at_least(0),
        default=None,
        help="this reducer's index: its position in the workers' RS_REDUCERS (default: from the cluster spec or "
        "RS_REDUCER_INDEX, else its own address's position in RS_REDUCERS, else 0)",
    )
    serve.add_argument(
        "--deterministic",
        action="store_true",
        default=None,
        help="sum contributions in rank order, so results are bitwise reproducible whatever "
        "their arrival order (default: RS_DETERMINISTIC, else off)",
    )
    serve.add_argument(
        "--metrics-port",
        type=_port,
        default=None,
        help="serve Prometheus metrics at http://HOST:PORT/metrics (default: RS_METRICS_PORT; "
        "0 or unset: off); a sharded reducer serves every shard's there, labelled `shard`",
    )
    serve.add_argument(
        "--shards",
        default=None,
        metavar="N|auto",
        help="reducer processes to run, on ports PORT .. PORT+N-1, each a share of every worker's "
        "chunks; auto: one per core this process may use (default: RS_SHARDS, else auto)",
    )
    serve.add_argument(
        "--insecure-no-token",
        action="store_true",
        default=None,
        help="start without RS_JOB_TOKEN on an address other than the loopback, where anyone who "
        "reaches the port may join the job (default: RS_ALLOW_NO_TOKEN, else refuse)",
    )
    serve.add_argument("--shard", type=_at_least(0), default=None, help=argparse.SUPPRESS)  # set by the supervisor
    serve.add_argument(
        "--ready-fd",
        type=_at_least(0),
        default=None,
        metavar="FD",
        help="for launchers: once listening, write the bound port and a newline to this file descriptor and close it",
    )
    serve.set_defaults(func=_serve)

    run = _subcommand(
        sub,
        "run",
        "Start R reducers and W copies of a command on this machine, as one job.",
        "reduction-server run -np 4 --reducers 2 -- python train.py",
        [LAUNCHER],
        "Every process it starts inherits its environment: the workers read the client's variables "
        "(reduction-server serve --help lists the reducers'), and get RS_RANK, RS_WORLD_SIZE, RS_REDUCERS, "
        "RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT from it.",
    )
    run.add_argument("-np", "--np", type=int, required=True, dest="np", help="number of worker processes W")
    run.add_argument("--reducers", type=int, default=1, help="number of reducer processes R (default 1)")
    run.add_argument(
        "--port-base", type=int, default=None, help="reducer i listens on PORT_BASE+i (default: free ports)"
    )
    run.add_argument("--host", default="127.0.0.1", help="address the reducers bind (default 127.0.0.1)")
    run.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="reducer i serves Prometheus metrics on METRICS_PORT+i (default: off)",
    )
    run.add_argument(
        "--shards",
        type=_shard_count,
        default="1",
        metavar="N|auto",
        help="shard processes per reducer (serve --shards), each on a run of free ports it chooses; auto: "
        "each reducer's share of the cores this launcher may use, split among the R reducers (default 1)",
    )
    run.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        help="start the worker group again (same reducers, next RS_GENERATION, "
        "TORCHELASTIC_RESTART_COUNT) when a worker fails, up to this many times (default 0)",
    )
    run.add_argument(
        "--min-np",
        type=int,
        default=None,
        help="elastic Horovod: go on without failed workers while at least this many run",
    )
    run.add_argument(
        "--max-np",
        type=int,
        default=None,
        help="elastic Horovod: start new workers up to this many as the discovery script reports slots",
    )
    run.add_argument(
        "--host-discovery-script",
        default=None,
        metavar="PATH",
        help="elastic Horovod: prints host:slots lines (this machine's names only); run every second",
    )
    run.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD ARGS...")
    run.set_defaults(func=_run)

    size = _subcommand(
        sub,
        "size",
        "How many reducer hosts a job needs: R >= W x worker bandwidth / reducer bandwidth.",
        "reduction-server size --workers 8 --worker-gbps 100 --reducer-gbps 32 --measure",
        [],
        "--measure starts a reducer and --measure-workers workers on this host, with the environment's "
        "settings (see reduction-server serve --help) and RS_SHM=0, and measures the reducer's CPU time per GiB. "
        "--simulate predicts the all-reduce and step time for each R beside a ring (docs/sizing.md), with the "
        "chunking a worker would read from the environment: RS_CHUNK_BYTES, RS_PIPELINE_DEPTH, RS_WINDOW.",
    )
    size.add_argument("--workers", type=int, required=True, help="number of worker hosts")
    size.add_argument("--worker-gbps", type=float, required=True, help="each worker host's network bandwidth, Gbit/s")
    size.add_argument("--reducer-gbps", type=float, required=True, help="each reducer host's network bandwidth, Gbit/s")
    size.add_argument(
        "--measure",
        action="store_true",
        help="also measure what a core sums on this host, hence a reducer host, and say which limit binds",
    )
    size.add_argument(
        "--reducer-cores",
        type=_at_least(1),
        default=None,
        help="each reducer host's cores, with --measure (default: this host's) or --simulate (default 16: "
        "n1-highcpu-16)",
    )
    size.add_argument(
        "--simulate",
        action="store_true",
        help="predict the all-reduce and step time for each R beside a ring on the same network (docs/sizing.md)",
    )
    size.add_argument(
        "--reducers",
        default=None,
        metavar="R|LOW-HIGH|R,...",
        help="--simulate: reducer host counts, e.g. 8, 1-32 or 4,8,16 (default W)",
    )
    size.add_argument("--rtt-ms", type=float, default=0.0, help="--simulate: round trip between hosts, ms (default 0)")
    size.add_argument("--mib", type=float, default=None, help="--simulate: the gradient's size as float32, MiB")
    size.add_argument(
        "--model", default=None, help="--simulate: a model's gradient instead of --mib: resnet50, bert-large, 7b, 70b"
    )
    size.add_argument(
        "--step-compute-ms",
        type=float,
        default=0.0,
        help="--simulate: a step's forward and backward compute, ms (default 0: the all-reduce alone)",
    )
    size.add_argument(
        "--optimizer-ms", type=float, default=0.0, help="--simulate: the optimizer's time after the last all-reduce"
    )
    size.add_argument(
        "--bucket-mib", type=float, default=25.0, help="--simulate: DDP's bucket_cap_mb or Horovod's fusion threshold"
    )
    size.add_argument(
        "--compression", default="none", help="--simulate: the gradient's wire format: none (float32), fp16 or int8"
    )
    size.add_argument("--json", action="store_true", help="--simulate: the prediction as JSON")
    size.add_argument("--plot", default=None, metavar="FILE.svg", help="--simulate: draw time against R as SVG")
    size.add_argument("--measure-workers", type=int, default=2, help="local worker processes for --measure (default 2)")
    size.add_argument("--measure-mib", type=float, default=64, help="all-reduce size for --measure (default 64)")
    size.add_argument("--measure-iters", type=int, default=5, help="timed steps for --measure (default 5)")
    size.set_defaults(func=_size)

    bench = _subcommand(
        sub,
        "bench",
        "Run a benchmark suite beside its peers: a table of ratios, JSON and PNG plots.",
        "reduction-server bench loopback --quick",
        [BENCH],
        "The emulated hosts of netem and ddp inherit these; --variant NAME=VALUE runs this project once more "
        "with others, in the same turns.",
    )
    bench.add_argument(
        "suite",
        choices=[
            "kernels",
            "loopback",
            "netem",
            "ddp",
            "collectives",
            "reducer",
            "chunks",
            "failover",
            "sizing",
            "numerics",
        ],
        help="kernels: native kernels vs NumPy; loopback: all-reduce vs Gloo (and MPI) on this "
        "machine; netem: vs Gloo's ring on an emulated network of shaped links (needs root); "
        "ddp: DDP training steps/s vs DDP over Gloo on that network (needs root and torch); "
        "collectives: reduce_scatter and all_gather vs Gloo on loopback and that network "
        "(needs root and torch); reducer: one reducer's CPU per GiB over tcp vs the copy limit "
        "measured in the same run, its busiest thread's share, and both against shards; chunks: a worker's and the "
        "reducers' CPU per chunk and per GiB over chunk sizes, beside a Gloo rank's CPU; failover: the step in which a "
        "reducer is killed (and one in which it drains, SIGTERM) and the steps after it vs undisturbed runs on that "
        "network (needs root); sizing: "
        "the step-time model's predicted all-reduce vs the measured one, ours and Gloo's, over a grid of "
        "that network (needs root and torch; docs/sizing.md); numerics: the held-out loss of the same training "
        "with float32, bf16 and int8 gradients and PowerSGD over Gloo (needs torch; docs/numerics.md)",
    )
    bench.add_argument("--out", default="bench/out", help="directory for the JSON and PNG files (default bench/out)")
    bench.add_argument("--quick", action="store_true", help="a small, fast configuration (a smoke run)")
    bench.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="loopback, netem, ddp, collectives, chunks, failover and sizing: run the peers in turns this many "
        "times (on the same network) and report medians (default 1; a shared machine's noise needs 3 or more)",
    )
    sweep = "replaces the suite's (or --quick's) configuration"
    bench.add_argument(
        "--workers",
        type=_positive_list(int),
        default=None,
        dest="worlds",
        metavar="W,...",
        help=f"worker counts W to sweep (loopback, netem, ddp, collectives, chunks, failover); {sweep}",
    )
    bench.add_argument(
        "--reducers",
        type=_positive_list(int),
        default=None,
        metavar="R,...",
        help=f"reducer counts R to sweep (loopback, netem, ddp, collectives, chunks, failover; default R = W on the "
        f"emulated network, 3 for failover); {sweep}",
    )
    bench.add_argument(
        "--rate-mbit",
        type=_positive_list(float),
        default=None,
        dest="rates_mbit",
        metavar="MBIT,...",
        help=f"link rates to sweep, Mbit/s each way (netem, ddp, collectives, failover); {sweep}",
    )
    bench.add_argument(
        "--mib",
        type=_positive_list(float),
        default=None,
        dest="sizes_mib",
        metavar="MIB,...",
        help="all-reduce sizes (kernels: accumulator sizes; collectives: full tensors) to sweep, MiB "
        f"(kernels, loopback, netem, collectives, reducer, chunks, failover); {sweep}",
    )
    bench.add_argument(
        "--shards",
        type=_positive_list(int),
        default=None,
        metavar="N,...",
        help=f"reducer: shard counts (serve --shards) to sweep; {sweep}",
    )
    bench.add_argument(
        "--compression",
        type=lambda text: tuple(part.strip() for part in text.split(",")),
        default=None,
        dest="compressions",
        metavar="NAME,...",
        help="reducer, netem, ddp: the workers' compression= to sweep (none, int8, bf16, fp16), each against float32 "
        f"in the same turns (reducer: CPU per GiB; netem, ddp: time; a 16-bit format also through Gloo); {sweep}",
    )
    bench.add_argument(
        "--part",
        default=None,
        metavar="K/N",
        help="sizing: run only the K-th of N parts of the grid (calibrated on its own; rows keep their "
        "point's index), so that a bounded machine runs the grid in N calls",
    )
    bench.add_argument(
        "--reducer-rate-mbit",
        type=_positive_list(float),
        default=None,
        dest="reducer_rates_mbit",
        metavar="MBIT,...",
        help=f"netem, ddp: the reducer hosts' link rates to sweep, Mbit/s each way (default: the workers'); {sweep}",
    )
    bench.add_argument(
        "--chunk-kib",
        type=_positive_list(float),
        default=None,
        dest="chunks_kib",
        metavar="KIB,...",
        help=f"chunks: chunk sizes (RS_CHUNK_BYTES) to sweep, KiB; {sweep}",
    )
    bench.add_argument(
        "--delay-ms",
        type=float,
        default=None,
        metavar="MS",
        help="netem, ddp: delay each direction of each link this long (a round trip between two hosts "
        "crosses it four times; needs the kernel's netem qdisc; default 0)",
    )
    bench.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=VALUE[,...]",
        help=f"netem, ddp, reducer: run this project once more with these settings ({', '.join(TUNING)}), in "
        "the same turns on the same network, as rows of their own; repeat for more variants",
    )
    bench.set_defaults(func=_bench)

    chaos = _subcommand(
        sub,
        "chaos",
        "Kill or freeze one reducer or worker of a running job on this host, at a chosen or random moment.",
        "reduction-server chaos --target reducer:1 --between 10,60",
        [],
        "Run it on the host of the process to hit. --signal stop freezes it (SIGSTOP) and resumes it (SIGCONT) "
        "after --for seconds; past RS_LIVENESS_TIMEOUT its peers count it lost.",
    )
    chaos.add_argument("--target", required=True, metavar="reducer:INDEX|rank:RANK", help="what to hit")
    chaos.add_argument(
        "--signal",
        default="kill",
        choices=["kill", "term", "stop"],
        help="SIGKILL (default), SIGTERM, or SIGSTOP then SIGCONT",
    )
    when = chaos.add_mutually_exclusive_group()
    when.add_argument("--at", type=float, default=None, metavar="SECONDS", help="this long from now (default 0)")
    when.add_argument(
        "--between",
        type=_positive_list(float),
        default=None,
        metavar="FIRST,LAST",
        help="at a uniformly random moment this many seconds from now",
    )
    chaos.add_argument(
        "--for",
        type=float,
        default=0.0,
        dest="hold",
        metavar="SECONDS",
        help="--signal stop: how long it stays stopped (default 0)",
    )
    chaos.add_argument(
        "--wait",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="how long to wait for the target to appear (default 60)",
    )
    chaos.add_argument("--seed", type=int, default=None, help="seed of --between's random moment")
    chaos.add_argument(
        "--match",
        default=None,
        metavar="NAME=VALUE",
        help="only processes whose environment has NAME=VALUE (one job of several on this host)",
    )
    chaos.set_defaults(func=_chaos)
    for command in (serve, run, size, bench, chaos):  # also after the verb; SUPPRESS: unset keeps the top level's
        command.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=_DEBUG_HELP)
    return parser


def _debugging(args: argparse.Namespace) -> bool:
    """Whether an error shows its traceback: --debug, or RS_LOG_LEVEL=DEBUG."""
    return bool(getattr(args, "debug", False)) or os.environ.get("RS_LOG_LEVEL", "").strip().upper() == "DEBUG"


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, ListenError) as exc:
        # A bad value the user can fix (2), or a place something else holds (1): one line that
        # says what to do; the traceback only when asked for.
        if _debugging(args):
            traceback.print_exc()
        print(f"reduction-server {args.verb}: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, ConfigError) else 1
