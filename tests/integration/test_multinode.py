"""dhp on a simulated 2-node Ray cluster (``ray.cluster_utils.Cluster``: a head and a worker node,
each a raylet with its own 2 CPUs standing in for its 2 GPUs; ``cluster.nodes=2
cluster.gpus_per_node=2`` on CPU).

Plan: vision Ulysses SP=4 over all 4 slots (one SP group spanning both nodes) collocated with LLM
TP=2 x DP=2 (each TP group on one node, the DP replicas on different nodes). Checked:
- the plan puts every LLM TP group inside one node and lets the vision SP group and the LLM DP
  replicas span the nodes; the runtime's actors run exactly there (each actor's Ray node id);
- two training steps across the nodes equal the single-process transformers model: the loss within
  1e-5 relative and every parameter's gradient within 1e-4 absolute (fp32; the plans differ only in
  reduction order, observed ~1e-7), the tolerances of ``dhp verify``.
"""

from __future__ import annotations

import pytest
import ray

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


def test_training_across_two_nodes_matches_the_single_process_model(cluster):
    from dhp.data import build_run_loader
    from dhp.plan import compile_plan
    from dhp.plan.compile import module_layouts
    from dhp.runtime import Trainer
    from dhp.runtime.verify import ReferenceModel, compare_grads
    from dhp.validation import load_config

    cfg = load_config("tiny_vlm", [*TWO_NODES, "train.steps=2", "train.warmup_steps=0"])
    plan = compile_plan(cfg)
    loader = build_run_loader(cfg, module_layouts(cfg))
    nodes = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"])
    assert len(nodes) == 2
    trainer = Trainer(cfg, plan)
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
        trainer.close()
        loader.close()
