"""dhp on a simulated 2-node Ray cluster (``ray.cluster_utils.Cluster``: a head and a worker node,
each a raylet with its own 2 CPUs standing in for its 2 GPUs; ``cluster.nodes=2
cluster.gpus_per_node=2`` on CPU).

Plan: vision Ulysses SP=4 over all 4 slots (one SP group spanning both nodes) collocated with LLM
TP=2 x DP=2 (each TP group on one node, the DP replicas on different nodes). Checked:
- the plan puts every LLM TP group inside one node and lets the vision SP group and the LLM DP
  replicas span the nodes; the runtime's actors run exactly there (each actor's Ray node id);
- every rank on both nodes is forked from a pre-imported fork server of its own node (one per node,
  each preloading what the driver's would, each on its own socket), and the start-up line says so;
- two training steps across the nodes equal the single-process transformers model: the loss within
  1e-5 relative and every parameter's gradient within 1e-4 absolute (fp32; the plans differ only in
  reduction order, observed ~1e-7), the tolerances of ``dhp verify``;
- closing the run leaves nothing running on either node: no rank, no launcher, no fork server, no
  socket folder.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import ray
from procs import alive, descendants

from dhp.runtime.launch import forkserver

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TWO_NODES = [
    "cluster.nodes=2",
    "cluster.gpus_per_node=2",
    "cluster.cpus_per_rank=0.25",
    "placement=collocated",
    "modules.vision.gpus=4",
    "modules.vision.parallel.sp=4",
    "modules.llm.gpus=4",
    "modules.llm.parallel.tp=2",
    "modules.llm.parallel.dp=2",
    # 256-patch images: 4 attention windows each, so every SP rank gets whole windows
    "data.synthetic.patches=256",
    "modules.vision.seq_len=512",
]


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    ray.shutdown()  # the session's shared local instance (conftest), if up: this module needs its own
    forkserver.close_current()  # and that instance's fork server serves no node of this cluster
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    c.add_node(num_cpus=2)
    c.wait_for_nodes()
    ray.init(address=c.address, log_to_driver=False)
    try:
        yield c
    finally:
        ray.shutdown()
        c.shutdown()


def _node_of(actor) -> str:
    return ray.get(actor.__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id()))


def test_plan_keeps_tp_in_a_node_and_spans_sp_and_dp():
    from dhp.plan import compile_plan
    from dhp.validation import load_config

    plan = compile_plan(load_config("tiny_vlm", TWO_NODES))
    groups = {g.name: g for g in plan.groups}
    llm = groups["llm"].ranks
    tp_groups = {}
    for r in llm:
        tp_groups.setdefault(r.coords["dp"], set()).add(r.node)
    assert tp_groups == {0: {0}, 1: {1}}  # each TP group in one node; the DP replicas on both
    assert {r.node for r in groups["vision"].ranks} == {0, 1}  # one SP group across both nodes
    assert [pg.node for pg in plan.placement_groups] == [0, 1]
    assert all(pg.strategy == "STRICT_PACK" for pg in plan.placement_groups)


@pytest.fixture(scope="module")
def run(cluster):
    """One Trainer across both nodes for this module's tests (the last one closes it)."""
    from dhp.plan import compile_plan
    from dhp.runtime import Trainer
    from dhp.validation import load_config

    cfg = load_config("tiny_vlm", [*TWO_NODES, "train.steps=2", "train.warmup_steps=0"])
    plan = compile_plan(cfg)
    trainer = Trainer(cfg, plan)
    try:
        yield cfg, plan, trainer
    finally:
        trainer.close()


def _ppid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def test_ranks_on_both_nodes_fork_from_their_own_nodes_server(run):
    from dhp.runtime.launch.startup import actors_phase

    _, _, trainer = run
    nodes = trainer._fork_nodes
    assert nodes is not None and len(nodes.servers) == 2
    procs = [p for g in trainer.groups.values() for p in g.procs]
    assert [p.how for p in procs] == ["forked"] * 8, [p.how for p in procs]
    for p in procs:  # each rank is a child of the server of the node it runs on
        assert _ppid(p.pid) == nodes.servers[p.node_id].pid, (p, nodes.servers)
    sockets = {s.py_executable.split()[-1] for s in nodes.servers.values()}
    assert len(sockets) == 2  # two nodes on one machine: a socket each
    want = [*forkserver.BASE_PRELOAD, *forkserver.family_modules("qwen2_5_vl")]
    for status in nodes.status().values():  # what the driver's own server would have preloaded
        assert status["loaded"] == want and status["failed"] == {} and status["refusal"] is None, status
    line = actors_phase([p.how for p in procs])
    assert line == "actors start (8 ranks forked from the pre-imported fork server)"
    assert line in [phase for phase, _ in trainer.startup.phases]


def test_training_across_two_nodes_matches_the_single_process_model(run):
    from dhp.data import build_run_loader
    from dhp.plan.compile import module_layouts
    from dhp.runtime.verify.compare import ReferenceModel, compare_grads

    cfg, plan, trainer = run
    loader = build_run_loader(cfg, module_layouts(cfg))
    nodes = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"])
    assert len(nodes) == 2
    try:
        # where the actors really run: ray node of each rank, against the plan's node index
        placed = {
            (name, rank): _node_of(actor)
            for name, group in trainer.groups.items()
            for rank, actor in enumerate(group.actors)
        }
        planned = {(g.name, r.rank): r.node for g in plan.groups for r in g.ranks}
        node_ids = {planned[k]: placed[k] for k in planned}
        assert len(set(node_ids.values())) == 2, placed  # plan node 0 / 1 -> two distinct Ray nodes
        assert all(placed[k] == node_ids[planned[k]] for k in planned), (placed, planned)
        llm_ranks = {r.rank: r for g in plan.groups if g.name == "llm" for r in g.ranks}
        for dp in (0, 1):
            tp_nodes = {placed[("llm", r)] for r, info in llm_ranks.items() if info.coords["dp"] == dp}
            assert len(tp_nodes) == 1, f"LLM TP group dp={dp} spans nodes: {tp_nodes}"
        assert len({placed[("vision", r)] for r in range(4)}) == 2  # SP spans both nodes

        ref = ReferenceModel(
            model=cfg.model, modules=dict(cfg.modules), train=cfg.train, initial=trainer.full_state_dict()
        )
        for _ in range(2):
            data = next(loader)
            res = trainer.step(data, lr=cfg.train.lr, collect_grads=True)
            ref_loss, _, ref_grads = ref.step(data, lr=cfg.train.lr)
            assert abs(res.loss - ref_loss) <= 1e-5 * abs(ref_loss), (res.loss, ref_loss)
            diffs, worst = compare_grads(res.grads, ref_grads)
            assert set(diffs) == {"vision", "llm"}
            assert max(diffs.values()) <= 1e-4, (diffs, worst)
    finally:
        loader.close()


def test_closing_the_run_leaves_nothing_running_on_either_node(run):
    _, _, trainer = run
    servers = list(trainer._fork_nodes.servers.values())
    folders = [Path(s.py_executable.split()[-1]).parent for s in servers]
    ranks = [p.pid for g in trainer.groups.values() for p in g.procs]
    launchers = [pid for pid in descendants(os.getpid()) if "forklaunch.py" in _cmdline(pid)]
    ours = [*ranks, *(s.pid for s in servers), *launchers]  # Ray's worker process of each rank: a launcher
    assert len(ranks) == 8 and len(servers) == 2 and len(launchers) >= 8 and all(map(alive, ours))
    trainer.close()
    deadline = time.monotonic() + 20
    while any(alive(pid) for pid in ours) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [pid for pid in ours if alive(pid)] == []
    left = [
        _cmdline(pid)
        for pid in descendants(os.getpid())
        if "forklaunch.py" in _cmdline(pid) or "dhp.runtime.launch.forkserver" in _cmdline(pid)
    ]
    assert left == [] and not any(f.exists() for f in folders), (left, folders)
