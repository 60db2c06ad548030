#!/usr/bin/env python
"""Start-up of `dhp train` to the end of step 1, with the rank fork server on and off, on this machine.

python scripts/bench_startup.py [--conf tiny_vlm] [--pairs 3] [--before DIR] [--nodes N] [--json OUT.json] [key=value ...]

Runs ``dhp train conf=CONF train.steps=2`` (plus any overrides) ``--pairs`` times with
``DHP_FORK_SERVER=0`` (every rank a fresh Python importing torch, transformers and dhp) and with the
fork server (ranks forked from one pre-imported process), interleaved so all arms see the same load, each after ``--settle`` seconds of quiet.
``--before DIR`` adds a third arm: the same command on another checkout of dhp (``PYTHONPATH=DIR``,
e.g. a ``git worktree`` of an older commit), the "before" of a change. Each run's ``startup.json`` (process start to the end of step 1, phase by phase)
is read back; the script prints the per-phase medians of both arms, the ratio of the medians of the
totals and the whole command's wall time, and writes them as JSON. Figures are ratios measured in one
run: absolute seconds move with the machine's load. Runs go to a temporary output dir.

``--nodes N`` runs every arm on a simulated N-node Ray cluster on this machine
(``ray.cluster_utils.Cluster``: a head and N-1 worker nodes of ``--node-cpus`` CPUs each, started
once by this script and joined by each run through ``cluster.ray_address``), so the fork-server arm
forks each node's ranks from a server of that node (dhp.runtime.launch.forknodes). The plan of
tests/integration/test_multinode.py, 8 ranks over two nodes::

    python scripts/bench_startup.py --nodes 2 cluster.gpus_per_node=2 cluster.cpus_per_rank=0.25 \
        placement=collocated modules.vision.gpus=4 modules.vision.parallel.sp=4 modules.llm.gpus=4 \
        modules.llm.parallel.tp=2 modules.llm.parallel.dp=2 data.synthetic.patches=256 \
        modules.vision.seq_len=512
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

ARMS = {"fresh processes": {"DHP_FORK_SERVER": "0"}, "fork server": {"DHP_FORK_SERVER": "1"}}


def one_run(conf: str, overrides: list[str], *, env: dict[str, str], out: Path) -> dict:
    """One ``dhp train`` run; its startup phases, total and the command's wall time."""
    cmd = [
        sys.executable, "-m", "dhp.cli", "train", f"conf={conf}", "train.steps=2",
        f"train.output_dir={out}", *overrides,
    ]  # fmt: skip
    t0 = time.perf_counter()
    # `python -m` puts the working directory first on sys.path: the "before" arm runs from its own tree
    cwd = env.get("PYTHONPATH")
    done = subprocess.run(cmd, env={**os.environ, **env}, cwd=cwd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        sys.exit(f"dhp train failed ({env}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    found = sorted(out.glob("*/*/startup.json"), key=lambda p: p.stat().st_mtime)
    data = json.loads(found[-1].read_text())
    return {
        "total_s": data["total_s"],
        "wall_s": wall,
        "actors": next((p["phase"] for p in data["phases"] if p["phase"].startswith("actors start")), ""),
        "phases": {p["phase"]: p["seconds"] for p in data["phases"]},
    }


@contextlib.contextmanager
def simulated_cluster(nodes: int, cpus: int) -> Iterator[list[str]]:
    """A head and ``nodes - 1`` worker nodes on this machine; yields the overrides that join it."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": cpus, "include_dashboard": False})
    try:
        for _ in range(nodes - 1):
            cluster.add_node(num_cpus=cpus)
        cluster.wait_for_nodes()
        yield [f"cluster.nodes={nodes}", f"cluster.ray_address={cluster.address}"]
    finally:
        cluster.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--conf", default="tiny_vlm")
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--json", type=Path, default=Path("bench_startup.json"))
    ap.add_argument("--before", type=Path, help="another dhp checkout, run as a third arm")
    ap.add_argument("--settle", type=float, default=5.0, help="seconds of quiet before each run")
    ap.add_argument("--nodes", type=int, default=1, help="run on a simulated cluster of this many nodes")
    ap.add_argument("--node-cpus", type=int, default=2, help="CPUs of each simulated node")
    args, overrides = ap.parse_known_args()
    arms = dict(ARMS)
    if args.before:
        arms = {"before": {"PYTHONPATH": str(args.before.resolve())}, **arms}
    runs: dict[str, list[dict]] = {arm: [] for arm in arms}
    cluster = simulated_cluster(args.nodes, args.node_cpus) if args.nodes > 1 else contextlib.nullcontext([])
    with tempfile.TemporaryDirectory(prefix="dhp-bench-startup-") as tmp, cluster as joined:
        for i in range(args.pairs):
            for arm, env in arms.items():
                time.sleep(args.settle)  # the last run's Ray processes and file writes wind down first
                out = Path(tmp) / arm.replace(" ", "_")
                r = one_run(args.conf, [*overrides, *joined], env=env, out=out)
                runs[arm].append(r)
                print(
                    f"pair {i + 1}/{args.pairs} {arm:16s} start-up {r['total_s']:6.2f} s, "
                    f"command {r['wall_s']:6.2f} s; {r['actors']}"
                )
    summary = {}
    for arm, rs in runs.items():
        phases: dict[str, list[float]] = {}
        for r in rs:
            for name, s in r["phases"].items():
                key = name.split(" (")[0]  # the actors line names how the ranks began
                phases.setdefault(key, []).append(s)
        summary[arm] = {
            "total_s_median": statistics.median(r["total_s"] for r in rs),
            "wall_s_median": statistics.median(r["wall_s"] for r in rs),
            "phases_median": {k: round(statistics.median(v), 3) for k, v in phases.items()},
            "totals": [round(r["total_s"], 3) for r in rs],
        }
    off, on = summary["fresh processes"], summary["fork server"]
    base = summary.get("before", off)  # the ratios are to the "before" arm when there is one
    names = list(base["phases_median"])
    print("\n" + f"{'phase':34s}" + "".join(f"{arm[:14]:>16s}" for arm in summary))
    for k in names:
        print(
            f"{k:34s}" + "".join(f"{a['phases_median'].get(k, float('nan')):16.2f}" for a in summary.values())
        )
    ratio = on["total_s_median"] / base["total_s_median"]
    wall_ratio = on["wall_s_median"] / base["wall_s_median"]
    for label, key, r in (
        ("to the end of step 1", "total_s_median", ratio),
        ("whole command", "wall_s_median", wall_ratio),
    ):
        cells = "".join(f"{a[key]:16.2f}" for a in summary.values())
        print(f"{label:34s}{cells}   fork server / {'before' if args.before else 'fresh'}: {r:.2f}")
    result = {"conf": args.conf, "overrides": overrides, "nodes": args.nodes, "pairs": args.pairs, "before": str(args.before or ""), "arms": summary,
              "startup_ratio": round(ratio, 3), "wall_ratio": round(wall_ratio, 3)}  # fmt: skip
    args.json.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
