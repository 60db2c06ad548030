"""Malformed configs: each one raises ConfigError naming the key path, and all problems come at once."""

from __future__ import annotations

import json

import pytest

from dhp.errors import ConfigError
from dhp.validation import load_config

pytestmark = pytest.mark.unit

# (recipe, overrides, key path that must be named, words the rule must contain)
MALFORMED = [
    ("qwen_vl_32b", ["modules.vision.gpus=4"], "modules.vision.gpus", "dp*fsdp*cp*sp*tp"),
    (
        "qwen_vl_32b",
        [
            "modules.vision.parallel.sp=3",
            "modules.vision.gpus=3",
            "modules.llm.gpus=3",
            "modules.llm.parallel.tp=1",
            "modules.llm.parallel.dp=3",
            "train.global_batch_size=3",
        ],
        "modules.vision.parallel.sp",
        "model.vision.num_heads",
    ),
    (
        "qwen_vl_32b",
        [
            "modules.llm.parallel.tp=16",
            "modules.llm.gpus=16",
            "modules.vision.gpus=16",
            "modules.vision.parallel.sp=16",
        ],
        "modules.llm.parallel.tp",
        "inside one node",
    ),
    (
        "qwen_vl_7b",
        ["modules.llm.parallel.tp=8", "modules.llm.parallel.dp=1"],
        "modules.llm.parallel.tp",
        "num_kv_heads",
    ),
    (
        "qwen_vl_32b",
        ["model.llm.num_heads=20", "model.llm.num_kv_heads=4"],
        "modules.llm.parallel.tp",
        "num_kv_heads",
    ),
    ("qwen_vl_32b", ["model.llm.vocab_size=152065"], "modules.llm.parallel.tp", "vocab_size"),
    (
        "qwen_vl_32b",
        ["model.llm.num_heads=36", "model.llm.hidden_size=4608", "model.llm.num_kv_heads=6"],
        "modules.llm.parallel.tp",
        "num_heads",
    ),
    ("qwen_vl_32b", ["cluster=h200_1x"], "cluster", "cluster has"),
    ("qwen_vl_32b", ["placement=disaggregated"], "cluster", "need 16 GPUs"),
    ("qwen_vl_32b", ["modules.llm.gpus=4", "modules.llm.parallel.tp=4"], "placement", "share one GPU set"),
    ("qwen_vl_32b", ["modules.vision.seq_len=0"], "modules.vision.seq_len", "> 0"),
    ("qwen_vl_32b", ["modules.llm.seq_len=-5"], "modules.llm.seq_len", "> 0"),
    ("qwen_vl_32b", ["train.micro_batch_size=0"], "train.micro_batch_size", "> 0"),
    ("qwen_vl_32b", ["model.attn_implementation=flash3"], "model.attn_implementation", "unknown value"),
    ("qwen_vl_32b", ["placement=spread"], "placement", "must be collocated, disaggregated or a partition"),
    ("qwen_vl_32b", ["handoff=nccl"], "handoff", "unknown value"),
    ("qwen_vl_32b", ["handoff=object_store"], "handoff", "through host memory"),
    ("qwen_vl_32b", ["handoff=p2p"], "handoff", "disjoint GPUs"),
    ("tiny_vlm", ["handoff=cuda_ipc"], "handoff", "cuda_ipc needs cluster.device=cuda"),
    ("qwen_vl_32b", ["modules.vision.mixed_precision=fp8"], "modules.vision.mixed_precision", "unknown"),
    (
        "qwen_vl_32b",
        ["modules.vision.freeze=true", "modules.vision.mixed_precision=bf16_master_fp32"],
        "modules.vision.mixed_precision",
        "no master weights",
    ),
    (
        "qwen_vl_32b",
        ["model.attn_implementation=flash_attention_2", "modules.llm.mixed_precision=fp32"],
        "modules.llm.mixed_precision",
        "bf16/fp16 only",
    ),
    ("qwen_vl_32b", ["~model"], "model", "no model selected"),
    ("qwen_vl_32b", ["train.warmup_steps=50", "train.steps=10"], "train.warmup_steps", "train.steps=10"),
    (
        "qwen_vl_32b",
        [
            "train.global_batch_size=7",
            "modules.vision.parallel.sp=4",
            "modules.vision.parallel.dp=2",
            "modules.llm.parallel.tp=4",
            "modules.llm.parallel.dp=2",
        ],
        "train.global_batch_size",
        "multiple of",
    ),
    ("tiny_vlm", ["model.attn_implementation=flash_attention_2"], "model.attn_implementation", "needs CUDA"),
    (
        "qwen_vl_32b",
        ["modules.vision.parallel.tp=2", "modules.vision.parallel.sp=4"],
        "modules.vision.parallel",
        "mutually exclusive",
    ),
    (
        "qwen_vl_32b",
        ["modules.llm.parallel.sp=2", "modules.llm.parallel.tp=4"],
        "modules.llm.parallel.sp",
        "does not support sp",
    ),
    ("qwen_vl_32b", ["modules.vision.parallel.zero=2"], "modules.vision.parallel.zero", "ZeRO-1"),
    ("qwen_vl_32b_zero3", ["modules.llm.parallel.zero=1"], "modules.llm.parallel.zero", "FSDP"),
    ("qwen_vl_32b", ["modules.vision.parallel.dp=0"], "modules.vision.parallel.dp", ">= 1"),
    ("qwen_vl_32b", ["cluster.device_memory_gib=0"], "cluster.device_memory_gib", "> 0"),
    ("qwen_vl_32b", ["cluster.device=tpu"], "cluster.device", "unknown value"),
    ("qwen_vl_32b", ["model.family=llava"], "model.family", "unknown value"),
    (
        "qwen_vl_32b",
        ["model.vision.extra.fullatt_block_indexes=[7,15,23,40]"],
        "model.vision.extra.fullatt_block_indexes",
        "outside",
    ),
    (
        "qwen_vl_32b",
        ["model.llm.extra.mrope_section=[16,24,16]"],
        "model.llm.extra.mrope_section",
        "head_dim/2",
    ),
    ("qwen_vl_32b", ["data.kind=llava"], "data.datasets", "at least one dataset"),
    ("tiny_vlm", ["data=demo", "data.max_pixels=200704"], "modules.vision.seq_len", "data.max_pixels"),
    ("qwen_vl_32b", ["data.kind=webdataset"], "data.kind", "unknown value"),
    ("qwen_vl_32b", ["data.synthetic.patches=5000"], "modules.vision.seq_len", "patches"),
    ("qwen_vl_32b", ["train.betas=[0.9]"], "train.betas", "two numbers"),
    (
        "qwen_vl_32b",
        ["modules.vision.freeze=true", "modules.llm.freeze=true"],
        "modules",
        "nothing would train",
    ),
    ("qwen_vl_32b", ["data.min_pixels=1000000"], "data.min_pixels", "max_pixels"),
    ("qwen_vl_32b", ["modules.vision.seq_len=16386"], "modules.vision.seq_len", "spatial_merge_size^2"),
    ("qwen_vl_32b", ["~modules.llm"], "modules.llm", "the model has the modules vision, llm"),
    ("qwen_vl_32b", ["+modules.audio.gpus=8"], "modules.audio", ""),  # Hydra cannot add a typed dict entry
]


@pytest.mark.parametrize(
    ("recipe", "overrides", "path", "words"), MALFORMED, ids=[f"{i}-{m[2]}" for i, m in enumerate(MALFORMED)]
)
def test_malformed_config_names_key_path(recipe: str, overrides: list[str], path: str, words: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(recipe, overrides)
    matching = [i for i in info.value.issues if i.path == path]
    assert matching, f"no issue at {path}: {info.value}"
    assert any(words in i.rule for i in matching), f"rule lacks {words!r}: {matching}"
    assert all(i.fix for i in info.value.issues)


def test_malformed_cases_are_many() -> None:
    assert len(MALFORMED) >= 20


def test_all_problems_reported_in_one_pass() -> None:
    overrides = [
        "modules.vision.parallel.sp=3",  # 16 encoder heads % 3 and gpus 8 != 3
        "modules.llm.parallel.tp=16",  # larger than a node; 40 heads % 16; 8 kv heads % 16
        "train.warmup_steps=500",
        "modules.llm.seq_len=0",
    ]
    with pytest.raises(ConfigError) as info:
        load_config("qwen_vl_32b", overrides)
    paths = [i.path for i in info.value.issues]
    assert paths.count("modules.llm.parallel.tp") >= 3  # node, heads, kv heads
    for path in (
        "modules.vision.gpus",
        "modules.vision.parallel.sp",
        "train.warmup_steps",
        "modules.llm.seq_len",
    ):
        assert path in paths
    assert f"{len(info.value.issues)} config error(s)" in str(info.value)


def test_issue_carries_value_and_fix() -> None:
    with pytest.raises(ConfigError) as info:
        load_config("qwen_vl_7b", ["modules.llm.parallel.tp=8", "modules.llm.parallel.dp=1"])
    issue = next(i for i in info.value.issues if "num_kv_heads" in i.rule)
    assert issue.value == 8
    assert "divisors of 4" in issue.fix


@pytest.mark.parametrize(
    ("conf", "overrides", "path"),
    [
        ("qwen_vl_32b", ["modules.vision.parallel.spp=4"], "modules.vision.parallel.spp"),
        ("qwen_vl_32b", ["modules.vision.parallel.sp=abc"], "modules.vision.parallel.sp"),
        ("qwen_vl_32b", ["model=qwen_vl_99b"], "model"),
        ("qwen_vl_32b", ["cluster=moon_base"], "cluster"),
        ("qwen_vl_32b", ["modules.vision.parallel=="], "modules.vision.parallel"),
        ("qwen_vl_32b", ["+foo=1"], "foo"),  # Hydra's + appends even in struct mode
        ("qwen_vl_32b", ["+modules.vision.parallel.ulysses=8"], "modules.vision.parallel.ulysses"),
        ("qwen_vl_32b", ["+train.lr_scheduler=cosine"], "train.lr_scheduler"),
        ("no_such_recipe", [], "conf"),
        ("/nonexistent/run.yaml", [], "conf"),
    ],
)
def test_hydra_errors_become_config_errors(conf: str, overrides: list[str], path: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(conf, overrides)
    assert [i.path for i in info.value.issues] == [path], str(info.value)


def test_unknown_key_in_user_yaml(tmp_path) -> None:
    user = tmp_path / "mine.yaml"
    user.write_text(
        "defaults:\n  - /model: tiny\n  - /cluster: local_cpu\n  - _self_\nname: mine\n"
        "modules:\n  vision: {gpus: 1}\n  llm: {gpus: 1, sequence_length: 4}\n"
    )
    with pytest.raises(ConfigError) as info:
        load_config(str(user), [])
    assert info.value.issues[0].path == "modules.llm.sequence_length"


def test_unknown_module_name_in_user_yaml(tmp_path) -> None:
    user = tmp_path / "three.yaml"
    user.write_text(
        "defaults:\n  - /model: tiny\n  - /cluster: local_cpu\n  - /parallel: sp2_tp2\n  - _self_\n"
        "name: three\nmodules:\n  audio: {gpus: 2}\n"
    )
    with pytest.raises(ConfigError) as info:
        load_config(str(user), [])
    issue = next(i for i in info.value.issues if i.path == "modules.audio")
    assert "unknown module" in issue.rule


def test_token_ids_inside_vocab() -> None:
    with pytest.raises(ConfigError) as info:
        load_config("tiny_vlm", ["model.tokens.image_token_id=151655"])
    assert [i.path for i in info.value.issues] == ["model.tokens.image_token_id"]


def test_model_path_checked_against_config_json(tmp_path) -> None:
    from dhp.models.tiny import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint(tmp_path / "tiny")
    assert load_config("tiny_vlm", [f"model.path={ckpt}"]).model.path == str(ckpt)
    with pytest.raises(ConfigError) as info:
        load_config(
            "tiny_vlm",
            [
                f"model.path={ckpt}",
                "model.llm.hidden_size=64",
                "model.llm.extra.mrope_section=[1,1,2]",
                "model.vision.depth=5",
                "model.vision.extra.fullatt_block_indexes=[1]",
            ],
        )
    # the family's own numbers (extra) are compared too, under the name config.json gives them
    assert sorted(i.path for i in info.value.issues) == [
        "model.llm.hidden_size",
        "model.vision.depth",
        "model.vision.extra.fullatt_block_indexes",
    ]
    with pytest.raises(ConfigError) as info:
        load_config("tiny_vlm", [f"model.path={tmp_path / 'missing'}"])
    assert [i.path for i in info.value.issues] == ["model.path"]


def test_model_path_holds_what_a_run_reads(tmp_path) -> None:
    """Beside config.json: the weights, the tokenizer with a chat template and, for real data, the
    image processor; each missing part is its own issue, all at once."""
    from dhp.models.tiny import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint(tmp_path / "tiny")
    for name in ("model.safetensors", "chat_template.jinja", "preprocessor_config.json"):
        (ckpt / name).unlink()
    with pytest.raises(ConfigError) as info:
        load_config("tiny_vlm", [f"model.path={ckpt}", f"data.path={tmp_path / 'rows.jsonl'}"])
    rules = [i.rule for i in info.value.issues]
    assert [i.path for i in info.value.issues] == ["model.path"] * 3
    assert rules[0].startswith("has no weights (model.safetensors or model.safetensors.index.json)")
    assert rules[1].startswith("its tokenizer has no chat template")
    assert rules[2].startswith("has no image processor (preprocessor_config.json)")
    with pytest.raises(ConfigError) as info:  # synthetic data reads no image processor
        load_config("tiny_vlm", [f"model.path={ckpt}"])
    assert len(info.value.issues) == 2


def test_a_flavours_checkpoint_is_its_familys(tmp_path) -> None:
    """A family with flavours reads the checkpoint of the flavour its numbers declare: Qwen3.5's MoE
    numbers a ``qwen3_5_moe`` config.json (as released), its dense numbers a ``qwen3_5`` one."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_5_moe"}))
    overrides = [f"model.path={tmp_path}"]
    with pytest.raises(ConfigError) as info:
        load_config("tiny_qwen3_5_moe", overrides)
    assert not any("model_type" in i.rule for i in info.value.issues)  # only the missing files
    with pytest.raises(ConfigError, match=r"model_type='qwen3_5_moe' but model.family='qwen3_5' reads"):
        load_config("tiny_qwen3_5", overrides)
