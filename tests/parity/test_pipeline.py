"""Pipeline parallelism (``parallel.pp``) against the untouched transformers model on the whole batch.

Two gloo ranks, one pipeline of two ranks: the LLM module goes through ``parallelize`` (its ``pp``
step keeps each rank's stages only), the step's four samples run as four micro-batches through one
schedule (``dhp.parallel.pipeline.run_pipeline``), the encoder's rows are leaves whose gradients are
summed over the pipeline and fed to the encoder's backward, as the runtime does. The reference is
transformers' ``...ForConditionalGeneration`` called once on the four samples (mean CE over all their
label tokens). Cases: Qwen2.5-VL 1F1B (2 layers, one per stage), Qwen3-VL 1F1B (DeepStack features
on the stage of their layers, the other stage without them), Qwen3-VL-MoE 1F1B (the sparse layers on
the first stage, the dense one on the last), Qwen3.5 interleaved 1F1B with 2 virtual
stages per rank (4 stages, Gated DeltaNet layers on both ranks) and zero bubble on the same cut.

Tolerance (fp32): loss and every parameter's gradient within 1e-5 relative (max|got - ref| /
max|ref|); the pipeline runs the same ops in the same order as the unsplit module, so the measured
error is the chunked cross-entropy's ~1e-6. A stage that keeps another stage's layers, a schedule
that scales by the micro-batch count, or gradients of the encoder's rows not summed over the stages
fail by >= 1e-2.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from parallel_harness import spawn
from torch.distributed.device_mesh import init_device_mesh

from dhp.layout import ParallelLayout
from dhp.models import get_family
from dhp.models.testing import modules_from_reference, reference_step, relative_error, tiny_vl_batch
from dhp.ops.cross_entropy import IGNORE_INDEX
from dhp.parallel import over_pipeline, parallelize
from dhp.parallel.pipeline import MicroBatch, broadcast_stats, pipeline_group, run_pipeline
from dhp.parallel.state import full_grad_dict

pytestmark = pytest.mark.parity
RTOL = 1e-5

IMAGES = [[(8, 6)], [], [(4, 4), (6, 4)], [(4, 8)]]  # per sample: (grid_h, grid_w) of its images
TEXT = [5, 23, 3, 9]


def _micro_batches(family, hf_config, vision, batch) -> tuple[list[MicroBatch], list, int]:
    """One micro-batch per sample (the batch's rows), the encoder run on its images; the leaves."""
    rows, pix, grid = batch["input_ids"].shape[0], 0, 0
    micro, encoder = [], []
    for b in range(rows):
        n_img = len(IMAGES[b])
        inputs = {
            k: batch[k][b : b + 1] for k in ("input_ids", "attention_mask", "labels", "mm_token_type_ids")
        }
        inputs["sample_ids"] = [batch["sample_ids"][b]]
        edges: dict = {}
        if n_img:
            g = batch["image_grid_thw"][grid : grid + n_img]
            n_pix = int(g.prod(dim=1).sum())
            outs = vision(batch["pixel_values"][pix : pix + n_pix], g)
            edges = {k: t.detach().requires_grad_(True) for k, t in outs.items()}
            encoder.append((outs, edges))
            inputs["image_grid_thw"] = g
            pix, grid = pix + n_pix, grid + n_img
        else:
            inputs["image_grid_thw"] = None
            edges = dict.fromkeys(family_edge_names(vision, hf_config, batch, family))
        micro.append(MicroBatch(inputs={**inputs, **edges}, shape=tuple(inputs["input_ids"].shape)))
    labels = batch["labels"]
    return micro, encoder, int((labels[:, 1:] != IGNORE_INDEX).sum())


def family_edge_names(vision, hf_config, batch, family) -> list[str]:
    """The encoder's output keywords (what a micro-batch without images passes as None)."""
    g = batch["image_grid_thw"][:1]
    return list(vision(batch["pixel_values"][: int(g.prod())], g))


def _case(name: str, layout: ParallelLayout) -> None:
    family = get_family(name)
    hf_config = family.hf_config(family.tiny_model_config())
    if name == "qwen3_vl_moe":  # the router's term needs the runtime's statistics pass (its verify tests)
        hf_config.text_config.router_aux_loss_coef = 0.0
    torch.manual_seed(0)
    ref = family.reference_model(hf_config)
    modules = modules_from_reference(family, ref, hf_config)
    batch = tiny_vl_batch(hf_config, images=IMAGES, text_lens=TEXT, seed=3)
    ref_loss, ref_grads = reference_step(ref, batch)

    mesh = init_device_mesh("cpu", (layout.pp,), mesh_dim_names=("pp",))
    vision = modules["vision"]
    llm = parallelize(
        "llm", modules["llm"], mesh, layout, activation_checkpointing="off", mixed_precision="fp32"
    )
    rank = dist.get_rank()
    held = {n for n, _ in llm.named_parameters()}
    layers = {int(n.split(".")[2]) for n in held if n.startswith("language_model.layers.")}
    want = {i for s, lo, hi in llm.pipeline_stages for i in range(lo, hi)}
    assert layers == want and len(llm.pipeline_stages) == layout.pp_virtual, (rank, layers, want)
    assert any("embed_tokens" in n for n in held) == (rank == 0)
    assert any(n.startswith("lm_head") for n in held) == (rank == layout.pp - 1)

    micro, encoder, num_labels = _micro_batches(family, hf_config, vision, batch)
    hidden = hf_config.get_text_config().hidden_size
    run_pipeline(llm, mesh, layout, micro, rank=rank, hidden=hidden, dtype=torch.float32,
                 num_label_tokens=num_labels, device=torch.device("cpu"))  # fmt: skip
    group = pipeline_group(mesh)
    stats = broadcast_stats([m.stats for m in micro], group, src=layout.pp - 1, device=torch.device("cpu"))
    loss = torch.tensor(sum(s["loss_sum"] for s in stats) / num_labels)
    for outs, leaves in encoder:  # each stage's part of the rows' gradient, summed, into the encoder
        grads = []
        for k in outs:
            g = leaves[k].grad if leaves[k].grad is not None else torch.zeros_like(leaves[k])
            dist.all_reduce(g, group=group)
            grads.append(g)
        torch.autograd.backward([outs[k] for k in outs], grads)
    got = {"llm": over_pipeline(full_grad_dict(llm), mesh), "vision": full_grad_dict(vision)}
    if rank != 0:
        return
    tag = f"{name} {layout.pp_schedule} pp={layout.pp} v={layout.pp_virtual}"
    assert relative_error(loss, ref_loss) <= RTOL, (tag, loss.item(), ref_loss.item())
    mapped = {family.checkpoint_owner(n): n for n in ref_grads}
    have = {(m, n) for m, g in got.items() for n in g}
    assert have == set(mapped), f"{tag}: params with grads differ: {sorted(have ^ set(mapped))[:6]}"
    worst = max((relative_error(got[m][n], ref_grads[mapped[(m, n)]]), f"{m}.{n}") for m, n in have)
    assert worst[0] <= RTOL, f"{tag}: worst relative grad error {worst}"


def _cases(rank: int, world: int) -> None:
    _case("qwen2_5_vl", ParallelLayout(pp=2))
    _case("qwen3_vl", ParallelLayout(pp=2))
    _case("qwen3_vl_moe", ParallelLayout(pp=2))  # the last stage holds the dense layer 2 only
    _case("qwen3_5", ParallelLayout(pp=2, pp_virtual=2, pp_schedule="interleaved_1f1b"))
    _case("qwen3_5", ParallelLayout(pp=2, pp_virtual=2, pp_schedule="zero_bubble"))


def test_pipeline_matches_the_unsplit_model() -> None:
    spawn(_cases, 2)
