"""The plan space is the runtime space: every per-module combination ``dhp plan --auto`` can emit on
the 4-rank CPU cluster trains one exact step, per family; every other combination is refused by
validation.

The space: for each family's tiny recipe, each module and each world size a plan may give it (1..4
ranks: collocated or any disaggregated split), every (dp, fsdp, cp, sp, tp, ZeRO-1, SP inside TP) the
search generates (:meth:`dhp.plan.search.Search._degrees`; cp for the LLM), each under one of the AC
modes it searches (off, selective, full), assigned so that every mode meets every axis, ZeRO-1 and SP
inside TP (AC wraps each block whatever the degrees; the full product would triple the cost).

One step, per combination, on gloo ranks (one set of processes per family and world size runs all
that world's combinations in turn): the family's module through ``parallelize`` (the runtime's
entry point) on its mesh, each data-parallel replica (dp x fsdp) its own micro-batch, the encoder's
input cut by the family over SP, the LLM's hand-off rows cut to its CP rank's tokens
(``dhp.ops.context.row_parts``) and to its sequence shard under SP inside TP; forward, backward of
the runtime's loss, ``finalize_grads``, and then EVERY parameter's full
gradient is compared with the single-process module's on all replicas' micro-batches, before a
clipped optimizer step (ZeRO-1 where the plan has it) that must leave finite parameters.

What trains: every mesh of the space (each axis > 1 and its size, the expert axes and expert FSDP,
SP inside TP), ZeRO-1 on each mesh where the search emits it, and enough layouts for every AC mode to
meet every feature; the other ZeRO-1 / AC variants of those meshes (which compare the same gradients:
``finalize_grads`` never reads ``zero``, AC only recomputes) train for Qwen2.5-VL alone, in the full
suite (``[qwen2_5_vl-rest]``), so one family's whole product still trains.

Tolerance: fp32 on CPU, the parallel strategies only reorder sums: every gradient within 1e-4
relative (norm sense); the stricter per-strategy parity tests hold 1e-5.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from parallel_harness import assert_grads_match, full_grads, spawn

from dhp.config.plan_space import split_backward_refuses
from dhp.config.schema import TrainConfig
from dhp.layout import ParallelLayout
from dhp.models import get_family
from dhp.models.family import LAYOUTS
from dhp.models.testing import tiny_vl_batch
from dhp.ops.context import padded_length, rank_index, row_parts
from dhp.parallel import build_mesh, build_optimizer, clip_grads_, finalize_grads, over_pipeline, parallelize
from dhp.parallel.llm_tp import sequence_shard_rows
from dhp.parallel.pipeline import MicroBatch, run_pipeline
from dhp.plan.search import Search, apply
from dhp.validation import load_config
from dhp.validation.validate import validate

pytestmark = pytest.mark.parity

RTOL = 1e-4
RECIPES = {"qwen2_5_vl": "tiny_vlm", "qwen3_vl": "tiny_qwen3_vl", "qwen3_5": "tiny_qwen3_5"}
#: an MoE family's LLM space (ep, etp, expert FSDP beside the rest); its vision encoder is Qwen3-VL's,
#: enumerated above. Its router's load-balancing term is switched off here (a product of batch means,
#: which the per-replica reference would not sum to; its parity is held in tests/parity/test_ep*.py),
#: so both sides train on the cross-entropy alone, routed as the runtime routes
MOE = {"qwen3_vl_moe": ("tiny_qwen3_vl_moe", ("llm",))}
#: the third module: each omni family's audio encoder (DP, ZeRO-1, FSDP and its SP input cut on whole
#: attention windows); its vision encoder and LLM are the shared Qwen2.5-VL / Qwen3-VL vision and the
#: Qwen2.5 / Qwen3 MoE decoders, enumerated above
AUDIO = {"qwen2_5_omni": "tiny_qwen2_5_omni", "qwen3_omni": "tiny_qwen3_omni"}
#: mel frames of each replica's audios: several SP windows each (Qwen2.5-Omni cuts on 2 * n_window = 8
#: frames, Qwen3-Omni on n_window_infer = 200), partial last windows, and an SP rank left without any
AUDIOS = {
    "qwen2_5_omni": ([37, 12], [29], [8, 19, 6], [45]),
    "qwen3_omni": ([450, 130], [820], [260, 100, 40], [610]),
}
IMAGES = ([[(4, 8)], [(4, 4), (2, 4)]], [[(4, 4)], [(2, 4)]], [[(2, 8)], [(4, 4)]], [[(4, 4)], []])
TEXT = ([5, 3], [4, 6], [3, 7], [6, 2])


def _features(d: ParallelLayout) -> set[str]:
    axes = {a for a in ("dp", "fsdp", "cp", "sp", "tp", "ep", "etp", "pp", "pp_virtual") if getattr(d, a) > 1}
    flags = {f for f in ("zero", "sequence_parallel", "expert_fsdp") if getattr(d, f)}
    return axes | flags


def _space(recipe: str, modules: tuple[str, ...] = ()) -> dict[int, list[tuple[str, ParallelLayout, str]]]:
    """{world: [(module, degrees, ac)]}: every degree combination the search can emit on this recipe's
    cluster, each with one of the AC modes it searches, chosen so that every AC mode meets every
    feature (each axis > 1, ZeRO-1, SP inside TP) of the module at least once."""
    search = Search(load_config(recipe, []), set())
    worlds = sorted({w for key in search.placements() for w in key[1:]})
    out: dict[int, list[tuple[str, ParallelLayout, str]]] = {w: [] for w in worlds}
    for name in modules or tuple(search.cfg.modules):
        acs, seen, i = search._acs(name), set(), 0
        for w in worlds:
            for d in search._degrees(name, w):
                ok = [a for a in acs if not split_backward_refuses(d, a)]  # the search pairs these only
                new = {ac: len({(f, ac) for f in _features(d)} - seen) for ac in ok}
                ac = max(ok, key=lambda a: (new[a], a == acs[i % len(acs)]))
                seen |= {(f, ac) for f in _features(d)}
                out[w].append((name, d, ac))
                i += 1
        features = {f for w in worlds for d in search._degrees(name, w) for f in _features(d)}
        assert seen == {(f, ac) for f in features for ac in acs}, (name, sorted(seen))
    return out


def _replica_batch(hf, replica: int) -> dict:
    return tiny_vl_batch(hf, images=IMAGES[replica], text_lens=TEXT[replica], seed=replica)


def _consumer(family) -> str:
    """The module with the loss: the family's last (its producers come first)."""
    return family.module_names[-1]


def _producer_inputs(family, hf, name: str, replica: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A replica's ``(input rows, meta rows)`` of producer ``name``, in the fields its hand-off layout
    reads: the patches and grids of the replica's images, or mel frames of its audios (``AUDIOS``;
    random rows of the family's mel width, one ``(frames,)`` meta row each)."""
    (link,) = {e.layout for e in family.handoffs_for(hf) if e.producer == name}
    layout = LAYOUTS[link]
    if layout.rows_field == "audio_features":
        frames = AUDIOS[family.name][replica]
        g = torch.Generator().manual_seed(3000 + replica)
        rows = torch.randn(sum(frames), hf.audio_config.num_mel_bins, generator=g)
        return rows, torch.tensor([[f] for f in frames])
    batch = _replica_batch(hf, replica)
    return batch[layout.rows_field], batch[layout.meta_field]


def _producer_loss(out: dict, token_index: torch.Tensor, replica: int) -> torch.Tensor:
    """A fixed random linear functional of every edge's rows (so every row's gradient matters)."""
    total = torch.zeros(())
    for k in sorted(out):
        g = torch.Generator().manual_seed(1000 * replica + len(k))
        w = torch.randn(
            int(token_index.max()) + 1 if token_index.numel() else 0, out[k].shape[1], generator=g
        )
        total = total + (out[k] * w[token_index]).sum()
    return total


def _edges(family, hf, batch: dict, replica: int) -> dict[str, torch.Tensor]:
    """The LLM's hand-off leaves (random rows of every edge's width), as the runtime assembles them."""
    if batch["image_grid_thw"] is None:
        return {}
    n = sum(family.tokens_per_image(hf, batch["image_grid_thw"]))
    out = {}
    for e in family.handoffs_for(hf):
        g = torch.Generator().manual_seed(2000 * replica + len(e.kwarg))
        out[e.kwarg] = torch.randn(n, e.width, generator=g)
    return out


def _cp_rows(batch: dict, d: ParallelLayout, cp_rank: int) -> torch.Tensor:
    """Indices of the hand-off rows a CP rank receives, in its local order (``row_parts``, as the driver
    routes them)."""
    part, local = row_parts(batch["mm_token_type_ids"] != 0, cp=d.cp, multiple=d.token_multiple)
    mine = (part == cp_rank).nonzero().flatten()
    return mine[torch.argsort(local[mine])]


def _llm_loss(module, family, hf, batch, replica, total_tokens, own_rows=None, cp_rows=None) -> torch.Tensor:
    edges = _edges(family, hf, batch, replica)
    if cp_rows is not None:  # CP: only the rows of this rank's tokens arrive
        edges = {k: v[cp_rows] for k, v in edges.items()}
    if own_rows is not None:  # SP inside TP: only this rank's sequence shard's rows arrive
        edges = {k: v * own_rows.unsqueeze(1) for k, v in edges.items()}
    out = module(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        labels=batch["labels"],
        mm_token_type_ids=batch["mm_token_type_ids"],
        image_grid_thw=batch["image_grid_thw"],
        sample_ids=batch["sample_ids"],
        **edges,
    )
    return out.loss_sum / total_tokens


def _label_tokens(hf, replicas: int) -> int:
    return sum(int((_replica_batch(hf, r)["labels"][:, 1:] != -100).sum()) for r in range(replicas))


def _reference_grads(family, hf, name: str, replicas: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    ref = family.build_module(name, hf, device="cpu", dtype=torch.float32)
    ref.train()
    total = _label_tokens(hf, replicas) if name == _consumer(family) else 0
    for r in range(replicas):
        batch = _replica_batch(hf, r) if name == _consumer(family) else None
        if name != _consumer(family):
            rows, meta = _producer_inputs(family, hf, name, r)
            (shard,) = family.shard_items(name, hf, rows=rows, meta=meta, sp_size=1)
            _producer_loss(ref(**shard.forward_kwargs()), shard.token_index, r).backward()
        else:
            _llm_loss(ref, family, hf, batch, r, total).backward()
    # a parameter the forward never reads (Qwen2.5-Omni's audio_bos_eos_token) has no gradient on either side
    return {k: p.grad.detach().clone() for k, p in ref.named_parameters() if p.grad is not None}


def _one_step(family, hf, name: str, d: ParallelLayout, ac: str, refs: dict) -> None:
    """One step of the layout the search emitted, through the runtime's own mesh cut and strategies."""
    layout = d
    mesh = build_mesh(layout, "cpu")
    torch.manual_seed(0)
    module = family.build_module(name, hf, device="cpu", dtype=torch.float32)
    module.train()
    module = parallelize(
        name, module, mesh, layout=layout, activation_checkpointing=ac, mixed_precision="fp32"
    )
    coord = layout.coords(torch.distributed.get_rank())
    replica = coord["dp"] * d.fsdp + coord["fsdp"]
    if d.pp > 1:
        _pipeline_step(family, hf, module, mesh, d, ac, replica, refs)
        return
    if name != _consumer(family):
        rows, meta = _producer_inputs(family, hf, name, replica)
        shard = family.shard_items(name, hf, rows=rows, meta=meta, sp_size=d.sp)[coord["sp"]]
        loss = _producer_loss(module(**shard.forward_kwargs()), shard.token_index, replica)
    else:
        batch = _replica_batch(hf, replica)
        own, rows = None, None
        ids = batch["input_ids"]
        if d.cp > 1:  # the CP rank's tokens of the padded micro-batch, local order (as the worker)
            rows = _cp_rows(batch, d, coord["cp"])
            seq = padded_length(ids.shape[1], d.token_multiple)
            ids = torch.nn.functional.pad(ids, (0, seq - ids.shape[1]), value=-1)[
                :, rank_index(seq, d.cp, coord["cp"])
            ]
        if d.sequence_parallel:
            tokens = (hf.image_token_id, hf.video_token_id)
            own = sequence_shard_rows(ids, tokens, tp=d.tp, rank=coord["tp"]).float()
        total = _label_tokens(hf, layout.num_replicas)
        loss = _llm_loss(module, family, hf, batch, replica, total, own, rows)
    loss.backward()
    finalize_grads(module, mesh, layout=layout)
    key = (name, layout.num_replicas)
    if key not in refs:
        refs[key] = _reference_grads(family, hf, name, layout.num_replicas)
    tag = f"{family.name} {name} {d.config_values()} ac={ac}"
    got = full_grads(module)
    for k in set(got) - set(refs[key]):  # a parameter no forward reads: data parallelism zero-fills it
        assert not got[k].any(), f"{tag}: {k} has a gradient the single-process module does not"
        del got[k]
    assert_grads_match(got, refs[key], rtol=RTOL, tag=tag)
    clip_grads_(module, 0.5)
    optimizer = build_optimizer(module, mesh, layout=layout, train=TrainConfig(lr=1e-3))
    optimizer.step()
    for k, p in module.named_parameters():
        assert torch.isfinite(p.detach().to_local() if hasattr(p, "to_local") else p.detach()).all(), (
            f"{tag}: {k}"
        )


def _pipeline_step(family, hf, module, mesh, d: ParallelLayout, ac: str, replica: int, refs: dict) -> None:
    """A pipeline layout's step: replica ``r``'s pipeline trains the batches of ``pp`` reference
    replicas (``r * pp ...``), each batch's rows as micro-batches (2 x pp of them, what every schedule
    accepts), through the runtime's schedule (``run_pipeline``); the grads, merged over the stages, are
    compared with the single-process module's on those ``replicas x pp`` batches."""
    virtual = d.num_replicas * d.pp
    total = _label_tokens(hf, virtual)
    micro = []
    for v in range(replica * d.pp, (replica + 1) * d.pp):
        batch = _replica_batch(hf, v)
        edges = _edges(family, hf, batch, v)
        counts = module.placed(batch["input_ids"]).sum(dim=1).tolist()  # each row's hand-off rows
        start = 0
        for b, n in enumerate(counts):
            row = {
                k: batch[k][b : b + 1] for k in ("input_ids", "attention_mask", "labels", "mm_token_type_ids")
            }
            grids = batch["image_grid_thw"]
            per_image = [] if grids is None else family.tokens_per_image(hf, grids)
            first = sum(1 for i in range(b) for _ in IMAGES[v][i])  # this row's images in the grid list
            mine = [] if grids is None else list(range(first, first + len(IMAGES[v][b])))
            row["image_grid_thw"] = grids[mine] if mine else None
            row["sample_ids"] = [batch["sample_ids"][b]]
            assert sum(per_image[i] for i in mine) == n
            row_edges = {k: t[start : start + n] for k, t in edges.items()} if n else {
                e.kwarg: None for e in family.handoffs_for(hf)
            }  # fmt: skip
            start += n
            micro.append(MicroBatch(inputs={**row, **row_edges}, shape=tuple(row["input_ids"].shape)))
    hidden = hf.get_text_config().hidden_size
    run_pipeline(module, mesh, d, micro, rank=torch.distributed.get_rank(), hidden=hidden,
                 dtype=torch.float32, num_label_tokens=total, device=torch.device("cpu"))  # fmt: skip
    finalize_grads(module, mesh, layout=d)
    key = ("llm", virtual)
    if key not in refs:
        refs[key] = _reference_grads(family, hf, "llm", virtual)
    grads = over_pipeline(full_grads(module), mesh)
    if d.is_first_stage(torch.distributed.get_rank()):
        assert_grads_match(grads, refs[key], rtol=RTOL, tag=f"{family.name} llm {d.config_values()} ac={ac}")
    clip_grads_(module, 0.5)
    build_optimizer(module, mesh, layout=d, train=TrainConfig(lr=1e-3)).step()


def _run_world(rank: int, world: int, family_name: str, combos: list) -> None:
    family = get_family(family_name)
    hf = family.hf_config(family.tiny_model_config())
    if family_name in MOE:
        hf.text_config.router_aux_loss_coef = 0.0
    refs: dict = {}
    for name, d, ac in combos:
        _one_step(family, hf, name, d, ac, refs)


#: the family whose whole product (every ZeRO-1 / AC variant of each mesh) trains
FAST_FAMILY = "qwen2_5_vl"


def _mesh_key(name: str, d: ParallelLayout) -> tuple:
    """What cuts a module's gradient math: its module, its mesh (every axis and its size, the expert
    axes and expert FSDP included) and SP inside TP (the LLM's sequence shards). ZeRO-1 and the AC mode
    leave every compared gradient as it is (``finalize_grads`` never reads ``zero``; AC only
    recomputes)."""
    axes = ("dp", "fsdp", "cp", "sp", "tp", "ep", "etp", "pp", "pp_virtual")
    return (name, tuple(getattr(d, a) for a in axes), d.expert_fsdp, d.sequence_parallel)


def _pairs(name: str, d: ParallelLayout, ac: str) -> set:
    return {(name, f, ac) for f in _features(d)}


def _fast_part(space: dict) -> tuple[dict, dict]:
    """(fast, rest) of a space: the fast part keeps one layout per mesh key (``_mesh_key``) on each
    world, the ZeRO-1 one where the search emits both (so ZeRO-1 on that mesh still builds and steps),
    plus, smallest world first, whichever other layouts it takes for every AC mode to meet every
    feature as in the whole space; the rest (the other ZeRO-1 / AC variants of the same meshes) runs in
    the full suite."""
    keep: set = set()
    for w, combos in space.items():
        pick: dict = {}
        for i, (name, d, _) in enumerate(combos):
            k = _mesh_key(name, d)
            if k not in pick or (d.zero and not combos[pick[k]][1].zero):
                pick[k] = i
        keep |= {(w, i) for i in pick.values()}
    want = {p for w, c in space.items() for x in c for p in _pairs(*x)}
    while True:
        missing = want - {p for w, i in keep for p in _pairs(*space[w][i])}
        if not missing:
            break
        others = [(w, i) for w in sorted(space) for i in range(len(space[w])) if (w, i) not in keep]
        keep.add(max(others, key=lambda wi: (len(_pairs(*space[wi[0]][wi[1]]) & missing), -wi[0])))
    fast = {w: [x for i, x in enumerate(c) if (w, i) in keep] for w, c in space.items()}
    rest = {w: [x for i, x in enumerate(c) if (w, i) not in keep] for w, c in space.items()}
    return fast, rest


def _part(space: dict, part: str) -> dict:
    """The layouts of ``space`` a test case trains: ``"distinct"`` (``_fast_part``'s first half: every
    mesh, ZeRO-1 on each where emitted, every AC mode meeting every feature), ``"rest"`` (the other
    ZeRO-1 / AC variants of those meshes) or ``"all"``."""
    if part == "all":
        return space
    distinct, rest = _fast_part(space)
    keys = {_mesh_key(n, d) for c in space.values() for n, d, _ in c}
    assert {_mesh_key(n, d) for c in distinct.values() for n, d, _ in c} == keys  # every mesh
    assert {p for c in distinct.values() for x in c for p in _pairs(*x)} == {
        p for c in space.values() for x in c for p in _pairs(*x)
    }  # and every AC mode meets every feature there
    assert all(len(distinct[w]) + len(rest[w]) == len(space[w]) for w in space)  # nothing else left out
    return distinct if part == "distinct" else rest


def _cases(family: str) -> list:
    """Every case runs in the full suite (25 s on 2 cores for Qwen2.5-VL's meshes alone): the fast tier
    holds each strategy's own parity test and their compositions (tests/parity/test_*_parallel.py,
    test_vision_sp.py, test_deltanet_tp.py, test_ep_runtime.py, ...)."""
    if family == FAST_FAMILY:  # its meshes, then their other variants
        return [pytest.param(family, "distinct", id=f"{family}-meshes", marks=pytest.mark.slow),
                pytest.param(family, "rest", id=f"{family}-rest", marks=pytest.mark.slow)]  # fmt: skip
    return [pytest.param(family, "distinct", id=family, marks=pytest.mark.slow)]


@pytest.mark.parametrize(("family", "part"), [c for f in sorted(RECIPES) for c in _cases(f)])
def test_every_emitted_module_plan_trains_one_exact_step(family: str, part: str) -> None:
    """Every mesh of the space trains one exact step: one layout per distinct mesh of each family's
    space (``_part(..., "distinct")``: each axis and each composition of axes the search emits on
    1..4 ranks, with and without SP inside TP, ZeRO-1 on each where emitted, every AC mode meeting
    every feature), and Qwen2.5-VL's other ZeRO-1 / AC variants (``-rest``), so one family's whole
    product trains (the other families' modules differ, not the optimizer or the AC wrapping that
    the variants vary)."""
    space = _space(RECIPES[family])
    assert sum(len(c) for c in space.values()) >= 35, space  # the space is not trivially small
    assert any(d.cp > 1 for c in space.values() for name, d, _ in c if name == "llm")  # CP is searched
    for world, combos in sorted(_part(space, part).items()):
        if combos:
            spawn(_run_world, world, family, combos)


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(MOE))
def test_every_emitted_moe_llm_plan_trains_one_exact_step(family: str) -> None:
    recipe, modules = MOE[family]
    space = _space(recipe, modules)
    layouts = [d for c in space.values() for _, d, _ in c]
    for feature in ("ep", "etp", "expert_fsdp"):  # the expert axes are searched
        assert any(feature in _features(d) for d in layouts), (feature, layouts)
    for world, combos in sorted(_part(space, "distinct").items()):  # every expert mesh, as above
        if combos:
            spawn(_run_world, world, family, combos)


@pytest.mark.slow  # the fast tier holds the audio SP cut's parity (tests/parity/test_split_*omni.py)
@pytest.mark.parametrize("family", sorted(AUDIO))
def test_every_emitted_audio_plan_trains_one_exact_step(family: str) -> None:
    """The third module's space: every audio-encoder layout the search emits on 1..4 ranks (DP, ZeRO-1,
    FSDP, SP over its frames and their products, each AC mode meeting each) trains one exact step, the
    encoder's input cut by the family over SP as the runtime cuts it, against the single-process encoder
    on every replica's audios."""
    space = _space(AUDIO[family], ("audio",))
    layouts = [d for c in space.values() for _, d, _ in c]
    for feature in ("dp", "fsdp", "sp", "zero"):
        assert any(feature in _features(d) for d in layouts), (feature, layouts)
    for world, combos in sorted(space.items()):
        if combos:
            spawn(_run_world, world, family, combos)


@pytest.mark.slow  # validation's rules, not the math: the fast tier holds each rule's own test
@pytest.mark.parametrize("family", sorted(RECIPES))
def test_every_other_module_plan_is_refused_by_validation(family: str) -> None:
    """The complement: each (dp, fsdp, sp, tp, zero, sequence_parallel) on 1..4 ranks that the
    search does not generate is refused by the run config's validation (with the other module on a
    plain plan of the same size, collocated): an issue at the module's own degrees. (Batch sizes and
    lengths are the other rules' business: only the module's own keys are asserted on.)"""
    cfg = load_config(RECIPES[family], [])
    space = {(name, w, d) for w, combos in _space(RECIPES[family]).items() for name, d, _ in combos}
    refused = 0
    for w in (1, 2, 3, 4):
        for tp, sp, fsdp in itertools.product((1, 2, 4, 3), repeat=3):
            if w % (tp * sp * fsdp):
                continue
            dp = w // (tp * sp * fsdp)
            for zero, seq in itertools.product((0, 1), (False, True)):
                d = ParallelLayout(dp=dp, fsdp=fsdp, sp=sp, tp=tp, zero=zero, sequence_parallel=seq)
                for name in cfg.modules:
                    other = next(n for n in cfg.modules if n != name)
                    ov = [f"modules.{name}.gpus={w}", f"modules.{other}.gpus={w}", f"train.global_batch_size={4 * w}",
                          "train.micro_batch_size=1", "placement=collocated"]  # fmt: skip
                    ov += [
                        f"modules.{name}.parallel.{k}={str(v).lower()}" for k, v in d.config_values().items()
                    ]
                    ov += [f"modules.{other}.parallel.{k}={v}" for k, v in
                           {"dp": w, "fsdp": 1, "sp": 1, "tp": 1, "zero": 0}.items()]  # fmt: skip
                    ov += [f"modules.{other}.parallel.sequence_parallel=false"]
                    issues = validate(apply(cfg, ov))
                    mine = [
                        i
                        for i in issues
                        if i.path.startswith((f"modules.{name}.parallel", f"modules.{name}.gpus"))
                    ]
                    noop = (zero and dp * sp == 1) or (seq and tp == 1)  # the search skips these no-ops
                    if (name, w, d) in space:
                        assert not mine, (d, mine)
                    elif not noop:
                        assert mine, (
                            f"{family} {name} on {w}: {d} is outside the search's space but validates"
                        )
                        refused += 1
    assert refused >= 20
