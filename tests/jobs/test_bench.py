"""Each benchmark suite runs on a small configuration and produces well-formed output (no test
asserts a time: the machine is shared and noisy)."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("pytest_benchmark", reason="the bench extra is not installed (pip install '.[bench]')")
pytest.importorskip("matplotlib", reason="the bench extra is not installed (pip install '.[bench]')")

from reduction_server.bench import emulated_network, kernels, loopback, netem  # noqa: E402


def run_suite(suite, out, *options):
    proc = subprocess.run(
        [sys.executable, "-m", "reduction_server", "bench", suite, "--quick", "--out", str(out), *options],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((out / f"{suite}.json").read_text())
    png = (out / f"{suite}.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 2000
    assert doc["suite"] == suite and f"reduction-server bench {suite} --out {out}" in doc["command"]
    assert doc["machine"]["python"] and doc["date"]
    return proc.stdout, doc["rows"]


def test_kernels_suite(tmp_path):
    table, rows = run_suite("kernels", tmp_path)
    assert len(rows) == 10 * 5 + 1  # every dtype x op at the one quick size, and int8 blocks' decode-add
    assert {(r["dtype"], r["op"]) for r in rows} >= {
        ("float16", "sum"),
        ("bfloat16", "avg"),
        ("int8", "prod"),
        ("int8-blocks", "sum"),
    }
    for row in rows:
        assert set(kernels.COLUMNS) <= set(row)
        assert row["native_ms"] > 0 and row["numpy_ms"] > 0
        assert row["speedup"] == pytest.approx(row["numpy_ms"] / row["native_ms"])
    assert table.splitlines()[0].split() == kernels.COLUMNS


def test_loopback_suite(tmp_path):
    table, rows = run_suite("loopback", tmp_path, "--rounds", "2")
    ours = [r for r in rows if r["peer"].startswith("reduction-server")]
    assert [(r["peer"], r["W"], r["R"], r["mib"]) for r in ours] == [  # shared memory, and tcp sockets
        ("reduction-server", 2, 1, 0.25),
        ("reduction-server", 2, 1, 1),
        ("reduction-server (tcp)", 2, 1, 0.25),
        ("reduction-server (tcp)", 2, 1, 1),
    ]
    for row in rows:
        assert row["rounds"] == 2
        assert row["algbw_GBps"] == pytest.approx(row["mib"] * (1 << 20) / (row["ms"] / 1e3) / 1e9)
        assert row["busbw_GBps(ring)"] == pytest.approx(row["algbw_GBps"] * 2 * (row["W"] - 1) / row["W"])
        fastest, slowest = map(int, row["ms_range"].split("-"))  # the two turns, around their median
        assert fastest <= round(row["ms"]) <= slowest
    if "gloo" in loopback.available_peers():  # the peer ran in the same turns, and the ratio is to it
        gloo = {r["mib"]: r["algbw_GBps"] for r in rows if r["peer"] == "gloo"}
        assert set(gloo) == {0.25, 1}
        for row in ours:
            assert row["vs_gloo"] == pytest.approx(row["algbw_GBps"] / gloo[row["mib"]])
            low, high = map(float, row["vs_gloo_range"].split("-"))  # each turn's ratio, around the medians'
            assert low <= round(row["vs_gloo"], 2) <= high
    assert table.splitlines()[0].split() == loopback.COLUMNS


def test_unknown_suite_is_refused():
    proc = subprocess.run(
        [sys.executable, "-m", "reduction_server", "bench", "nope"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2 and "invalid choice" in proc.stderr


def _namespaces():
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def _bench_namespaces():
    return {line.split()[0] for line in _namespaces().splitlines() if re.match(r"rs\d+-", line)}


def _links():
    """Names of this namespace's network interfaces."""
    out = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    return set(re.findall(r"^\d+: ([^:@]+)", out, re.M))


needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"),
    reason="the emulated network needs root and iproute2 (ip, tc)",
)


@needs_root
def test_netem_suite(tmp_path):
    before = _bench_namespaces()
    # The sweep options replace the quick configuration's R (default R = W = 2) and link rate (400);
    # a variant runs this project once more, with its settings, as rows of its own.
    table, rows = run_suite(
        "netem",
        tmp_path,
        "--rounds",
        "2",
        "--reducers",
        "1",
        "--rate-mbit",
        "300",
        "--variant",
        "RS_SNDBUF=65536,RS_WINDOW=3",
    )
    assert json.loads((tmp_path / "netem.json").read_text())["command"].endswith(
        "--quick --reducers 1 --rate-mbit 300 --rounds 2 --variant RS_SNDBUF=65536,RS_WINDOW=3"
    )
    ours = ["reduction-server", "reduction-server RS_SNDBUF=65536 RS_WINDOW=3"]
    assert [r["peer"] for r in rows] == ["gloo", *ours]
    gloo = {r["mib"]: r["ms"] for r in rows if r["peer"] == "gloo"}
    for row in rows:
        assert row["W"] == 2 and row["mbit"] == 300 and row["mib"] == 1 and row["rounds"] == 2
        assert row["R"] == (1 if row["peer"] in ours else "-") and row["delay_ms"] == 0
        # one reducer's link carries the sums of both workers: it, not theirs, bounds the all-reduce
        assert row["bound_GBps"] == pytest.approx(300e6 / 8 / 1e9 * (0.5 if row["R"] == 1 else 1))
        assert row["of_bound"] == pytest.approx(row["algbw_GBps"] / row["bound_GBps"])
        assert 0.05 < row["of_bound"] < 1.2  # shaped links really limit it: nobody beats the wire
        fastest, slowest = map(int, row["ms_range"].split("-"))  # the two rounds, around their median
        assert fastest <= round(row["ms"]) <= slowest
        if gloo:
            assert row["vs_gloo"] == pytest.approx(gloo[row["mib"]] / row["ms"])
    assert table.splitlines()[0].split() == netem.COLUMNS
    assert _bench_namespaces() == before  # every namespace it made is gone


@needs_root
def test_netem_suite_compares_formats(tmp_path):
    """Each format runs in the same turns as float32; a 16-bit format also through the Gloo ring
    (half the bytes of the same elements); the sizes, bounds and algbw stay the float32 buffer's."""
    table, rows = run_suite(
        "netem", tmp_path, "--reducers", "1", "--reducer-rate-mbit", "800", "--compression", "int8,bf16"
    )
    assert [(r["peer"], r["compression"]) for r in rows] == [
        ("gloo", "none"),
        ("gloo", "bf16"),
        ("reduction-server", "none"),
        ("reduction-server int8", "int8"),
        ("reduction-server bf16", "bf16"),
    ]
    ours = {r["compression"]: r for r in rows if r["peer"] != "gloo"}
    for row in rows:
        if row["peer"] == "gloo":
            assert row["reducer_mbit"] == "-" and row["vs_float32"] == "-"
            continue
        # one reducer at twice the workers' rate carries both workers' sums: the workers' links bind
        assert row["reducer_mbit"] == 800 and row["bound_GBps"] == pytest.approx(400e6 / 8 / 1e9)
        assert row["vs_float32"] == pytest.approx(ours["none"]["ms"] / row["ms"])
    # fewer bytes than float32 on the same links: past float32's bound (int8 about a quarter, a
    # 16-bit format half)
    assert ours["int8"]["of_bound"] > 1 and ours["bf16"]["of_bound"] > 1 and rows[1]["of_bound"] > 1
    assert table.splitlines()[0].split() == netem.COLUMNS


def test_netem_bounds_follow_the_reducers_links():
    # W=8 at 200 Mbit/s with R=4 at 400: the reducers' links add up to the workers', so S/B
    assert netem.Links(8, 200, 4, 400).bounds() == pytest.approx((25e6 / 1e9, 25e6 * 8 / 14 / 1e9))
    assert netem.Links(8, 200, 2, 400).bounds()[0] == pytest.approx(12.5e6 / 1e9)  # half: theirs bind
    # a 16-bit buffer of as many elements as the float32 one is half its MiB
    assert netem._job_args([1, 16], 3, "bfloat16") == ["--mib", "0.5,8", "--iters", "3", "--dtype", "bfloat16"]
    assert netem._job_args([16], 3)[:2] == ["--mib", "16"]


class _RecordingNetwork:
    """Stands in for an EmulatedNetwork: records what each host would run, with which environment,
    and runs a stand-in that answers as a reducer or rank 0 would."""

    def __init__(self):
        self.spawned = []

    @staticmethod
    def address(i):
        return f"198.18.0.{i + 1}"

    def spawn(self, i, argv, env):
        self.spawned.append((i, argv, env))
        answer = "listening on tcp://x" if "serve" in argv else '{"bytes": 4, "seconds": 1.0}'
        return subprocess.Popen(["echo", answer], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def stop(self, procs):
        for proc in procs:
            proc.wait()


def test_a_variant_reaches_every_process_of_its_run(monkeypatch):
    monkeypatch.setenv("RS_WINDOW", "3")  # inherited by every run, unless a variant sets it
    monkeypatch.setenv("RS_TIMEOUT", "9")  # not a tuning setting: the hosts never see it
    net = _RecordingNetwork()
    settings = netem.parse_variant("RS_SNDBUF=16384,RS_WINDOW=2")
    rows = netem.run_reduction_server(net, 2, 2, "job", [], '{"bytes"', settings=settings)
    assert rows == [{"bytes": 4, "seconds": 1.0}]
    assert sorted(i for i, _, _ in net.spawned) == [0, 1, 2, 3]  # 2 reducers (hosts 2, 3), 2 workers
    for _, _, env in net.spawned:
        assert (env["RS_SNDBUF"], env["RS_WINDOW"]) == ("16384", "2") and "RS_TIMEOUT" not in env
    net = _RecordingNetwork()
    netem.run_reduction_server(net, 2, 2, "job", [], '{"bytes"')
    assert all(env["RS_WINDOW"] == "3" and "RS_SNDBUF" not in env for _, _, env in net.spawned)


def test_variants_are_parsed_and_labelled():
    assert netem.variant_runs([netem.parse_variant(" RS_SNDBUF = 16384 , RS_WINDOW=2"), {"RS_WINDOW": "8"}]) == [
        ("reduction-server", {}),
        ("reduction-server RS_SNDBUF=16384 RS_WINDOW=2", {"RS_SNDBUF": "16384", "RS_WINDOW": "2"}),
        ("reduction-server RS_WINDOW=8", {"RS_WINDOW": "8"}),
    ]
    # what protects a collective is a variant too, checked as a switch
    assert netem.parse_variant("RS_ENCRYPT=1") == {"RS_ENCRYPT": "1"}
    with pytest.raises(ValueError, match="RS_ENCRYPT"):
        netem.parse_variant("RS_ENCRYPT=maybe")


@needs_root
def test_ddp_suite(tmp_path):
    pytest.importorskip("torch", reason="the DDP benchmark needs torch")
    from reduction_server.bench import ddp

    before = _bench_namespaces()
    table, rows = run_suite("ddp", tmp_path, "--compression", "int8")
    assert [(r["peer"], r["compression"]) for r in rows] == [
        ("gloo", "none"),
        ("reduction-server", "none"),
        ("reduction-server int8", "int8"),
    ]
    gloo, ours, int8 = rows
    # int8 blocks with error feedback: the same training within their rounding
    assert int8["loss"] < int8["first_loss"] and int8["loss"] == pytest.approx(ours["loss"], rel=1e-2)
    assert int8["vs_float32"] == pytest.approx(ours["step_ms"] / int8["step_ms"])
    for row in rows:
        assert set(ddp.COLUMNS) <= set(row)
        assert row["W"] == 2 and row["mbit"] == 400 and row["batch"] == 4
        assert row["params_M"] == pytest.approx((24 * 32 * 32 + 9 * 32) / 1e6)  # the quick MLP, D = 32
        assert row["steps_per_s"] == pytest.approx(1e3 / row["step_ms"])
        assert row["rounds"] == 1 and row["step_ms_range"] == f"{row['step_ms']:.0f}-{row['step_ms']:.0f}"
        assert row["loss"] < row["first_loss"]  # it trained
    assert ours["R"] == 2 and ours["vs_gloo"] == pytest.approx(ours["steps_per_s"] / gloo["steps_per_s"])
    # Same weights, data and averaged gradients: the same training whichever backend sums them.
    assert ours["first_loss"] == gloo["first_loss"]
    assert ours["loss"] == pytest.approx(gloo["loss"], rel=1e-5)
    assert table.splitlines()[0].split() == ddp.COLUMNS
    assert _bench_namespaces() == before


@needs_root
def test_collectives_suite(tmp_path):
    """reduce_scatter_tensor and all_gather_into_tensor, each job checking its results exactly,
    on loopback and on the emulated network, each row beside Gloo's."""
    pytest.importorskip("torch", reason="the collectives benchmark needs torch")
    from reduction_server.bench import collectives

    before = _bench_namespaces()
    table, rows = run_suite("collectives", tmp_path)
    assert [(r["mbit"], r["peer"], r["collective"]) for r in rows] == [
        (where, peer, name)
        for where in ("loopback", 400)
        for peer in ("gloo", "reduction-server")
        for name in ("reduce_scatter_tensor", "all_gather_into_tensor")
    ]
    for row in rows:
        assert set(collectives.COLUMNS) <= set(row) and row["W"] == 2 and row["mib"] == 1
        assert row["R"] == ("-" if row["peer"] == "gloo" else 2)
        gloo = next(
            g for g in rows if (g["peer"], g["mbit"], g["collective"]) == ("gloo", row["mbit"], row["collective"])
        )
        assert row["vs_gloo"] == pytest.approx(gloo["ms"] / row["ms"])
    assert table.splitlines()[0].split() == collectives.COLUMNS
    assert _bench_namespaces() == before


def test_reducer_suite(tmp_path):
    """One reducer under two workers' load over tcp, as one shard and as two: its CPU per GiB
    beside the copy limits of the same run (one way and both ways, in the workers' chunk size),
    and how its CPU time splits over its threads (and its shards' threads)."""
    from reduction_server.bench import reducer

    table, rows = run_suite("reducer", tmp_path)
    assert [(row["W"], row["mib"], row["iters"], row["shards"]) for row in rows] == [(2, 16, 8, 1), (2, 16, 8, 2)]
    for row in rows:
        assert set(reducer.COLUMNS) <= set(row)
        assert row["limit_s_per_GiB"] == pytest.approx(row["recv"] + row["send"] + row["add"])
        assert row["vs_limit"] == pytest.approx(row["cpu_s_per_GiB"] / row["limit_s_per_GiB"])
        assert all(row[k] > 0 for k in ("Gbit_s_in", "cpu_s_per_GiB", "worker_cpu_s_per_GiB", "recv", "send", "add"))
        assert row["variant"] == "-"  # the defaults: no --variant given
        # both ways at once: one process receives and sends every byte, so it costs more than
        # half of receiving and sending apart, plus the same add
        assert row["duplex_s_per_GiB"] > row["add"] + 0.5 * (row["recv"] + row["send"]), row
        assert row["vs_duplex"] == pytest.approx(row["cpu_s_per_GiB"] / row["duplex_s_per_GiB"])
        assert row["threads"] >= 1 and 1 / row["threads"] <= row["busiest_share"] <= 1
        assert isinstance(row["busiest"], str) and row["busiest"]  # the busiest thread's name
        assert row["scales_to"] == pytest.approx(1 / row["busiest_share"])
        assert row["host_Gbit_s"] == pytest.approx(row["per_core_Gbit_s"] * min(row["shards"], row["scales_to"]))
    one, two = rows
    # RS_PIPELINE_DEPTH (32) chunks for the one reducer, spread over its shards
    assert one["chunk_KiB"] == two["chunk_KiB"] == 512, rows
    # two processes, each with its own I/O thread, take the bytes in halves: no thread carries most of it
    assert two["threads"] > one["threads"] and two["busiest_share"] < one["busiest_share"], rows
    assert table.splitlines()[0].split() == reducer.COLUMNS


@needs_root
def test_failover_suite(tmp_path):
    """Five runs on one emulated network: R reducers undisturbed, without kept results, R-1 from
    the start, and R with one SIGKILLed, then SIGTERMed (drained), mid-step (each job checks every
    sum, so those runs completing is itself the check that failover and the drain worked on shaped
    links)."""
    from reduction_server.bench import failover

    before = _bench_namespaces()
    table, rows = run_suite("failover", tmp_path)
    assert [(r["run"], r["R"]) for r in rows] == [
        ("undisturbed", 2),
        ("RS_FAILOVER=0", 2),
        ("fewer", 1),
        ("failover (reducer 1 killed in step 4)", "2->1"),
        ("drain (reducer 1 drained (SIGTERM) in step 4)", "2->1"),
    ]
    undisturbed = rows[0]["step_ms"]
    for row in rows:
        assert set(failover.COLUMNS) <= set(row) and (row["W"], row["mbit"], row["mib"]) == (2, 400, 1)
        assert row["step_ms"] > 0
    plain, lost = rows[:3], rows[3:]
    for row in plain:
        assert row["vs_undisturbed"] == pytest.approx(row["step_ms"] / undisturbed)
    for row in lost:
        assert row["vs_undisturbed"] == pytest.approx(row["loss_step_ms"] / undisturbed)
        assert row["after_vs_fewer"] == pytest.approx(row["after_ms"] / rows[2]["step_ms"])
        # one reducer left carries both workers' sums over one link: the steps after the loss
        # are bounded by the wire, as R-1 from the start is (a shaped link is the limit, not the CPU)
        assert row["after_ms"] > 1.5 * undisturbed
    assert rows[2]["step_ms"] > 1.5 * undisturbed
    assert table.splitlines()[0].split() == failover.COLUMNS
    assert _bench_namespaces() == before


@needs_root
def test_netem_cleans_up_when_interrupted(tmp_path):
    # SIGINT as a terminal sends it: not inherited as ignored, as it is when the tests themselves
    # run in the background of a non-interactive shell (Python then never raises KeyboardInterrupt).
    proc = subprocess.Popen(
        [sys.executable, "-m", "reduction_server", "bench", "netem", "--quick", "--out", str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    tag = f"rs{proc.pid}-"
    deadline = time.monotonic() + 60
    while tag not in _namespaces() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    assert tag in _namespaces(), "the benchmark made no namespaces"
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=60)
    assert proc.returncode != 0
    assert tag not in _namespaces()
    # nor a veth pair caught between its creation and its move into the host's namespace
    assert not [link for link in _links() if link.startswith(f"rs{proc.pid}")]


@needs_root
@pytest.mark.parametrize(
    "step",
    [("netns", "add"), ("link", "add"), ("link", "set")],
    ids=["namespace made", "veth pair made", "host end moved"],
)
def test_netem_deletes_what_an_interrupt_left_half_made(monkeypatch, step):
    made = emulated_network._ip

    def interrupted(*args):
        made(*args)
        if args[:2] == step and any(a.endswith(("-h0", "h0")) for a in args[2:]):
            raise KeyboardInterrupt  # a SIGINT that lands while `ip` runs: done, but not returned

    monkeypatch.setattr(emulated_network, "_ip", interrupted)
    net = emulated_network.EmulatedNetwork(2, 100)
    with pytest.raises(KeyboardInterrupt):
        net.__enter__()
    assert not [name for name in _bench_namespaces() if name.startswith(f"{net.tag}-")]
    assert not [link for link in _links() if link.startswith(net.tag)]  # neither end of the pair


@needs_root
def test_netem_sweeps_veths_a_killed_run_left():
    gone = subprocess.Popen(["true"])
    gone.wait()  # a run SIGKILLed while adding host 0 leaves its veth pair in this namespace
    name = f"rs{gone.pid}h0"
    subprocess.run(["ip", "link", "add", name, "type", "veth", "peer", "name", f"rs{gone.pid}s0"], check=True)
    try:
        assert name in emulated_network.stale_links()
        with emulated_network.cleanup_on_sigterm():  # what every run does first
            pass
        assert not [link for link in _links() if link.startswith(f"rs{gone.pid}")]
    finally:
        subprocess.run(["ip", "link", "del", name], capture_output=True)


@needs_root
def test_netem_switch_skips_the_firewall_hooks_of_this_host():
    hooks = [t for t in emulated_network.BRIDGE_NETFILTER if os.path.exists(f"/proc/sys/net/bridge/bridge-nf-call-{t}")]
    if not hooks:
        pytest.skip("br_netfilter is not loaded here: bridged frames never reach the firewall")

    def setting(table, namespace=None):
        where = ["ip", "netns", "exec", namespace] if namespace else []
        out = subprocess.run(
            [*where, "sysctl", "-n", f"net.bridge.bridge-nf-call-{table}"], capture_output=True, text=True, check=True
        ).stdout
        return out.strip()

    outside = {t: setting(t) for t in hooks}
    with emulated_network.EmulatedNetwork(2, 100) as net:
        assert {t: setting(t, net.switch) for t in hooks} == {t: "0" for t in hooks}
        assert {t: setting(t) for t in hooks} == outside  # this host's own setting is left alone


def test_the_recorded_command_names_inherited_settings(monkeypatch, tmp_path):
    from reduction_server.bench import suites

    for name in suites.TUNING:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RS_SNDBUF", "16384")
    monkeypatch.setenv("RS_TIMEOUT", "9")  # not a setting the emulated hosts inherit
    # options in one order whatever the caller's, and quoted where a shell needs it
    assert suites._command("netem", tmp_path / "a b", False, {"variants": [{"RS_WINDOW": "2"}], "rounds": 3}) == (
        f"RS_SNDBUF=16384 reduction-server bench netem --out '{tmp_path}/a b' --rounds 3 --variant RS_WINDOW=2"
    )


def test_reducer_suite_compares_compressed_loads_with_float32(tmp_path):
    """--compression none,int8: each load's CPU per GiB of float32 also over float32's (same W and
    shards); int8 blocks move about a quarter of the bytes."""
    _, rows = run_suite("reducer", tmp_path, "--shards", "1", "--compression", "none,int8")
    none, int8 = rows
    assert [(r["shards"], r["compression"]) for r in rows] == [(1, "none"), (1, "int8")]
    assert none["vs_float32"] == 1 and int8["vs_float32"] == pytest.approx(
        int8["cpu_s_per_GiB"] / none["cpu_s_per_GiB"]
    )
    assert int8["vs_float32"] < 1, rows


def test_numerics_suite(tmp_path):
    """Two ranks train the byte-level LM for 6 steps with float32 and with int8 blocks and error
    feedback: each row's held-out loss against float32's, the curves, and the verdict line."""
    from reduction_server.bench import numerics

    table, rows = run_suite("numerics", tmp_path)
    assert [(r["task"], r["variant"], r["W"], r["steps"]) for r in rows] == [
        ("charlm", "float32", 2, 6),
        ("charlm", "int8-ef", 2, 6),
    ]
    reference, int8 = rows
    assert [p["step"] for p in int8["curve"]] == [3, 6]
    assert reference["vs_float32_pct"] == 0 and 0 < int8["val_loss"] < 6  # from ln(256) = 5.5 down
    assert int8["vs_float32_pct"] == pytest.approx((int8["val_loss"] / reference["val_loss"] - 1) * 100)
    assert int8["val_loss"] != reference["val_loss"]  # int8's rounding reached the parameters
    assert table.splitlines()[0].split() == numerics.COLUMNS
    assert any(line.startswith("charlm: int8 with error feedback ends ") for line in table.splitlines())


def test_numerics_verdict_says_where_int8_misses_the_bar():
    from reduction_server.bench import numerics

    rows = [
        {"task": "digits", "variant": "int8-ef", "vs_float32_pct": 0.5, "accuracy": 0.9, "vs_float32_points": -0.8},
        {"task": "charlm", "variant": "int8-ef", "vs_float32_pct": -0.3, "accuracy": None},
    ]
    assert numerics.summary(rows) == [
        "digits: int8 with error feedback ends +0.50 % from float32's held-out loss, accuracy -0.80 points: "
        "NOT within issue 41's bar",
        "charlm: int8 with error feedback ends -0.30 % from float32's held-out loss: within issue 41's bar",
    ]


def test_chunks_suite(tmp_path):
    """Two workers through one reducer over tcp with chunks of 64 and 256 KiB, beside a Gloo ring:
    the worker's and the reducer's CPU per all-reduce, per GiB and per chunk, and the line fitted
    through them."""
    from reduction_server.bench import chunk_cost

    table, rows = run_suite("chunks", tmp_path)
    assert [(r["W"], r["R"], r["mib"], r["chunk_KiB"], r["chunks"]) for r in rows] == [
        (2, 1, 1, 64, 16),
        (2, 1, 1, 256, 4),
    ]
    for row in rows:
        assert set(chunk_cost.COLUMNS) <= set(row)
        assert all(row[k] > 0 for k in ("worker_cpu_s", "reducer_cpu_s", "gloo_cpu_s_per_GiB", "ms")), row
        assert row["worker_cpu_s_per_GiB"] == pytest.approx(row["worker_cpu_s"] * 1024)  # 1 MiB per all-reduce
        assert row["vs_gloo_cpu"] == pytest.approx(row["worker_cpu_s_per_GiB"] / row["gloo_cpu_s_per_GiB"])
        assert row["worker_us_per_chunk"] == pytest.approx(row["worker_cpu_s"] / row["chunks"] * 1e6)
        assert row["reducer_us_per_contribution"] == pytest.approx(row["reducer_cpu_s"] / (row["chunks"] * 2) * 1e6)
    assert table.splitlines()[0].split() == chunk_cost.COLUMNS
    (line,) = [text for text in table.splitlines() if text.startswith("W=2 R=1 1 MiB: worker ")]
    assert "us per chunk" in line and "us per contribution" in line, line


def test_chunk_cost_line_is_fitted_per_job_shape():
    """summary() takes the per-chunk cost as the slope over chunk counts and the rest per GiB."""
    from reduction_server.bench import chunk_cost

    rows = [
        {"W": 2, "R": 1, "mib": 1024, "chunks": n, "worker_cpu_s": 0.5 + n * 1e-4, "reducer_cpu_s": 1 + 2 * n * 2e-5}
        for n in (100, 400)
    ]
    for row in rows:
        row["gloo_cpu_s_per_GiB"] = 0.9
    (line,) = chunk_cost.summary(rows)
    assert line == (
        "W=2 R=1 1024 MiB: worker 100.0 us per chunk + 0.50 CPU-s per GiB (a Gloo rank: 0.90); "
        "reducers 20.0 us per contribution + 0.50 CPU-s per GiB in"
    )
    assert chunk_cost.summary(rows[:1]) == []  # one chunk count: no line


@pytest.mark.parametrize(
    "args,message",
    [
        (
            ["kernels", "--rounds", "3"],
            "--rounds is for the loopback, netem, ddp, collectives, chunks, failover and sizing suites, not kernels",
        ),
        (["netem", "--rounds", "0"], "rounds must be at least 1, got 0"),
        (
            ["kernels", "--workers", "2"],
            "--workers is for the loopback, netem, ddp, collectives, reducer, chunks and failover suites, not kernels",
        ),
        (
            ["loopback", "--rate-mbit", "100"],
            "--rate-mbit is for the netem, ddp, collectives and failover suites, not loopback",
        ),
        (["loopback", "--delay-ms", "1"], "--delay-ms is for the netem and ddp suites, not loopback"),
        (
            ["ddp", "--mib", "4"],
            "--mib is for the kernels, loopback, netem, collectives, reducer, chunks and failover suites, not ddp",
        ),
        (["netem", "--workers", "1,4"], "a ring needs at least 2 workers, got W=1"),
        (["netem", "--delay-ms", "-1"], "the link delay must be in 0..1000 ms, got -1"),
        (["ddp", "--delay-ms", "nan"], "the link delay must be in 0..1000 ms, got nan"),
        (
            ["loopback", "--variant", "RS_SNDBUF=4096"],
            "--variant is for the netem, ddp and reducer suites, not loopback",
        ),
        (
            ["netem", "--variant", "RS_JOB_TOKEN=x"],
            "the emulated hosts take no RS_JOB_TOKEN; choose from RS_CHUNK_BYTES, RS_WINDOW, "
            "RS_PIPELINE_DEPTH, RS_SNDBUF",
        ),
        (["ddp", "--variant", "RS_SNDBUF"], "--variant 'RS_SNDBUF': expected NAME=VALUE[,NAME=VALUE...]"),
        (
            ["netem", "--variant", "RS_SNDBUF=100"],
            "--variant 'RS_SNDBUF=100': RS_SNDBUF=100 must be `auto`, 0 (the kernel's autotuning) or 4096",
        ),
        (["ddp", "--variant", "RS_WINDOW=0"], "--variant 'RS_WINDOW=0': RS_WINDOW='0' must be at least 1"),
        (["netem", "--variant", "RS_WINDOW=2,RS_WINDOW=3"], "sets RS_WINDOW twice"),
        (["netem", "--variant", "RS_WINDOW=2", "--variant", "RS_WINDOW=2"], "--variant RS_WINDOW=2 is given twice"),
        (["netem", "--workers", "8", "--reducers", "8,243"], "W=8 workers and R=243 reducers are 251 hosts"),
        (["ddp", "--delay-ms", "1001"], "the link delay must be in 0..1000 ms, got 1001"),
        (
            ["loopback", "--compression", "int8"],
            "--compression is for the netem, ddp and reducer suites, not loopback",
        ),
        (["netem", "--compression", "int9"], "compression 'int9' is not known"),
        (["ddp", "--compression", "int8,none,int8"], "--compression int8,none,int8 names a format twice"),
        (
            ["collectives", "--reducer-rate-mbit", "400"],
            "--reducer-rate-mbit is for the netem and ddp suites, not collectives",
        ),
        (["netem", "--part", "1/2"], "--part is for the sizing suite, not netem"),
        (["sizing", "--part", "3/2"], "--part '3/2': expected K/N with 1 <= K <= N"),
    ],
)
def test_options_are_refused_where_they_mean_nothing(capsys, tmp_path, args, message):
    from reduction_server.cli import main

    assert main(["bench", *args, "--out", str(tmp_path)]) == 2
    assert message in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # refused before anything ran or was written


@pytest.mark.parametrize(
    "option,value,message",
    [
        ("--workers", "2,a", "'2,a' is not a comma-separated list of int values"),
        ("--mib", "0", "'0': every value must be positive and finite"),
        ("--rate-mbit", "-5", "'-5': every value must be positive and finite"),
        ("--rate-mbit", "200,inf", "'200,inf': every value must be positive and finite"),
    ],
)
def test_sweep_values_are_validated(option, value, message):
    proc = subprocess.run(
        [sys.executable, "-m", "reduction_server", "bench", "netem", f"{option}={value}"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and f"argument {option}: {message}" in proc.stderr, proc.stderr


@needs_root
def test_netem_delays_each_link_or_says_why_it_cannot():
    """With a delay, every link, both ends, holds each packet that long before shaping it (a round
    trip between two hosts crosses four delayed links); a kernel without the netem qdisc is refused
    by name, before any host exists, and what was made is gone."""
    before = _bench_namespaces()
    net = emulated_network.EmulatedNetwork(2, 100, delay_ms=5)
    try:
        net.__enter__()
    except OSError as exc:
        assert "sch_netem" in str(exc) and "run without a delay" in str(exc)
        assert _bench_namespaces() == before
        return
    try:
        for where, dev in ((net.namespace(0), net.interface(0)), (net.switch, f"{net.tag}s0")):
            qdiscs = subprocess.run(
                ["tc", "-n", where, "qdisc", "show", "dev", dev], capture_output=True, text=True, check=True
            ).stdout
            assert "netem 1: root" in qdiscs and "delay 5ms" in qdiscs and "tbf 10: parent 1:1" in qdiscs, qdiscs
        # A connection to a port nobody listens on is refused after one round trip; the first
        # also waits for ARP, so the second is the one timed.
        probe = (
            "import socket, time\n"
            "for _ in range(2):\n"
            "    s = socket.socket(); t = time.monotonic()\n"
            "    try: s.connect(('198.18.0.2', 9))\n"
            "    except ConnectionRefusedError: rtt = time.monotonic() - t\n"
            "    s.close()\n"
            "print(rtt)"
        )
        rtt = float(
            subprocess.run(
                ["ip", "netns", "exec", net.namespace(0), sys.executable, "-c", probe],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
        )
        assert rtt >= 4 * 0.005, rtt
    finally:
        net.close()
    assert _bench_namespaces() == before


def test_netem_refuses_without_root(monkeypatch, capsys, tmp_path):
    from reduction_server.bench.emulated_network import EmulatedNetwork
    from reduction_server.cli import main

    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(PermissionError, match="needs root"):
        EmulatedNetwork(2, 100)
    for suite in ("netem", "ddp"):
        assert main(["bench", suite, "--quick", "--out", str(tmp_path)]) == 2
        assert "needs root" in capsys.readouterr().err
