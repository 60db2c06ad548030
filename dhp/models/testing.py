"""Helpers for parity tests across layers: tiny VL batches and the split step vs the reference.

``tiny_vl_batch`` makes a micro-batch with the fields of ``dhp.data.batch.VLBatch`` (as a dict)
for a given image layout, with random pixels of the right patch shape. ``reference_step`` and
``split_step`` run forward + backward on the untouched transformers model and on the two modules
(vision -> embeds leaf -> llm, then the embeds gradient back into vision) and return the loss and
every parameter's gradient keyed by checkpoint-style reference names. ``released_expert_layout``
rewrites a tiny MoE directory's experts as released checkpoints store them (loader tests).
``skew_routers_`` makes a tiny MoE model route decisively and unevenly, so a load-balancing loss is far
above rounding.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import PretrainedConfig

from dhp.models.checks import image_token_counts
from dhp.models.common import init_rotary_buffers, tie_parameters
from dhp.models.family import ModelFamily
from dhp.ops.cross_entropy import IGNORE_INDEX


def tiny_vl_batch(
    hf_config: PretrainedConfig,
    *,
    images: list[list[tuple[int, int]]],
    text_lens: list[int],
    seed: int = 0,
) -> dict[str, object]:
    """One right-padded micro-batch. ``images[b]`` lists sample b's images as (grid_h, grid_w) in patches.

    Sample b reads: ``text_lens[b]`` text tokens, then each image as
    ``<|vision_start|> <|image_pad|>*n <|vision_end|>`` followed by 3 text tokens. Labels are the
    ids except image/vision/pad tokens (-100). Pixel rows: grid_h*grid_w per image (t = 1).
    """
    gen = torch.Generator().manual_seed(seed)
    merge = hf_config.vision_config.spatial_merge_size
    vocab = hf_config.text_config.vocab_size
    rows, grids = [], []
    for b, sample_images in enumerate(images):
        ids = torch.randint(20, vocab, (text_lens[b],), generator=gen).tolist()
        for h, w in sample_images:
            grids.append([1, h, w])
            n = image_token_counts(torch.tensor([[1, h, w]]), merge)[0]
            ids += [hf_config.vision_start_token_id] + [hf_config.image_token_id] * n
            ids += [hf_config.vision_end_token_id, *torch.randint(20, vocab, (3,), generator=gen).tolist()]
        rows.append(ids)
    seq = max(len(r) for r in rows)
    pad = hf_config.text_config.pad_token_id
    input_ids = torch.full((len(rows), seq), pad, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), seq), dtype=torch.long)
    for b, r in enumerate(rows):
        input_ids[b, : len(r)] = torch.tensor(r)
        attention_mask[b, : len(r)] = 1
    special = (input_ids == hf_config.image_token_id) | (input_ids == hf_config.vision_start_token_id)
    special |= input_ids == hf_config.vision_end_token_id
    labels = input_ids.masked_fill(special | (attention_mask == 0), IGNORE_INDEX)
    v = hf_config.vision_config
    width = v.in_channels * v.temporal_patch_size * v.patch_size**2
    grid = torch.tensor(grids, dtype=torch.long) if grids else None
    n_patches = int(grid.prod(-1).sum()) if grids else 0
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "labels": labels,
        "mm_token_type_ids": (input_ids == hf_config.image_token_id).long(),
        "pixel_values": torch.randn(n_patches, width, generator=gen) if grids else None,
        "image_grid_thw": grid,
        "sample_ids": [f"synthetic:{seed}:{b}" for b in range(len(rows))],
    }


def reference_step(ref: nn.Module, batch: dict[str, object]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """HF mean loss and ``{reference_param_name: grad}`` of the untouched model (grads zeroed first)."""
    ref.zero_grad(set_to_none=True)
    kwargs = {k: v for k, v in batch.items() if k != "sample_ids" and v is not None}
    loss = ref(**kwargs).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}


def split_step(
    family: ModelFamily, vision: nn.Module | None, llm: nn.Module, batch: dict[str, object]
) -> tuple[torch.Tensor, dict[str, dict[str, torch.Tensor]]]:
    """loss_sum/num_tokens and ``{module: {fqn: grad}}`` through the cut, as the runtime runs it.

    The encoder output is detached into a leaf, the LLM backpropagates ``loss_sum / num_tokens``,
    and the leaf's gradient is fed to the encoder's backward. Text-only batches skip the encoder.
    """
    for m in (vision, llm):
        if m is not None:
            m.zero_grad(set_to_none=True)
    outs: dict[str, torch.Tensor] = {}
    leaves: dict[str, torch.Tensor] = {}
    if batch["pixel_values"] is not None:  # every edge of the producer: a leaf that collects its grad
        outs = vision(batch["pixel_values"], batch["image_grid_thw"])
        leaves = {k: t.detach().requires_grad_(True) for k, t in outs.items()}
    out = llm(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        labels=batch["labels"],
        mm_token_type_ids=batch["mm_token_type_ids"],
        image_grid_thw=batch["image_grid_thw"],
        sample_ids=batch["sample_ids"],
        **leaves,
    )
    loss = out.loss_sum / out.num_tokens
    loss.backward()
    if outs:
        torch.autograd.backward(
            [outs[k] for k in outs],
            [leaves[k].grad if leaves[k].grad is not None else torch.zeros_like(leaves[k]) for k in outs],
        )
    grads = {"llm": {n: p.grad for n, p in llm.named_parameters() if p.grad is not None}}
    if vision is not None:
        grads["vision"] = {n: p.grad for n, p in vision.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def modules_from_reference(
    family: ModelFamily, ref: nn.Module, hf_config: PretrainedConfig, *, device: str = "cpu"
) -> dict[str, nn.Module]:
    """Build each module on meta and copy the reference's weights into it (strict): ``{name: module}``."""
    parts = family.split_state_dict(ref.state_dict())
    modules = {}
    for name in [n for n in family.module_names if parts[n]]:  # a text-only reference has no vision
        module = family.build_module(name, hf_config, device="meta", dtype=hf_config.dtype)
        module.to_empty(device=device)
        tied = family.tied_parameters(name, hf_config)
        module.load_state_dict({k: v for k, v in parts[name].items() if k not in tied}, strict=not tied)
        tie_parameters(module, tied)
        init_rotary_buffers(family.name, name, module)
        modules[name] = module
    return modules


def relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """max|got - ref| / max|ref| (0 when both are all zeros)."""
    scale = ref.abs().max().item()
    diff = (got - ref).abs().max().item()
    return diff / scale if scale > 0 else diff


def released_expert_layout(out_dir: str | Path) -> dict[str, tuple[int, ...]]:
    """Rewrite a directory's fused expert tensors (``*.mlp.experts.*``) in the layout the released
    Qwen3-VL-MoE checkpoints store (``gate_up_proj`` [E, H, 2I], ``down_proj`` [E, I, H], as
    transformers 4.57 wrote them; transformers 5 and dhp hold [E, 2I, H] / [E, H, I]), in place;
    returns ``{key: new shape}``. For loader tests."""
    shapes = {}
    for f in sorted(Path(out_dir).glob("*.safetensors")):
        tensors = load_file(str(f))
        for key in [k for k in tensors if ".mlp.experts." in k]:
            tensors[key] = tensors[key].transpose(1, 2).contiguous()
            shapes[key] = tuple(tensors[key].shape)
        save_file(tensors, str(f), metadata={"format": "pt"})
    return shapes


#: the routers of the Qwen3-style MoE layers (``...layers.<i>.mlp.gate.weight``, [E, H]) and the token
#: embeddings, by key suffix, in a reference model's (checkpoint) names
ROUTER_SUFFIX, EMBED_SUFFIX = ".mlp.gate.weight", "language_model.embed_tokens.weight"


def skew_routers_(tensors: Mapping[str, torch.Tensor], hidden_size: int, *, seed: int = 7) -> int:
    """Make routing decisive and unequal, in place: every token embedding gets a common direction ``u``,
    every router is scaled x 20 and experts 0 and 1 are pulled towards ``u`` (so most tokens pick them).
    ``tensors``: the reference's parameters or checkpoint tensors by name; returns the routers changed."""
    gen = torch.Generator().manual_seed(seed)
    u = torch.randn(hidden_size, generator=gen)
    u /= u.norm()
    routers = 0
    with torch.no_grad():
        for key, t in tensors.items():
            if key.endswith(EMBED_SUFFIX):
                t.add_(0.1 * u.to(t.dtype))
            elif key.endswith(ROUTER_SUFFIX):
                t.mul_(20.0)
                t[0] += 0.5 * u.to(t.dtype)
                t[1] += 0.3 * u.to(t.dtype)
                routers += 1
    return routers
