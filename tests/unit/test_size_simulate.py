"""`reduction-server size --simulate`: its refusals, one line naming what was wrong, and its JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from reduction_server.cli import main

BASE = ["size", "--simulate", "--workers", "8", "--worker-gbps", "100", "--reducer-gbps", "32"]


def run(capsys, *args: str):
    code = main([*BASE, *args])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(
    "args, names",
    [
        (["--mib", "64", "--worker-gbps", "0"], "--worker-gbps must be a positive"),
        (["--mib", "64", "--reducer-gbps", "-3"], "--reducer-gbps must be a positive"),
        (["--mib", "64", "--rtt-ms", "-1"], "--rtt-ms must be 0 or more"),
        (["--mib", "0"], "--mib must be a positive size"),
        (["--mib", "64", "--reducers", "1-5000"], "each count must be in 1..4096"),
        (["--mib", "64", "--reducers", "0"], "each count must be in 1..4096"),
        (["--mib", "64", "--reducers", "a lot"], "expected a count, a range like 1-32"),
        (["--model", "gpt-9"], "unknown --model 'gpt-9'; choose from resnet50, bert-large, 7b, 70b"),
        (["--mib", "64", "--compression", "zip"], "unknown --compression 'zip'; choose from none, fp16, int8"),
        ([], "--mib or --model"),
        (["--mib", "1", "--model", "7b"], "--mib or --model"),
        (["--mib", "64", "--plot", "out.png"], "--plot writes SVG"),
        (["--mib", "64", "--step-compute-ms", "-5"], "--step-compute-ms must be 0 or more"),
        (["--mib", "64", "--measure"], "--simulate and --measure"),
    ],
)
def test_bad_input_is_refused_in_one_line_naming_it(capsys, args, names):
    code, out, err = run(capsys, *args)
    assert code == 2 and out == ""
    assert len(err.splitlines()) == 1 and err.startswith("reduction-server size: ") and names in err, err


def test_the_workers_must_be_at_least_one(capsys):
    assert (
        main(["size", "--simulate", "--workers", "0", "--worker-gbps", "1", "--reducer-gbps", "1", "--mib", "1"]) == 2
    )
    assert "--workers must be in 1..100000, got 0" in capsys.readouterr().err


def test_json_carries_the_documented_keys_for_each_r(capsys):
    code, out, _ = run(capsys, "--model", "bert-large", "--reducers", "1-32", "--step-compute-ms", "200", "--json")
    assert code == 0
    doc = json.loads(out)
    assert [row["reducers"] for row in doc["rows"]] == list(range(1, 33))
    for row in doc["rows"]:
        assert {"allreduce_s", "ring_s", "tree_s", "step_s", "ring_step_s", "speedup", "binds"} <= set(row)
        assert row["step_s"] >= 0.2 and row["allreduce_s"] > 0
    assert doc["reducers_for_parity"] == 25  # Google's example: 8 x 100 / 32
    assert 1 <= doc["reducers_within_5pct"] <= 32
    # 25 reducers all-reduce faster than one, and the ring is the same for every R
    assert doc["rows"][24]["allreduce_s"] < doc["rows"][0]["allreduce_s"] / 2
    assert len({row["ring_s"] for row in doc["rows"]}) == 1


def test_int8_sizes_the_pool_by_a_byte_an_element_and_its_blocks_scales(capsys):
    """--compression int8: 1 + 4/B bytes an element (B: RS_INT8_BLOCK's default), so a link-bound
    all-reduce takes about a quarter of float32's time."""
    from reduction_server.config.settings import DEFAULT_INT8_BLOCK
    from reduction_server.wire.formats import block_bytes

    docs = {}
    for name in ("none", "int8"):
        code, out, _ = run(
            capsys, "--mib", "64", "--worker-gbps", "10", "--reducers", "64", "--compression", name, "--json"
        )
        assert code == 0
        docs[name] = json.loads(out)
    elements = 64 << 18
    assert docs["none"]["gradient_bytes"] == 4 * elements
    assert docs["int8"]["format"] == "int8"
    assert docs["int8"]["gradient_bytes"] == block_bytes(elements, DEFAULT_INT8_BLOCK)
    (none,), (int8,) = docs["none"]["rows"], docs["int8"]["rows"]
    assert none["binds"] == int8["binds"] == "worker link"
    ratio = int8["allreduce_s"] / none["allreduce_s"]
    assert abs(ratio - (1 + 4 / DEFAULT_INT8_BLOCK) / 4) < 0.01, ratio


def test_the_text_says_which_limit_binds_and_the_plot_is_svg(capsys, tmp_path: Path):
    plot = tmp_path / "r.svg"
    code, out, err = run(
        capsys,
        "--worker-gbps",
        "10",
        "--reducer-gbps",
        "3.2",
        "--mib",
        "100",
        "--reducers",
        "4,50",
        "--plot",
        str(plot),
    )
    assert code == 0
    lines = out.splitlines()
    assert lines[2].split()[0] == "4" and lines[2].endswith("reducer link")
    assert lines[3].split()[0] == "50" and lines[3].endswith("worker link")
    assert "R=25" in out and f"wrote {plot}" in err
    svg = plot.read_text()
    assert svg.startswith("<svg") and svg.count("<polyline") == 2


def test_the_charts_labels_of_r_stay_inside_the_plot(tmp_path: Path):
    from xml.dom import minidom

    from reduction_server.tools import svg_chart

    path = svg_chart.line_chart(
        list(range(1, 33)),
        {"pool": [1 / r for r in range(1, 33)]},
        xlabel="R",
        ylabel="s",
        title="t",
        path=tmp_path / "c.svg",
    )
    texts = minidom.parse(str(path)).getElementsByTagName("text")
    below = [t for t in texts if float(t.getAttribute("y")) == svg_chart.HEIGHT - svg_chart.BOTTOM + 16]
    assert [t.firstChild.data for t in below] == ["10", "20", "30"]
    assert all(svg_chart.LEFT <= float(t.getAttribute("x")) <= svg_chart.WIDTH - svg_chart.RIGHT for t in below)
