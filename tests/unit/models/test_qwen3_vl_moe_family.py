"""Qwen3-VL's MoE flavour (``model.family: qwen3_vl_moe``, the Qwen3-VL family held to it): published
numbers, arch validation, total / active / expert counts vs the real modules, the typed MoE architecture,
TP plan coverage, key maps and a tiny HF directory."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from dhp.config.issues import Issues
from dhp.errors import CheckpointError, ConfigError
from dhp.models import get_arch, get_family
from dhp.models.qwen3_vl.arch import ARCH
from dhp.parallel.llm_tp import VocabParallelEmbedding

pytestmark = pytest.mark.unit
CONF = Path(__file__).resolve().parents[3] / "conf" / "model"

# The released config.json numbers (see the YAML headers): (text hidden, layers, heads, kv heads,
# head_dim, dense intermediate, vocab, experts, top-k, moe_intermediate, out_hidden)
PUBLISHED = {
    "qwen3_vl_30b_a3b": (2048, 48, 32, 4, 128, 6144, 151936, 128, 8, 768, 2048),
    "qwen3_vl_235b_a22b": (4096, 94, 64, 4, 128, 12288, 151936, 128, 8, 1536, 4096),
}
# (total, active) parameters of the whole model and of the LLM alone, as the counts give them
TOTALS = {
    "qwen3_vl_30b_a3b": ((31_070_754_032, 3_891_664_112), (30_532_122_624, 3_353_032_704)),
    "qwen3_vl_235b_a22b": ((235_670_022_896, 22_767_151_856), (235_093_634_560, 22_190_763_520)),
}


@pytest.fixture(scope="module")
def family():
    return get_family("qwen3_vl_moe")


def _yaml(name: str):
    return OmegaConf.load(CONF / f"{name}.yaml")


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_qwen3_vl_moe_published_numbers(family, name):
    cfg = family.hf_config(_yaml(name))
    t, v = cfg.text_config, cfg.vision_config
    got = (
        t.hidden_size, t.num_hidden_layers, t.num_attention_heads, t.num_key_value_heads, t.head_dim,
        t.intermediate_size, t.vocab_size, t.num_experts, t.num_experts_per_tok, t.moe_intermediate_size,
        v.out_hidden_size,
    )  # fmt: skip
    assert got == PUBLISHED[name]
    vision = (
        v.depth,
        v.hidden_size,
        v.num_heads,
        v.intermediate_size,
        v.patch_size,
        v.num_position_embeddings,
    )
    assert vision == (27, 1152, 16, 4304, 16, 2304) and list(v.deepstack_visual_indexes) == [8, 16, 24]
    assert t.decoder_sparse_step == 1 and t.mlp_only_layers == [] and t.router_aux_loss_coef == 0.001
    assert t.rope_parameters["mrope_section"] == [24, 20, 20] and t.rope_parameters["rope_theta"] == 5e6
    assert t.max_position_embeddings == 262144 and not cfg.tie_word_embeddings
    assert cfg.image_token_id == 151655 and cfg.model_type == "qwen3_vl_moe"


@pytest.mark.parametrize("name", list(TOTALS))
def test_qwen3_vl_moe_total_and_active_parameters(name):
    """~31B / 3.9B (LLM 30.5B / 3.35B: "30B-A3B") and ~236B / 22.8B (LLM 235B / 22.2B: "235B-A22B")."""
    model = _yaml(name)
    arch = get_arch("qwen3_vl_moe")
    typed = arch.architecture(model)
    total = sum(m.params.total for m in typed.modules.values())
    active = sum(m.active_params for m in typed.modules.values())
    llm = typed.modules["llm"]
    assert ((total, active), (llm.params.total, llm.active_params)) == TOTALS[name]
    # experts are split by EP, whole on every TP rank; everything else as a dense model
    p = llm.params
    assert p.per_rank(tp=2, ep=8) == p.tp_sharded / 2 + p.replicated + p.expert / 8
    assert p.per_tp_rank(4) == p.per_rank(tp=4, ep=1)
    assert p.expert / p.total > 0.94  # the experts are almost the whole LLM


def test_qwen3_vl_moe_tiny_yaml_is_the_tiny_config(family):
    from_yaml = family.hf_config(_yaml("tiny_qwen3_vl_moe")).to_dict()
    assert from_yaml == family.tiny_hf_config().to_dict()
    t = family.tiny_hf_config().text_config
    assert 2 * t.moe_intermediate_size != t.hidden_size  # a transposed expert tensor has another shape
    assert t.num_experts_per_tok > 1 and t.mlp_only_layers == [2]


def _meta_counts(family, cfg, name):
    """(total, one block, largest tensor, expert params, params matched by a TP glob) of the real module."""
    module = family.build_module(name, cfg, device="meta", dtype=torch.bfloat16)
    params = dict(module.named_parameters())
    blocks = module.visual.blocks if name == "vision" else module.language_model.layers
    block = max(sum(p.numel() for p in b.parameters()) for b in blocks)
    experts = sum(p.numel() for n, p in params.items() if ".mlp.experts." in n)
    styles = module.parallel_plan.tp(False)
    globs = {re.compile(re.escape(g).replace(r"\*", r"[^.]+") + "$"): style for g, style in styles.items()}

    def sharded_by_tp(fqn: str) -> bool:  # a row-parallel Linear's bias is whole on every TP rank
        owner, _, leaf = fqn.rpartition(".")
        style = next((s for g, s in globs.items() if g.match(owner)), None)
        return isinstance(style, (ColwiseParallel, RowwiseParallel, VocabParallelEmbedding)) and not (
            leaf == "bias" and isinstance(style, RowwiseParallel)
        )

    sharded = sum(p.numel() for n, p in params.items() if sharded_by_tp(n))
    sizes = [p.numel() for p in params.values()]
    return sum(sizes), block, max(sizes), experts, sharded


@pytest.mark.parametrize("which", ["tiny", "tiny_tied", "qwen3_vl_30b_a3b"])
def test_qwen3_vl_moe_counts_match_the_modules(family, which):
    """Total, per block, largest tensor and the TP-sharded / replicated / expert split, vs modules built on
    meta by transformers (the split read from the family's own TP plan and expert FQNs)."""
    if which.startswith("tiny"):
        cfg = family.tiny_hf_config(tie_word_embeddings=which == "tiny_tied")
        model_cfg = None
    else:
        model_cfg = _yaml(which)
        model_cfg.attn_implementation = "sdpa"  # the YAML's flash_attention_2 is not installed on CPU
        cfg = family.hf_config(model_cfg)
    typed = ARCH.architecture_of(ARCH.numbers_from_hf(cfg)).modules
    for name in family.module_names:
        total, block, biggest, experts, sharded = _meta_counts(family, cfg, name)
        counts = typed[name].params
        assert (counts.total, counts.expert, counts.tp_sharded) == (total, experts, sharded), name
        assert typed[name].block_params.total == block, name
        assert typed[name].largest_param == biggest, name
        if model_cfg is not None:  # the planner reads the schema's numbers
            planned = get_arch("qwen3_vl_moe").architecture(model_cfg).modules[name]
            assert (planned.params, planned.largest_param) == (counts, biggest)
    t = cfg.text_config
    sparse = sum(1 for i in range(t.num_hidden_layers) if i not in t.mlp_only_layers)
    per_expert = 3 * t.moe_intermediate_size * t.hidden_size
    llm = typed["llm"]
    assert (
        llm.active_params == llm.params.total - sparse * (t.num_experts - t.num_experts_per_tok) * per_expert
    )


def test_qwen3_vl_moe_typed_architecture():
    arch = get_arch("qwen3_vl_moe")
    tiny = arch.architecture(_yaml("tiny_qwen3_vl_moe"))
    llm, vision = tiny.modules["llm"], tiny.modules["vision"]
    assert [b.mlp.kind for b in llm.blocks] == ["moe", "moe", "dense"]  # mlp_only_layers: [2]
    moe = llm.blocks[0].mlp
    assert (moe.experts, moe.top_k, moe.intermediate, moe.shared, moe.active) == (8, 2, 48, 0, 96)
    assert llm.blocks[2].mlp.intermediate == 128 and llm.layer_shape().mlp == 128  # the widest: dense
    assert vision.outputs == llm.inputs == ("image_embeds", "deepstack_embeds_0", "deepstack_embeds_1")
    big = arch.architecture(_yaml("qwen3_vl_30b_a3b")).modules["llm"]
    assert {b.mlp.kind for b in big.blocks} == {"moe"} and big.layers == 48
    assert big.layer_shape().mlp == 8 * 768 and big.tp_input_grads == 3  # experts are not TP-sharded
    assert big.largest_param == 128 * 2 * 768 * 2048  # one layer's gate_up_proj
    axes = arch.module_axes("llm", _yaml("qwen3_vl_30b_a3b"))
    assert "model.llm.intermediate_size" not in axes.tp_divides  # no dense layer to shard
    assert not axes.sp and not axes.tp_sequence_parallel


def test_qwen3_vl_moe_bad_arch_numbers_are_config_errors(family):
    bad = _yaml("tiny_qwen3_vl_moe")
    bad.llm.extra.num_experts_per_tok = 9
    bad.llm.extra.mlp_only_layers = [3]
    bad.llm.extra.norm_topk_prob = False
    bad.llm.extra.router_aux_loss_coef = -0.1
    bad.vision.extra.deepstack_visual_indexes = [0, 3]
    issues = Issues()
    get_arch("qwen3_vl_moe").validate(bad, issues)
    assert {i.path for i in issues.items} == {
        "model.llm.extra.num_experts_per_tok",
        "model.llm.extra.mlp_only_layers",
        "model.llm.extra.norm_topk_prob",
        "model.llm.extra.router_aux_loss_coef",
        "model.vision.extra.deepstack_visual_indexes",
    }
    dense = _yaml("tiny_qwen3_vl_moe")
    dense.llm.extra.mlp_only_layers = [0, 1, 2]
    with pytest.raises(ConfigError, match="no decoder layer is sparse"):
        family.hf_config(dense)
    missing = _yaml("tiny_qwen3_vl_moe")
    del missing.llm.extra.num_experts
    with pytest.raises(ConfigError, match=r"model\.llm\.extra.*missing \['num_experts'\]"):
        family.hf_config(missing)
    typo = _yaml("tiny_qwen3_vl_moe")
    typo.llm.extra.num_experts = "eight"
    with pytest.raises(ConfigError, match=r"num_experts.*must be a positive integer"):
        family.hf_config(typo)
    named = _yaml("tiny_qwen3_vl")  # the dense numbers under the MoE flavour's name: its keys are missing
    named.family = "qwen3_vl_moe"
    with pytest.raises(ConfigError, match=r"qwen3_vl_moe needs exactly .*missing \['num_experts'"):
        family.hf_config(named)


def test_qwen3_vl_moe_checkpoint_keys_round_trip(family, tmp_path):
    cfg = family.tiny_hf_config()
    with torch.device("meta"):
        ref = family.reference_model(cfg)
    keys = list(ref.state_dict())
    assert "model.language_model.layers.0.mlp.experts.gate_up_proj" in keys
    assert "model.language_model.layers.1.mlp.gate.weight" in keys
    for key in keys:
        module, fqn = family.checkpoint_owner(key)
        assert family.hf_key(module, fqn) == key
    assert family.checkpoint_owner("language_model.layers.0.mlp.gate.weight") is None
    with pytest.raises(CheckpointError, match="belong to no qwen3_vl_moe module"):
        family.split_state_dict({"visual.pos_embed.weight": torch.zeros(1)})
    cfg.save_pretrained(tmp_path)
    assert family.hf_config_from_dir(tmp_path).to_dict() == cfg.to_dict()
    raw = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, "model_type": "qwen3_vl"}))
    with pytest.raises(CheckpointError, match="not a qwen3_vl_moe model"):
        family.hf_config_from_dir(tmp_path)


def test_qwen3_vl_moe_parallel_plans(family):
    """Every nn.Linear matches exactly one TP glob; the router and the 3-D experts match none (they are
    split by EP, declared as the plan's moe_blocks with the expert count)."""
    cfg = family.tiny_hf_config()
    for name in family.module_names:
        module = family.build_module(name, cfg, device="meta", dtype=torch.float32)
        plan = module.parallel_plan
        globs = [g for g in plan.tp(False) if not g.endswith("embed_tokens")]
        patterns = [re.compile(re.escape(g).replace(r"\*", r"[^.]+") + "$") for g in globs]
        for fqn, sub in module.named_modules():
            hits = [g for g, p in zip(globs, patterns, strict=True) if p.match(fqn)]
            if isinstance(sub, torch.nn.Linear):
                assert len(hits) == 1, (fqn, hits)
            if fqn.endswith((".mlp.gate", ".mlp.experts")):
                assert hits == [], (fqn, hits)
        assert all(any(p.match(fqn) for fqn, _ in module.named_modules()) for p in patterns), name
    llm = family.parallel_plan("llm", cfg)
    assert (llm.moe_blocks, llm.experts, llm.tp_sequence_parallel) == (
        "language_model.layers.*.mlp",
        8,
        False,
    )
    assert "model.llm.intermediate_size" in llm.tp_divides  # the tiny model's dense layer 2 is TP-sharded
    assert family.parallel_plan("vision", cfg).sp[0].modules == "visual.blocks.*.attn"
    edges = family.handoffs_for(cfg)
    assert [e.kwarg for e in edges] == ["image_embeds", "deepstack_embeds_0", "deepstack_embeds_1"]


def test_qwen3_vl_moe_model_dir_loads_per_module(family, tmp_path):
    """A tiny Qwen3-VL-MoE HF directory: config and per-module loading (only that module's keys, the
    3-D experts whole) agree with the family and with transformers' own load of the directory."""
    from transformers import AutoTokenizer, Qwen3VLMoeForConditionalGeneration

    from dhp.models.loading import build_and_load
    from dhp.models.tiny import make_tiny_checkpoint

    out = make_tiny_checkpoint(tmp_path / "tiny", family="qwen3_vl_moe")
    cfg = family.hf_config_from_dir(out)
    assert ARCH.numbers_from_hf(cfg) == ARCH.numbers_from_hf(family.tiny_hf_config())
    ref = Qwen3VLMoeForConditionalGeneration.from_pretrained(str(out), dtype=torch.float32)
    split = family.split_state_dict(ref.state_dict())
    for name in family.module_names:
        module, report = build_and_load(family, name, out, hf_config=cfg, dtype=torch.float32, device="cpu")
        assert {family.checkpoint_owner(k)[0] for k in report.keys_read} == {name}
        assert all(torch.equal(t, split[name][k]) for k, t in module.state_dict().items()), name
    tok = AutoTokenizer.from_pretrained(str(out))
    assert {k: tok.convert_tokens_to_ids(s) for k, s in family.token_strings().items()} == {
        k: getattr(family.tiny_model_config().tokens, k) for k in family.token_strings()
    }


def test_qwen3_vl_moe_loads_the_released_expert_layout(family, tmp_path):
    """A checkpoint with the released (transposed) expert layout loads into the module's [E, 2I, H] /
    [E, H, I] tensors, equal to transformers' own load of the same directory."""
    from transformers import Qwen3VLMoeForConditionalGeneration

    from dhp.models.loading import build_and_load
    from dhp.models.testing import released_expert_layout
    from dhp.models.tiny import make_tiny_checkpoint

    out = make_tiny_checkpoint(tmp_path / "tiny", family="qwen3_vl_moe")
    t = family.tiny_hf_config().text_config
    shapes = released_expert_layout(out)
    e, h, i = t.num_experts, t.hidden_size, t.moe_intermediate_size
    assert set(shapes.values()) == {(e, h, 2 * i), (e, i, h)} and len(shapes) == 4
    cfg = family.hf_config_from_dir(out)
    module, _ = build_and_load(family, "llm", out, hf_config=cfg, dtype=torch.float32, device="cpu")
    ref = Qwen3VLMoeForConditionalGeneration.from_pretrained(str(out), dtype=torch.float32)  # transposes too
    want = family.split_state_dict(ref.state_dict())["llm"]
    got = module.state_dict()
    assert got["language_model.layers.0.mlp.experts.gate_up_proj"].shape == (e, 2 * i, h)
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert family.stored_dims("language_model.layers.0.mlp.gate.weight", (h, e), (e, h)) is None
