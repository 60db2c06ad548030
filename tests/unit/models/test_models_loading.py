"""Per-module weight loading from a local HF directory: only own tensors, exact outputs, clear errors."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import Qwen2_5_VLForConditionalGeneration

from dhp.errors import CheckpointError
from dhp.models import build_and_load, checkpoint_index, get_family, load_module_weights
from dhp.models.testing import reference_step, split_step, tiny_vl_batch

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def family():
    return get_family("qwen2_5_vl")


@pytest.mark.parametrize("which", ["tiny_dir", "tiny_sharded_dir"])
def test_each_module_reads_only_its_tensors_and_matches_from_pretrained(family, which, request):
    model_dir = request.getfixturevalue(which)
    index = checkpoint_index(model_dir)
    if which == "tiny_sharded_dir":
        assert len(set(index.values())) >= 3  # really sharded
    hf_config = family.hf_config_from_dir(model_dir)
    vision, rv = build_and_load(
        family, "vision", model_dir, hf_config=hf_config, dtype=torch.float32, device="cpu"
    )
    llm, rl = build_and_load(family, "llm", model_dir, hf_config=hf_config, dtype=torch.float32, device="cpu")
    assert all(family.checkpoint_owner(k)[0] == "vision" for k in rv.keys_read)
    assert all(family.checkpoint_owner(k)[0] == "llm" for k in rl.keys_read)
    assert not set(rv.keys_read) & set(rl.keys_read)
    assert set(rv.keys_read) | set(rl.keys_read) == set(index)  # together: the whole checkpoint
    assert set(rv.files_opened) == {index[k] for k in rv.keys_read}  # no file without own tensors

    ref = Qwen2_5_VLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32)
    parts = family.split_state_dict(ref.state_dict())
    for name, module in (("vision", vision), ("llm", llm)):
        state = module.state_dict()
        assert all(torch.equal(state[k], v) for k, v in parts[name].items())
        for (bn, buf), (_, ref_buf) in zip(
            module.named_buffers(),
            getattr(ref.model, "visual" if name == "vision" else "language_model").named_buffers(),
            strict=True,
        ):
            assert torch.equal(buf, ref_buf), bn  # non-persistent rotary buffers recomputed, not garbage

    batch = tiny_vl_batch(hf_config, images=[[(8, 6)], [(4, 4)]], text_lens=[4, 6])
    ref_loss, _ = reference_step(ref, batch)
    loss, _ = split_step(family, vision, llm, batch)
    # the same weights and ops up to the loss; the chunked CE (dhp.ops) sums in another order: ~1e-7
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)


def test_new_key_layout_loads_too(family, tiny_dir, tmp_path):
    """transformers 5 saves the hub's older layout; the new one (model.visual.*, model.language_model.*) works too."""
    ref = Qwen2_5_VLForConditionalGeneration.from_pretrained(tiny_dir, dtype=torch.float32)
    shutil.copy(tiny_dir / "config.json", tmp_path / "config.json")
    state = {k: v.contiguous() for k, v in ref.state_dict().items()}
    assert any(k.startswith("model.language_model.") for k in state)
    save_file(state, str(tmp_path / "model.safetensors"))
    hf_config = family.hf_config_from_dir(tmp_path)
    llm, report = build_and_load(
        family, "llm", tmp_path, hf_config=hf_config, dtype=torch.float32, device="cpu"
    )
    assert torch.equal(llm.lm_head.weight, ref.lm_head.weight)
    assert all(k.startswith(("model.language_model.", "lm_head.")) for k in report.keys_read)


def test_dtype_comes_from_the_caller_config(family, tiny_dir):
    hf_config = family.hf_config_from_dir(tiny_dir)
    vision, _ = build_and_load(
        family, "vision", tiny_dir, hf_config=hf_config, dtype=torch.bfloat16, device="cpu"
    )
    assert {p.dtype for p in vision.parameters()} == {torch.bfloat16}
    with safe_open(str(tiny_dir / "model.safetensors"), framework="pt") as f:
        expected = f.get_tensor("visual.patch_embed.proj.weight").to(torch.bfloat16)
    assert torch.equal(vision.visual.patch_embed.proj.weight, expected)


def _rewrite(src, dst, edit):
    shutil.copy(src / "config.json", dst / "config.json")
    with safe_open(str(src / "model.safetensors"), framework="pt") as f:
        state = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
    edit(state)
    save_file(state, str(dst / "model.safetensors"))


def test_missing_and_unexpected_keys_are_listed(family, tiny_dir, tmp_path):
    def edit(state):
        del state["visual.blocks.1.attn.qkv.weight"]
        state["visual.blocks.1.attn.extra.weight"] = torch.zeros(2)

    _rewrite(tiny_dir, tmp_path, edit)
    hf_config = family.hf_config_from_dir(tmp_path)
    with pytest.raises(CheckpointError) as err:
        build_and_load(family, "vision", tmp_path, hf_config=hf_config, dtype=torch.float32, device="cpu")
    msg = str(err.value)
    assert "missing keys (1): ['visual.blocks.1.attn.qkv.weight']" in msg
    assert "unexpected keys (1): ['visual.blocks.1.attn.extra.weight']" in msg
    # the LLM does not own those keys, so it still loads
    build_and_load(family, "llm", tmp_path, hf_config=hf_config, dtype=torch.float32, device="cpu")


def test_keys_of_no_module_and_wrong_shapes_are_errors(family, tiny_dir, tmp_path):
    hf_config = family.hf_config_from_dir(tiny_dir)
    (tmp_path / "a").mkdir()
    _rewrite(tiny_dir, tmp_path / "a", lambda s: s.update({"audio_tower.w": torch.zeros(1)}))
    with pytest.raises(CheckpointError, match=r"belong to no module of qwen2_5_vl: \['audio_tower.w'\]"):
        build_and_load(family, "llm", tmp_path / "a", hf_config=hf_config, dtype=torch.float32, device="cpu")
    (tmp_path / "b").mkdir()
    _rewrite(tiny_dir, tmp_path / "b", lambda s: s.update({"lm_head.weight": torch.zeros(3, 3)}))
    with pytest.raises(CheckpointError, match=r"lm_head.weight has shape \(3, 3\)"):
        build_and_load(family, "llm", tmp_path / "b", hf_config=hf_config, dtype=torch.float32, device="cpu")


def test_directory_without_weights_or_with_broken_index(family, tiny_sharded_dir, tmp_path):
    with pytest.raises(CheckpointError, match=r"neither model\.safetensors nor"):
        checkpoint_index(tmp_path)
    index = json.loads((tiny_sharded_dir / "model.safetensors.index.json").read_text())
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="shard files that do not exist"):
        checkpoint_index(tmp_path)
    with pytest.raises(CheckpointError, match=r"config\.json not found"):
        family.hf_config_from_dir(tmp_path)


def test_shard_fn_reads_only_a_slice(family, tiny_sharded_dir):
    """The TP hook: each parameter is filled with the slice shard_fn takes from the lazy file slice."""
    hf_config = family.hf_config_from_dir(tiny_sharded_dir)
    module = family.build_module("llm", hf_config, device="meta", dtype=torch.float32)
    # a stand-in for a TP rank: keep the first half of q_proj's rows (the module holds only that many)
    q = module.language_model.layers[0].self_attn.q_proj
    q.weight = torch.nn.Parameter(torch.empty(q.out_features // 2, q.in_features, device="meta"))
    seen = {}

    def shard_fn(fqn, param, full):
        seen[fqn] = tuple(full.get_shape())
        if fqn == "language_model.layers.0.self_attn.q_proj.weight":
            return full[: param.shape[0]]
        return full[:]

    load_module_weights(
        module,
        tiny_sharded_dir,
        family=family,
        module_name="llm",
        hf_config=hf_config,
        dtype=torch.float32,
        device="cpu",
        shard_fn=shard_fn,
    )
    ref = Qwen2_5_VLForConditionalGeneration.from_pretrained(tiny_sharded_dir, dtype=torch.float32)
    full_q = ref.model.language_model.layers[0].self_attn.q_proj.weight
    assert torch.equal(q.weight, full_q[: full_q.shape[0] // 2])
    assert seen["language_model.layers.0.self_attn.q_proj.weight"] == tuple(full_q.shape)
    assert set(seen) == set(module.state_dict())


def test_text_only_qwen2_checkpoint_is_an_llm_only_graph(family, tmp_path):
    """A plain Qwen2 LLM directory loads as the ``llm`` module alone and matches Qwen2ForCausalLM exactly."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=0,
        eos_token_id=1,
    )
    torch.manual_seed(0)
    ref = Qwen2ForCausalLM(cfg)
    ref.save_pretrained(tmp_path)
    hf_config = family.hf_config_from_dir(tmp_path)
    assert family.modules_for(hf_config) == ("llm",)
    llm, report = build_and_load(
        family, "llm", tmp_path, hf_config=hf_config, dtype=torch.float32, device="cpu"
    )
    assert set(report.keys_read) == set(checkpoint_index(tmp_path))
    ids = torch.randint(2, 256, (2, 20), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 15:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    expected = ref(input_ids=ids, attention_mask=mask, labels=labels).loss
    out = llm(input_ids=ids, attention_mask=mask, labels=labels, mm_token_type_ids=None)
    # the chunked CE (dhp.ops) sums in another order than HF's loss: ~1e-7 relative
    torch.testing.assert_close(out.loss_sum / out.num_tokens, expected, rtol=1e-6, atol=0)
