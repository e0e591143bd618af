"""`reduction-server bench numerics`: what each gradient format costs in accuracy (issue 41, scope
4). W ranks train the same model from the same seed for the same steps (numerics_job.py: a
byte-level transformer LM on the standard library's sources, an MLP on scikit-learn's digits),
once per variant: float32 over this backend (the reference), the bf16 hook, the int8 hook with
and without error feedback, and torch's PowerSGD (rank 4) over Gloo. Per row:

- val_loss: the held-out loss at the last step; vs_float32_pct: its difference from float32's,
  in per cent of it (issue 41: int8 with error feedback within 1 %);
- accuracy, vs_float32_points (digits): the held-out accuracy, and its difference in points
  (issue 41: within 0.5);
- the curve (held-out loss every `every` steps) goes to the JSON file and the plot.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Sequence

from tqdm import tqdm

from reduction_server.children import AWAY_FROM_SOURCE

#: variant -> the process group's backend (the job, numerics_job.py, imports torch; this module does not)
BACKENDS = {
    "float32": "reduction_server",
    "bf16": "reduction_server",
    "int8-ef": "reduction_server",
    "int8": "reduction_server",
    "powersgd-gloo": "gloo",
}
COLUMNS = ["task", "variant", "W", "steps", "val_loss", "vs_float32_pct", "accuracy", "vs_float32_points"]
TASKS = ("charlm", "digits")
VARIANTS = tuple(BACKENDS)


def run(
    tasks: Sequence[str] = TASKS,
    variants: Sequence[str] = VARIANTS,
    world: int = 4,
    reducers: int = 2,
    steps: int = 400,
    every: int = 20,
) -> List[Dict]:
    """One row per task x variant (float32 first: the others are compared with it), each with its
    curve (`curve`: the held-out figures every `every` steps)."""
    unknown = [v for v in variants if v not in BACKENDS] + [t for t in tasks if t not in TASKS]
    if unknown:
        raise ValueError(f"unknown task or variant {unknown}: tasks {', '.join(TASKS)}; variants {', '.join(BACKENDS)}")
    order = ["float32"] + [v for v in variants if v != "float32"]
    rows: List[Dict] = []
    with tqdm(total=len(tasks) * len(order), desc="numerics", unit="job") as progress:
        for task in tasks:
            results = {}
            for variant in order:
                results[variant] = _train(task, variant, world, reducers, steps, every)
                progress.update()
            rows += [_row(results[v], results["float32"]) for v in order]
    return rows


def _train(task: str, variant: str, world: int, reducers: int, steps: int, every: int) -> Dict:
    """One job: W ranks under `reduction-server run`, rank 0's JSON."""
    with tempfile.TemporaryDirectory(prefix="rs-numerics-") as tmp:
        out = Path(tmp) / "out.json"
        job = [sys.executable, "-m", "reduction_server.bench.numerics_job", task, variant, str(steps), str(every)]
        command = [sys.executable, "-m", "reduction_server", "run", "-np", str(world), "--reducers", str(reducers)]
        proc = subprocess.run(
            [*command, "--", *job, str(out)],
            capture_output=True,
            text=True,
            timeout=1800,
            cwd=AWAY_FROM_SOURCE,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        if proc.returncode != 0 or not out.exists():
            raise RuntimeError(
                f"{task} {variant} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
            )
        return json.loads(out.read_text())


def _row(result: Dict, reference: Dict) -> Dict:
    last, ref = result["curve"][-1], reference["curve"][-1]
    return {
        "task": result["task"],
        "variant": result["variant"],
        "W": result["world"],
        "steps": last["step"],
        "val_loss": last["val_loss"],
        "vs_float32_pct": (last["val_loss"] / ref["val_loss"] - 1) * 100,
        "accuracy": last.get("accuracy"),
        "vs_float32_points": (last["accuracy"] - ref["accuracy"]) * 100 if "accuracy" in last else None,
        "curve": result["curve"],
    }


def points(rows: Sequence[Dict]) -> List[Dict]:
    """The curves as plot points: task, variant, step, val_loss."""
    return [
        {"task": row["task"], "variant": row["variant"], "step": p["step"], "val_loss": p["val_loss"]}
        for row in rows
        for p in row["curve"]
    ]


def summary(rows: Sequence[Dict]) -> List[str]:
    """Issue 41's bar for int8 with error feedback, per task: within 1 % of float32's held-out
    loss (and 0.5 points of its accuracy), said plainly either way."""
    lines = []
    for row in (r for r in rows if r["variant"] == "int8-ef"):
        within = abs(row["vs_float32_pct"]) <= 1 and (row["accuracy"] is None or abs(row["vs_float32_points"]) <= 0.5)
        accuracy = "" if row["accuracy"] is None else f", accuracy {row['vs_float32_points']:+.2f} points"
        lines.append(
            f"{row['task']}: int8 with error feedback ends {row['vs_float32_pct']:+.2f} % from float32's "
            f"held-out loss{accuracy}: {'within' if within else 'NOT within'} issue 41's bar"
        )
    return lines
