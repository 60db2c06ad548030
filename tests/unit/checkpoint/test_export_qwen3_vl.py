"""DCP checkpoint of the Qwen3-VL modules -> HF directory: transformers loads it and gives equal logits.

One process, fp32 on CPU. The two modules (vision with its DeepStack mergers, llm) are saved as dhp
checkpoints, exported with ``dhp.checkpoint.export.export_hf``, and loaded with
``Qwen3VLForConditionalGeneration.from_pretrained``. Every tensor must round-trip bit-exactly, and the
loaded model's logits must equal the logits the module graph computes (vision -> 1 + K edges -> llm):
same weights, same ops, so the tolerance is fp32 reordering only (1e-5 relative, measured ~1e-7).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from transformers import Qwen3VLForConditionalGeneration

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


def test_qwen3_vl_export_loads_in_transformers_with_equal_logits(tmp_path: Path) -> None:
    family = get_family("qwen3_vl")
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
        loaded = Qwen3VLForConditionalGeneration.from_pretrained(str(out), dtype=torch.float32).eval()
    split = family.split_state_dict(loaded.state_dict())
    for name, m in mods.items():
        sd = m.state_dict()
        assert set(sd) == set(split[name])
        assert all(torch.equal(sd[k], split[name][k]) for k in sd), name
    assert any(k.startswith("visual.deepstack_merger_list.") for k in split["vision"])

    batch = tiny_vl_batch(hf_config, images=[[(8, 6), (4, 4)], [(6, 10)]], text_lens=[4, 7], seed=5)
    kwargs = {k: v for k, v in batch.items() if k not in ("sample_ids", "labels")}
    with torch.no_grad():
        ref = loaded(**kwargs).logits
        got = _split_logits(mods["vision"].eval(), mods["llm"].eval(), batch)
    mask = batch["attention_mask"].bool()
    assert relative_error(got[mask], ref[mask]) <= RTOL
