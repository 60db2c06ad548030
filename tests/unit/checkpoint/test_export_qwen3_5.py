"""DCP checkpoint of the Qwen3.5 modules -> HF directory: transformers loads it and gives equal logits.

One process, fp32 on CPU. The two modules (vision without DeepStack, the hybrid llm) are saved as dhp
checkpoints, exported with ``dhp.checkpoint.export.export_hf``, and loaded with
``Qwen3_5ForConditionalGeneration.from_pretrained``. Every tensor must round-trip bit-exactly (the Gated
DeltaNet's conv1d, dt_bias, A_log and gated norm included), and the loaded model's logits must equal
the logits the module graph computes (vision -> image_embeds -> llm): same weights, same ops, so the
tolerance is fp32 reordering only (1e-5 relative).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from transformers import Qwen3_5ForConditionalGeneration

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
    """Logits of the module graph: the LLM module's own embed / positions, its text model, lm_head."""
    outs = vision(batch["pixel_values"], batch["image_grid_thw"])
    assert set(outs) == {"image_embeds"}
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
    hidden = llm.language_model(
        inputs_embeds=embeds, attention_mask=batch["attention_mask"], position_ids=positions, use_cache=False
    ).last_hidden_state
    return llm.lm_head(hidden)


def test_qwen3_5_export_loads_in_transformers_with_equal_logits(tmp_path: Path) -> None:
    family = get_family("qwen3_5")
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
        loaded = Qwen3_5ForConditionalGeneration.from_pretrained(str(out), dtype=torch.float32).eval()
    assert loaded.config.text_config.layer_types == hf_config.text_config.layer_types
    split = family.split_state_dict(loaded.state_dict())
    for name, m in mods.items():
        sd = m.state_dict()
        assert set(sd) == set(split[name])
        assert all(torch.equal(sd[k], split[name][k]) for k in sd), name
    assert any(k.endswith("linear_attn.A_log") for k in split["llm"])

    batch = tiny_vl_batch(hf_config, images=[[(8, 6), (4, 4)], [(6, 10)]], text_lens=[4, 7], seed=5)
    kwargs = {k: v for k, v in batch.items() if k not in ("sample_ids", "labels")}
    with torch.no_grad():
        ref = loaded(**kwargs).logits
        got = _split_logits(mods["vision"].eval(), mods["llm"].eval(), batch)
    mask = batch["attention_mask"].bool()
    assert relative_error(got[mask], ref[mask]) <= RTOL
