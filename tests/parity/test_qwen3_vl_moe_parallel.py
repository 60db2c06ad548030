"""The Qwen3-VL-MoE family's LLM module, parallelized by its own plan on 2 gloo ranks, against transformers.

One spawn of 2 ranks; each rank builds the single-process reference itself (same seed, same skewed
routers as ``test_split_qwen3_vl_moe``), runs the encoder locally (its outputs enter the LLM as leaves,
as the runtime's hand-off does) and compares the LLM against ``Qwen3VLMoeForConditionalGeneration``
(``output_router_logits=True``) on the whole batch:

(a) tp=2: the family's TP plan (attention and the dense layer 2 sharded; routers and experts whole on
    both ranks, which see the same tokens); the loss is ``loss_sum / num_tokens``;
(b) dp=2 x ep=2 with ``aux_loss_group`` = the two data ranks: each rank feeds one sample and holds 4 of
    the 8 experts; the step's loss is ``sum_r loss_sum_r / T`` (T the global label count), which must be
    HF's loss INCLUDING the load-balancing loss of the concatenated batch (not a mean of per-rank
    ones: checked directly, the per-rank value differs by far more than the tolerance); the aux loss
    each rank reports is the global one;
(c) loading as the runtime does with model.path (build on meta, parallelize with dp=2 x ep=2, then
    ``load_module_weights``) from a tiny directory in the released expert layout ([E, H, 2I] on disk):
    each EP rank's expert shards equal its rows of transformers' own load of that directory.
Gradients go through dhp's finalize (DP sums, expert shards) and are gathered whole.

Tolerances (fp32 on CPU; only summation order differs): loss and aux loss <= 1e-5 relative; every LLM
parameter's gradient (routers and experts included) <= 1e-4 relative (max|d| / max|ref|).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from parallel_harness import spawn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from dhp.layout import ParallelLayout
from dhp.models import get_family
from dhp.models.qwen3_base.llm import ROUTER_AUX_LOSS
from dhp.models.testing import modules_from_reference, relative_error, skew_routers_, tiny_vl_batch
from dhp.parallel import finalize_grads, full_grad_dict, parallelize
from dhp.parallel.ep import expert_params

pytestmark = pytest.mark.parity
LOSS_RTOL, GRAD_RTOL = 1e-5, 1e-4
FIELDS = ("input_ids", "attention_mask", "labels", "mm_token_type_ids")


def _setup():
    family = get_family("qwen3_vl_moe")
    cfg = family.tiny_hf_config()
    torch.manual_seed(0)
    ref = family.reference_model(cfg)
    skew_routers_(dict(ref.named_parameters()), cfg.text_config.hidden_size)
    batch = tiny_vl_batch(cfg, images=[[(8, 6), (4, 4)], [(6, 10)]], text_lens=[5, 9], seed=4)
    ref.zero_grad(set_to_none=True)
    out = ref(**{k: v for k, v in batch.items() if k != "sample_ids"}, output_router_logits=True)
    out.loss.backward()
    want = family.split_state_dict({n: p.grad for n, p in ref.named_parameters()})["llm"]
    return family, cfg, ref, batch, out, want


IMAGES_OF = {0: [0, 1], 1: [2]}  # the batch's images, sample after sample (tiny_vl_batch's layout)


def _sample(cfg, batch, b: int) -> dict:
    """Sample ``b`` of the batch alone: its row, its images' patch rows and grids."""
    merge = cfg.vision_config.spatial_merge_size**2
    per_image = [int(g.prod()) for g in batch["image_grid_thw"]]
    starts = [sum(per_image[:i]) for i in range(len(per_image) + 1)]
    rows = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in IMAGES_OF[b]])
    one = {k: batch[k][b : b + 1] for k in FIELDS}
    assert int(one["mm_token_type_ids"].sum()) == len(rows) // merge  # its image tokens, its images
    one["pixel_values"] = batch["pixel_values"][rows]
    one["image_grid_thw"] = batch["image_grid_thw"][IMAGES_OF[b]]
    one["sample_ids"] = [batch["sample_ids"][b]]
    return one


def _llm_inputs(vision, part: dict) -> dict:
    """The LLM's keyword arguments: the batch fields and the encoder's edges, run locally (leaves)."""
    with torch.no_grad():
        edges = vision(part["pixel_values"], part["image_grid_thw"])
    return {
        **{k: part[k] for k in FIELDS},
        "image_grid_thw": part["image_grid_thw"],
        "sample_ids": part["sample_ids"],
        **edges,
    }


def _llm_step(vision, llm, part: dict, *, num_label_tokens: int):
    """LLM forward on ``part`` and backward of ``loss_sum / T``; returns the LLM output."""
    out = llm(**_llm_inputs(vision, part))
    (out.loss_sum / num_label_tokens).backward()
    return out


def _compare_grads(llm, want: dict, tag: str) -> None:
    grads = full_grad_dict(llm)
    assert set(grads) == set(want), set(grads) ^ set(want)
    errors = {n: relative_error(grads[n], want[n]) for n in want}
    worst = max(errors, key=errors.get)
    assert errors[worst] <= GRAD_RTOL, f"{tag}: worst relative grad error {errors[worst]:.2e} at {worst}"


def _tp_case(family, cfg, ref, batch, ref_out, want) -> None:
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    modules = modules_from_reference(family, ref, cfg)
    llm = modules["llm"]
    parallelize(
        "llm",
        llm,
        mesh,
        layout=ParallelLayout(tp=2),
        activation_checkpointing="off",
        mixed_precision="fp32",
    )
    assert not isinstance(llm.language_model.layers[0].mlp.experts.gate_up_proj, DTensor)  # whole per rank
    assert isinstance(
        llm.language_model.layers[2].mlp.gate_proj.weight, DTensor
    )  # the dense layer is sharded
    out = _llm_step(
        modules["vision"], llm, batch, num_label_tokens=int((batch["labels"][:, 1:] != -100).sum())
    )
    finalize_grads(llm, mesh, layout=ParallelLayout(tp=2))
    assert relative_error(out.loss_sum / out.num_tokens, ref_out.loss) <= LOSS_RTOL
    _compare_grads(llm, want, "tp=2")


def _dp_ep_case(rank, family, cfg, ref, batch, ref_out, want) -> None:
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    parallel = ParallelLayout(dp=2, ep=2)
    modules = modules_from_reference(family, ref, cfg)
    llm = modules["llm"]
    parallelize("llm", llm, mesh, layout=parallel, activation_checkpointing="off", mixed_precision="fp32")
    assert len(expert_params(llm)) == 4  # 2 sparse layers x (gate_up_proj, down_proj), 4 experts each here
    llm.aux_loss_group = mesh.get_group("dp")
    total = int((batch["labels"][:, 1:] != -100).sum())
    out = _llm_step(modules["vision"], llm, _sample(cfg, batch, rank), num_label_tokens=total)
    finalize_grads(llm, mesh, layout=parallel)
    loss = (out.loss_sum / total).detach()
    dist.all_reduce(loss)
    assert relative_error(loss, ref_out.loss) <= LOSS_RTOL, (loss.item(), ref_out.loss.item())
    assert relative_error(out.aux_losses[ROUTER_AUX_LOSS], ref_out.aux_loss) <= LOSS_RTOL
    _compare_grads(llm, want, "dp=2 x ep=2")

    # without the group each rank's aux loss is its own sample's: not HF's on the whole batch
    llm.aux_loss_group = None
    with torch.no_grad():
        alone = llm(**_llm_inputs(modules["vision"], _sample(cfg, batch, rank)))
    aux = alone.aux_losses[ROUTER_AUX_LOSS].clone()
    dist.all_reduce(aux)
    assert relative_error(aux / 2, ref_out.aux_loss) > 100 * LOSS_RTOL


def _load_case(rank: int, family, root: str) -> None:
    """EP shards on meta, then each rank reads its expert rows from the released (transposed) layout."""
    from transformers import Qwen3VLMoeForConditionalGeneration

    from dhp.models.loading import load_module_weights
    from dhp.models.testing import released_expert_layout
    from dhp.models.tiny import make_tiny_checkpoint

    out = Path(root, "tiny")
    if rank == 0:
        released_expert_layout(make_tiny_checkpoint(out, family="qwen3_vl_moe", seed=3))
    dist.barrier()
    cfg = family.hf_config_from_dir(out)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    llm = family.build_module("llm", cfg, device="meta", dtype=torch.float32)
    parallelize("llm", llm, mesh, layout=ParallelLayout(dp=2, ep=2), activation_checkpointing="off",
                mixed_precision="fp32")  # fmt: skip
    load_module_weights(
        llm, out, family=family, module_name="llm", hf_config=cfg, dtype=torch.float32, device="cpu"
    )
    want = family.split_state_dict(
        Qwen3VLMoeForConditionalGeneration.from_pretrained(str(out), dtype=torch.float32).state_dict()
    )["llm"]
    experts = dict(expert_params(llm))
    assert len(experts) == 4
    for name, p in experts.items():
        rows = want[name].shape[0] // 2
        assert torch.equal(p.to_local(), want[name][rank * rows : (rank + 1) * rows]), name
    dense = {n: p for n, p in llm.named_parameters() if n not in experts}
    assert all(torch.equal(p.detach(), want[n]) for n, p in dense.items())


def _cases(rank: int, world: int, root: str) -> None:
    family, cfg, ref, batch, ref_out, want = _setup()
    _tp_case(family, cfg, ref, batch, ref_out, want)
    _dp_ep_case(rank, family, cfg, ref, batch, ref_out, want)
    _load_case(rank, family, root)


def test_qwen3_vl_moe_llm_tp2_and_dp2_ep2_match_hf(tmp_path):
    spawn(_cases, 2, str(tmp_path))
