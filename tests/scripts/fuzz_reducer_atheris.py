"""Coverage-guided fuzzing (atheris) of the reducer's message handling, in process:
`python fuzz_reducer_atheris.py SECONDS ARTIFACT_DIR [deterministic]`.

A real Reducer (reduction_server.reducer) with its ROUTER socket replaced by one that keeps what
it would send, and a job token. Two ranks of a job are admitted; each fuzz input is decoded into
a few messages: mostly DATA from the ranks with consistent headers (dtype, op, seq, chunk, sizes
drawn small so that rounds collide, complete, mismatch and duplicate), some with one field or
the payload size broken, headers with arbitrary fields, raw frames, a stranger's handshake with
a wrong proof, BYE and PING. A rank that is no longer admitted is admitted again.

After every input it checks that nothing escaped handle(), that no INTERNAL error was answered (a
bug the reducer caught), that every frame it sent parses, that only the ranks received RESULTs,
and that the memory accounting adds up: the pool's per-rank charges equal the charges of the
open rounds plus the frames they hold. Exits 0 after SECONDS (printing what the reducer answered,
by type), non-zero on the first violation (its input goes to ARTIFACT_DIR).
"""

import json
import os
import resource
import sys
import time
from pathlib import Path

import atheris
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from helpers.capture import CapturingSocket  # noqa: E402

os.environ.setdefault("RS_LOG_LEVEL", "ERROR")  # a warning per rejected input would drown the fuzzer's output

with atheris.instrument_imports(include=["reduction_server"]):
    from reduction_server.reducer import MAX_STRIKES, Reducer
    from reduction_server.wire import auth, protocol
    from reduction_server.wire.protocol import DType, ErrorCode, MsgType, ReduceOp

TOKEN = "fuzz-token"
WORLD = 2
JOB = 0xF0
RANKS = [b"rank0", b"rank1"]
OPS = [int(op) for op in ReduceOp]


def deliver(reducer: Reducer, identity: bytes, *frames: bytes) -> None:
    reducer.handle([zmq.Frame(identity), *[zmq.Frame(f) for f in frames]])


def admit(reducer: Reducer, rank: int) -> None:
    """The handshake of rank, with the right proof (skipped if it is admitted); a rank whose
    connection the reducer ignores (too many malformed frames) comes back as a new one."""
    identity = RANKS[rank]
    if reducer.members.rank_identity.get(rank) == identity:
        return
    if reducer.strikes.get(identity, (0,))[0] >= MAX_STRIKES:
        identity = RANKS[rank] = b"rank%d-%d" % (rank, time.monotonic_ns())
    ident = dict(rank=rank, world=WORLD, job=JOB)
    hello = json.dumps({"nonce": auth.new_nonce().hex()}).encode()
    deliver(reducer, identity, protocol.text_header(MsgType.HELLO, hello, **ident), hello)
    nonce = reducer.peers[identity].nonce
    proof = auth.worker_proof(TOKEN, nonce, job=JOB, generation=0, rank=rank, world=WORLD)
    deliver(reducer, identity, protocol.text_header(MsgType.AUTH, proof, **ident), proof)


def data_message(fdp: atheris.FuzzedDataProvider):
    """(identity, frames) of a contribution: consistent, or with one thing broken."""
    rank = fdp.ConsumeIntInRange(0, 1)
    dtype = DType(fdp.ConsumeIntInRange(0, 9))
    op = OPS[fdp.ConsumeIntInRange(0, len(OPS) - 1)]
    nchunks = fdp.ConsumeIntInRange(1, 3)
    count = fdp.ConsumeIntInRange(1, 64)
    fields = dict(
        type=MsgType.DATA,
        dtype=int(dtype),
        op=op,
        rank=rank,
        world=WORLD,
        job=JOB,
        seq=fdp.ConsumeIntInRange(0, 6),
        chunk=fdp.ConsumeIntInRange(0, nchunks - 1),
        nchunks=nchunks,
        offset=0,
        count=count,
        total=count * nchunks,
        aux=fdp.ConsumeIntInRange(0, 1),
        nbytes=count * dtype.itemsize,
    )
    if op == ReduceOp.BROADCAST and rank != fields["aux"]:
        fields["nbytes"] = 0
    if fdp.ConsumeIntInRange(0, 7) == 7:  # one field broken (not when the input has run out: that gives 0s)
        name = ["dtype", "op", "rank", "world", "job", "seq", "count", "total", "nbytes", "aux", "generation"][
            fdp.ConsumeIntInRange(0, 10)
        ]
        fields[name] = fdp.ConsumeIntInRange(0, 1 << 20) if fdp.ConsumeBool() else fdp.ConsumeInt(4) & 0xFFFFFFFF
    try:
        header = protocol.Header(**fields).pack()
    except Exception:  # a value struct cannot pack: send what it can
        return RANKS[rank], [fdp.ConsumeBytes(protocol.HEADER_SIZE)]
    size = min(fields["nbytes"], 1 << 17) if fdp.ConsumeIntInRange(0, 7) < 7 else fdp.ConsumeIntInRange(0, 600)
    payload = fdp.ConsumeBytes(size)
    payload += b"\0" * (size - len(payload))
    return RANKS[rank], [header] + ([payload] if size or fdp.ConsumeBool() else [])


def any_message(fdp: atheris.FuzzedDataProvider):
    kind = fdp.ConsumeIntInRange(0, 9)
    if kind <= 5:
        return data_message(fdp)
    identity = [*RANKS, b"stranger"][fdp.ConsumeIntInRange(0, 2)] if fdp.ConsumeIntInRange(0, 3) == 0 else b"stranger"
    if kind == 6:  # a header with arbitrary fields, and a payload
        values = [fdp.ConsumeInt(1) & 0xFF for _ in range(3)] + [fdp.ConsumeInt(4) & 0xFFFFFFFF for _ in range(6)]
        values += [fdp.ConsumeInt(8) & 0xFFFFFFFFFFFFFFFF for _ in range(7)]
        values[0] = values[0] % 14
        header = protocol.HEADER.pack(protocol.MAGIC, protocol.VERSION, *values)
        return identity, [header, fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 300))]
    if kind == 7:  # raw frames
        return identity, [fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 120)) for _ in range(fdp.ConsumeIntInRange(0, 3))]
    if kind == 8:  # a handshake message with a wrong proof, or out of order
        mtype = MsgType.HELLO if fdp.ConsumeBool() else MsgType.AUTH
        text = fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 64))
        return b"stranger", [
            protocol.text_header(
                mtype, text, rank=fdp.ConsumeIntInRange(0, 2), world=WORLD, job=JOB if fdp.ConsumeBool() else JOB + 1
            ),
            text,
        ]
    return identity, [protocol.text_header(MsgType.BYE if fdp.ConsumeIntInRange(0, 3) == 0 else MsgType.PING, b"")]


def check(reducer: Reducer, seen: dict) -> None:
    for identity, *frames in reducer.socket.sent:
        h = protocol.unpack(frames[0])
        name = h.type.name if h.type is not MsgType.ERROR else f"ERROR {ErrorCode(h.aux).name}"
        seen[name] = seen.get(name, 0) + 1
        assert not (h.type is MsgType.ERROR and h.aux == ErrorCode.INTERNAL), frames[1][:2000]
        assert h.type is not MsgType.RESULT or identity in RANKS, (identity, h)
    reducer.socket.sent.clear()
    pool = reducer.pool
    charged = {}
    held = 0
    for rnd in reducer.rounds.rounds.values():
        if rnd.charged:
            charged[rnd.owner] = charged.get(rnd.owner, 0) + rnd.charged
            if rnd.adopted is not None:  # a frame kept (a broadcast root's, or one summed into), not pool memory
                held += rnd.charged
        for rank, frame in rnd.held.items():
            charged[rank] = charged.get(rank, 0) + len(frame)
            held += len(frame)
    assert pool.by_rank == charged, (pool.by_rank, charged)
    assert pool.held_bytes == held, (pool.held_bytes, held)


def main() -> None:
    seconds, artifacts = float(sys.argv[1]), sys.argv[2]
    reducer = Reducer(
        CapturingSocket(),
        world_size=WORLD,
        job_token=TOKEN,
        max_chunk_bytes=1 << 16,
        max_accumulator_bytes=1 << 20,
        max_peer_bytes=1 << 12,
        max_rounds=16,
        deterministic=sys.argv[3:] == ["deterministic"],
    )
    runs = [0]
    seen: dict = {}  # answers sent, by type: how deep the inputs reach
    stop = time.monotonic() + seconds

    def one_input(data: bytes) -> None:
        runs[0] += 1
        fdp = atheris.FuzzedDataProvider(data)
        for rank in range(WORLD):
            admit(reducer, rank)
        for _ in range(fdp.ConsumeIntInRange(1, 8)):
            identity, frames = any_message(fdp)
            deliver(reducer, identity, *frames)
        if fdp.ConsumeIntInRange(0, 15) == 0:  # time passes: timeouts, skipped rounds, strangers forgotten
            reducer.now = time.monotonic() + fdp.ConsumeIntInRange(0, 400)
            reducer.rounds.expire(reducer.now)
            reducer.rounds.check_skipped()
            reducer.admission.forget_strangers(reducer.now)
        check(reducer, seen)
        if time.monotonic() > stop:  # libFuzzer's own -max_total_time exits without a word
            print(f"atheris: {runs[0]} inputs, no violation; answers: {seen}", flush=True)
            os._exit(0)

    # libFuzzer reads the peak RSS (ru_maxrss), which a process started by vfork and exec inherits
    # from its parent (pytest, with torch and TensorFlow loaded): the limit is 1 GiB over that.
    inherited = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
    limit = f"-rss_limit_mb={inherited + 1024}"
    atheris.Setup([sys.argv[0], limit, f"-artifact_prefix={artifacts.rstrip('/')}/"], one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
