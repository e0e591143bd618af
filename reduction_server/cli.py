"""The `reduction-server` command: serve (a reducer), run (a local job)."""
from __future__ import annotations

import argparse
from typing import List, Optional


def _serve(args: argparse.Namespace) -> int:
    from .reducer import serve

    return serve(host=args.host, port=args.port, workers=args.workers, index=args.index)


def _run(args: argparse.Namespace) -> int:
    from .launcher import run_job

    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    return run_job(np=args.np, reducers=args.reducers, command=command, port_base=args.port_base,
                   host=args.host)


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
    serve.set_defaults(func=_serve)

    run = sub.add_parser("run", help="start R reducers and W copies of a command on this machine")
    run.add_argument("-np", "--np", type=int, required=True, dest="np", help="number of worker processes W")
    run.add_argument("--reducers", type=int, default=1, help="number of reducer processes R (default 1)")
    run.add_argument("--port-base", type=int, default=None,
                     help="reducer i listens on PORT_BASE+i (default: free ports)")
    run.add_argument("--host", default="127.0.0.1", help="address the reducers bind (default 127.0.0.1)")
    run.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD ARGS...")
    run.set_defaults(func=_run)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)
