"""A dhp checkpoint of the three Qwen2.5-Omni modules -> HF directory (``dhp.checkpoint.export``):
transformers' ``Qwen2_5OmniThinkerForConditionalGeneration.from_pretrained`` loads it with every tensor
and the logits of an audio + image batch bit-equal to the model the modules came from (fp32)."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from omni_batch import omni_batch
from transformers import Qwen2_5OmniThinkerForConditionalGeneration

from dhp.checkpoint import (
    CheckpointMeta,
    ModuleRecord,
    begin_checkpoint,
    commit_checkpoint,
    save_module_state,
)
from dhp.checkpoint.export import export_hf
from dhp.models import get_family

pytestmark = [pytest.mark.parity, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]


def test_export_of_the_three_modules_loads_in_transformers_with_equal_logits(tmp_path: Path) -> None:
    family = get_family("qwen2_5_omni")
    model_cfg = family.tiny_model_config()
    hf_config = family.hf_config(model_cfg)
    torch.manual_seed(0)
    ref = family.reference_model(hf_config)
    parts = family.split_state_dict(ref.state_dict())
    tmp = begin_checkpoint(tmp_path / "ckpts", step=3)
    for name in family.module_names:
        module = family.build_module(name, hf_config, device="cpu", dtype=torch.float32)
        module.load_state_dict(parts[name], strict=True)
        save_module_state(tmp / name, model=module, optimizer=torch.optim.AdamW(module.parameters()))
    meta = CheckpointMeta(
        step=3,
        data_state={},
        driver_rng={},
        plan={"groups": []},
        config_hash="c",
        model_hash="m",
        modules={n: ModuleRecord(1, False, True) for n in family.module_names},
    )
    ckpt = commit_checkpoint(tmp, meta=meta, keep_last=1)
    out = export_hf(ckpt, out_dir=tmp_path / "hf", model=model_cfg, max_shard_bytes=512 * 1024)
    assert len(list(out.glob("model-*.safetensors"))) > 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = Qwen2_5OmniThinkerForConditionalGeneration.from_pretrained(str(out), dtype=torch.float32)
    want = ref.state_dict()
    got = loaded.state_dict()
    assert set(got) == set(want)
    assert not [k for k in want if not torch.equal(got[k], want[k])]
    records = [[("text", 3), ("image", (4, 4)), ("audio", 41)], [("text", 6), ("audio", 17)]]
    batch = omni_batch(hf_config, records, seeds=[1, 2])["hf"]
    with torch.no_grad():
        assert torch.equal(loaded(**batch).logits, ref(**batch).logits)
