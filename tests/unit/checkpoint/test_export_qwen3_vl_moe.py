"""DCP checkpoint of the Qwen3-VL-MoE modules -> HF directory: transformers loads it and gives equal logits.

One process, fp32 on CPU. The two modules (vision with its DeepStack mergers, the MoE llm) are saved as
dhp checkpoints, exported with ``dhp.checkpoint.export.export_hf``, and loaded with
``Qwen3VLMoeForConditionalGeneration.from_pretrained``. The experts are exported as the full 3-D
tensors of the released layout (``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I]; the tiny model
has 2I != H, so a transposed tensor could not load). Every tensor must round-trip bit-exactly, and the
loaded model's logits must equal the logits the module graph computes (vision -> 1 + K edges -> llm):
same weights, same ops, so the tolerance is fp32 reordering only (1e-5 relative, measured ~1e-7).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import Qwen3VLMoeForConditionalGeneration

from dhp.checkpoint import (
    CheckpointMeta,
    ModuleRecord,
    begin_checkpoint,
    commit_checkpoint,
    save_module_state,
)
from dhp.checkpoint.export import export_hf
from dhp.models import get_family
from dhp.models.testing import relative_error, tiny_vl_batch

pytestmark = [pytest.mark.unit, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]
RTOL = 1e-5


def _split_logits(vision, llm, batch) -> torch.Tensor:
    """Logits of the module graph: the LLM module's own embed/positions, DeepStack edges, lm_head."""
    outs = vision(batch["pixel_values"], batch["image_grid_thw"])
    embeds = llm.embed(
        input_ids=batch["input_ids"],
        mm_token_type_ids=batch["mm_token_type_ids"],
        image_grid_thw=batch["image_grid_thw"],
        image_embeds=outs["image_embeds"],
        sample_ids=batch["sample_ids"],
    )
    positions = llm.positions(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        mm_token_type_ids=batch["mm_token_type_ids"],
        image_grid_thw=batch["image_grid_thw"],
    )
    deepstack = llm.deepstack_list(
        outs["image_embeds"], {k: v for k, v in outs.items() if k != "image_embeds"}, batch["sample_ids"]
    )
    hidden = llm.language_model(
        inputs_embeds=embeds,
        attention_mask=batch["attention_mask"],
        position_ids=positions,
        visual_pos_masks=batch["input_ids"] == llm.vl_config.image_token_id,
        deepstack_visual_embeds=deepstack,
        use_cache=False,
    ).last_hidden_state
    return llm.lm_head(hidden)


def test_qwen3_vl_moe_export_loads_in_transformers_with_equal_logits(tmp_path: Path) -> None:
    family = get_family("qwen3_vl_moe")
    model_cfg = family.tiny_model_config()
    hf_config = family.hf_config(model_cfg)
    torch.manual_seed(0)
    mods = {
        n: family.build_module(n, hf_config, device="cpu", dtype=torch.float32) for n in family.module_names
    }
    tmp = begin_checkpoint(tmp_path / "ckpts", step=3)
    for name, m in mods.items():
        save_module_state(tmp / name, model=m, optimizer=torch.optim.AdamW(m.parameters()))
    meta = CheckpointMeta(
        step=3,
        data_state={},
        driver_rng={},
        plan={"groups": []},
        config_hash="c",
        model_hash="m",
        modules={"vision": ModuleRecord(1, False, True), "llm": ModuleRecord(1, False, True)},
    )
    ckpt = commit_checkpoint(tmp, meta=meta, keep_last=1)
    out = export_hf(ckpt, out_dir=tmp_path / "hf", model=model_cfg, max_shard_bytes=512 * 1024)
    assert len(list(out.glob("model-*.safetensors"))) > 1

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = Qwen3VLMoeForConditionalGeneration.from_pretrained(str(out), dtype=torch.float32).eval()
    split = family.split_state_dict(loaded.state_dict())
    for name, m in mods.items():
        sd = m.state_dict()
        assert set(sd) == set(split[name])
        assert all(torch.equal(sd[k], split[name][k]) for k in sd), name
    assert any(k.startswith("visual.deepstack_merger_list.") for k in split["vision"])
    t = hf_config.text_config
    experts = {"gate_up_proj": (t.num_experts, 2 * t.moe_intermediate_size, t.hidden_size)}
    experts["down_proj"] = (t.num_experts, t.hidden_size, t.moe_intermediate_size)
    shapes = {}
    for f in out.glob("model-*.safetensors"):
        with safe_open(str(f), framework="pt") as st:
            names = st.keys()  # a safetensors handle, not a dict
            shapes |= {k: tuple(st.get_slice(k).get_shape()) for k in names if ".mlp.experts." in k}
    assert shapes == {
        f"model.language_model.layers.{i}.mlp.experts.{p}": shape
        for i in range(t.num_hidden_layers)
        if i not in t.mlp_only_layers
        for p, shape in experts.items()
    }

    batch = tiny_vl_batch(hf_config, images=[[(8, 6), (4, 4)], [(6, 10)]], text_lens=[4, 7], seed=5)
    kwargs = {k: v for k, v in batch.items() if k not in ("sample_ids", "labels")}
    with torch.no_grad():
        ref = loaded(**kwargs).logits
        got = _split_logits(mods["vision"].eval(), mods["llm"].eval(), batch)
    mask = batch["attention_mask"].bool()
    assert relative_error(got[mask], ref[mask]) <= RTOL
