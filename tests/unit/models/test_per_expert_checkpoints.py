"""MoE checkpoints that store one tensor per expert, as the released Qwen3.5-MoE and Qwen3-Omni do.

A tiny fused directory (transformers 5's layout, several shards and an index) is rewritten per expert
under the release's key names (``dhp.models.tiny.write_per_expert_copy``); every module loaded from it
must equal (``torch.equal``: the fold only moves bytes) the same module loaded from the fused
directory, and the report must name the per-expert keys as read. transformers itself loads the same
per-expert layout into its own classes (its conversion mapping fuses the experts) with the same
expert tensors, so the layout written here is the one transformers reads as released. A directory
that lacks one expert is refused with the layer and the expert named.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dhp.errors import CheckpointError
from dhp.models import get_family
from dhp.models.entries import model_entry
from dhp.models.loading import build_and_load, checkpoint_index
from dhp.models.tiny import make_tiny_checkpoint, write_per_expert_copy

pytestmark = pytest.mark.unit

PER_EXPERT = re.compile(r"\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$")


def _thinker_release_name(key: str) -> str:
    """A thinker key (transformers 5's names) -> the full Qwen3-Omni release's (``thinker.model.layers``)."""
    for new, old in (("model.language_model.", "thinker.model."), ("model.", "thinker."), ("", "thinker.")):
        if key.startswith(new):
            return old + key[len(new) :]
    raise AssertionError(key)


def _thinker_own_name(key: str) -> str:
    """A thinker key (transformers 5's names) -> the thinker class's saved names (its original format)."""
    return _thinker_release_name(key).removeprefix("thinker.")


@pytest.fixture(scope="module")
def qwen3_5_dirs(tmp_path_factory) -> tuple[Path, Path]:
    family = get_family("qwen3_5")
    root = tmp_path_factory.mktemp("qwen3_5_moe")
    fused = make_tiny_checkpoint(root / "fused", model_cfg=model_entry(family.arch.moe.tiny), sharded=True)
    return fused, write_per_expert_copy(fused, root / "per_expert", folds=family.expert_folds)


@pytest.fixture(scope="module")
def omni_dirs(tmp_path_factory) -> tuple[Path, Path]:
    family = get_family("qwen3_omni")
    root = tmp_path_factory.mktemp("qwen3_omni")
    fused = make_tiny_checkpoint(root / "fused", model_cfg=family.tiny_model_config(), sharded=True)
    per_expert = write_per_expert_copy(
        fused, root / "per_expert", folds=family.expert_folds, rename=_thinker_release_name
    )
    return fused, per_expert


def _assert_same_modules(family_name: str, fused: Path, per_expert: Path) -> int:
    """Every module of the family loaded from both directories: equal parameters; the per-expert load
    reads every per-expert key of its module and no fused expert key. Returns the per-expert keys read."""
    family = get_family(family_name)
    hf_config = family.hf_config_from_dir(fused)
    index = checkpoint_index(per_expert)
    assert len({index[k] for k in index if PER_EXPERT.search(k)}) >= 2  # the experts span several shards
    per_expert_read = 0
    for name in family.module_names:
        want, _ = build_and_load(family, name, fused, hf_config=hf_config, dtype=torch.float32, device="cpu")
        got, report = build_and_load(
            family, name, per_expert, hf_config=hf_config, dtype=torch.float32, device="cpu"
        )
        want_p, got_p = dict(want.named_parameters()), dict(got.named_parameters())
        assert want_p.keys() == got_p.keys()
        for fqn, p in want_p.items():
            assert torch.equal(got_p[fqn], p), (name, fqn)
        owned = {k for k in index if family.checkpoint_owner(k)[0] == name}
        assert set(report.keys_read) == owned  # exact: the per-expert keys count as read, none left
        per_expert_read += sum(1 for k in report.keys_read if PER_EXPERT.search(k))
    return per_expert_read


def test_qwen3_5_moe_per_expert_directory_loads_as_the_fused_one(qwen3_5_dirs):
    fused, per_expert = qwen3_5_dirs
    cfg = get_family("qwen3_5").hf_config_from_dir(fused).text_config
    layers = sum(1 for k in checkpoint_index(fused) if k.endswith(".mlp.experts.gate_up_proj"))
    assert "model.language_model.layers.0.mlp.experts.3.up_proj.weight" in checkpoint_index(per_expert)
    assert _assert_same_modules("qwen3_5", fused, per_expert) == 3 * cfg.num_experts * layers


def test_qwen3_omni_release_names_load_as_the_fused_one(omni_dirs):
    fused, per_expert = omni_dirs
    cfg = get_family("qwen3_omni").hf_config_from_dir(fused).text_config
    index = checkpoint_index(per_expert)
    assert "thinker.model.layers.1.mlp.experts.7.gate_proj.weight" in index
    assert all(k.startswith("thinker.") for k in index)
    layers = sum(1 for k in checkpoint_index(fused) if k.endswith(".mlp.experts.gate_up_proj"))
    assert _assert_same_modules("qwen3_omni", fused, per_expert) == 3 * cfg.num_experts * layers


def _hf_experts(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v for k, v in model.state_dict().items() if ".mlp.experts." in k}


def test_transformers_reads_the_per_expert_layout_as_written(qwen3_5_dirs, omni_dirs, tmp_path):
    """transformers' own classes load the per-expert directories (its conversion mapping folds them)
    into expert tensors equal to the fused directory's: the written layout and the fold are the
    release's, and transformers' gate/up order is the one dhp folds in."""
    for family_name, (fused, per_expert) in (("qwen3_5", qwen3_5_dirs), ("qwen3_omni", omni_dirs)):
        family = get_family(family_name)
        hf_config = family.hf_config_from_dir(fused)
        cls = family.reference_class(hf_config)
        hf_dir = per_expert
        if family_name == "qwen3_omni":  # the thinker class saves (and reads) names without ``thinker.``
            hf_dir = write_per_expert_copy(
                fused, tmp_path / "omni_own_names", folds=family.expert_folds, rename=_thinker_own_name
            )
        want = _hf_experts(cls.from_pretrained(fused, dtype=torch.float32))
        got = _hf_experts(cls.from_pretrained(hf_dir, dtype=torch.float32))
        assert want and want.keys() == got.keys()
        for key, w in want.items():
            assert torch.equal(got[key], w), (family_name, key)
        llm, _ = build_and_load(
            family, "llm", per_expert, hf_config=hf_config, dtype=torch.float32, device="cpu"
        )
        for fqn, p in llm.named_parameters():
            if ".mlp.experts." in fqn:
                assert torch.equal(p, want[family.hf_key("llm", fqn)]), (family_name, fqn)


def _drop(per_expert: Path, out: Path, keys: set[str]) -> Path:
    """A copy of ``per_expert`` without ``keys`` (dropped from their shards and the index)."""
    out.mkdir()
    index = json.loads((per_expert / "model.safetensors.index.json").read_text())
    for f in per_expert.iterdir():
        if f.suffix == ".safetensors":
            save_file({k: v for k, v in load_file(str(f)).items() if k not in keys}, str(out / f.name))
        elif f.is_file():
            (out / f.name).write_bytes(f.read_bytes())
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if k not in keys}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    return out


def test_a_missing_expert_is_named(qwen3_5_dirs, tmp_path):
    """Expert 5 of layer 1 gone (all its parts): the layer and the expert are named; only its up_proj
    gone: that part is named; the last expert gone (no gap to see in the keys): named from the
    module's expert count."""
    fused, per_expert = qwen3_5_dirs
    family = get_family("qwen3_5")
    hf_config = family.hf_config_from_dir(fused)
    last = hf_config.text_config.num_experts - 1
    layer = "model.language_model.layers.1."
    cases = {
        "expert5": (
            {f"{layer}mlp.experts.5.{p}_proj.weight" for p in ("gate", "up", "down")},
            r"of experts \[5\]",
        ),
        "up5": ({f"{layer}mlp.experts.5.up_proj.weight"}, r"experts\.<j>\.up_proj\.weight of experts \[5\]"),
        "last": (
            {f"{layer}mlp.experts.{last}.{p}_proj.weight" for p in ("gate", "up", "down")},
            rf"experts \[{last}\] are missing",
        ),
    }
    for name, (keys, message) in cases.items():
        broken = _drop(per_expert, tmp_path / name, keys)
        with pytest.raises(CheckpointError, match=rf"layer '{re.escape(layer)}'.*{message}"):
            build_and_load(family, "llm", broken, hf_config=hf_config, dtype=torch.float32, device="cpu")


def test_fused_and_per_expert_keys_of_one_layer_are_refused(qwen3_5_dirs, tmp_path):
    fused, per_expert = qwen3_5_dirs
    family = get_family("qwen3_5")
    out = _drop(per_expert, tmp_path / "mixed", set())
    key = "model.language_model.layers.0.mlp.experts.down_proj"
    file_name = checkpoint_index(fused)[key]
    extra = {key: load_file(str(fused / file_name))[key]}
    save_file({**load_file(str(out / file_name)), **extra}, str(out / file_name))
    index = json.loads((out / "model.safetensors.index.json").read_text())
    index["weight_map"][key] = file_name
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    hf_config = family.hf_config_from_dir(fused)
    with pytest.raises(CheckpointError, match=r"stored both fused and per expert"):
        build_and_load(family, "llm", out, hf_config=hf_config, dtype=torch.float32, device="cpu")


def test_stacked_experts_reads_any_slice_of_the_fused_tensor(tmp_path):
    """The lazy fused view equals ``stack(cat(gate_j, up_j))`` on every slice a shard can ask for: an EP
    rank's experts, rows across the gate/up boundary (a cut of the fused rows), columns, empty slices."""
    from safetensors import safe_open

    from dhp.models.loading import FoldedKey, StackedExperts
    from dhp.models.qwen3_base.base_family import MOE_EXPERT_FOLDS

    experts, inter, hidden = 4, 3, 5
    gen = torch.Generator().manual_seed(0)
    tensors = {
        f"m.mlp.experts.{j}.{p}.weight": torch.randn(inter, hidden, generator=gen)
        for j in range(experts)
        for p in ("gate_proj", "up_proj")
    }
    save_file(tensors, str(tmp_path / "w.safetensors"))
    fused = torch.stack(
        [
            torch.cat([tensors[f"m.mlp.experts.{j}.{p}.weight"] for p in ("gate_proj", "up_proj")])
            for j in range(experts)
        ]
    )
    fold = FoldedKey(
        layer="m.",
        fold=MOE_EXPERT_FOLDS[0],
        keys=tuple(
            (f"m.mlp.experts.{j}.gate_proj.weight", f"m.mlp.experts.{j}.up_proj.weight")
            for j in range(experts)
        ),
    )
    with safe_open(str(tmp_path / "w.safetensors"), framework="pt") as f:
        view = StackedExperts(fold, f.get_slice, "w.safetensors")
        assert view.get_shape() == list(fused.shape) == [experts, 2 * inter, hidden]
        for key in (
            slice(None),
            (slice(2, 4),),
            (slice(1, 3), slice(2, 5), slice(1, 4)),
            (slice(None), slice(3, 6)),
            (slice(0, 1), slice(0, 2)),
            (slice(2, 2),),
            (slice(None), slice(4, 4)),
        ):
            assert torch.equal(view[key], fused[key]), key


def _all_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        out |= load_file(str(f))
    return out


def test_the_per_expert_copy_is_what_transformers_saves_as_the_original_format(
    qwen3_5_dirs, omni_dirs, tmp_path
):
    """transformers' ``save_pretrained(save_original_format=True)`` of the same tiny model (same seed)
    un-fuses the experts by its own conversion mapping: its keys and tensors are exactly the per-expert
    copy's (Qwen3.5-MoE: the release's names; the Qwen3-Omni thinker: the thinker class's own names)."""
    from dhp.models.tiny import write_tiny_base

    family = get_family("qwen3_omni")
    omni = write_per_expert_copy(
        omni_dirs[0], tmp_path / "omni_own", folds=family.expert_folds, rename=_thinker_own_name
    )
    cases = (("qwen3_5", model_entry(get_family("qwen3_5").arch.moe.tiny), qwen3_5_dirs[1]),
             ("qwen3_omni", family.tiny_model_config(), omni))  # fmt: skip
    for family_name, cfg, per_expert in cases:
        original = tmp_path / f"{family_name}_original"
        write_tiny_base(
            original, family=family_name, sharded=True, seed=0, model_cfg=cfg, original_format=True
        )
        want, got = _all_tensors(original), _all_tensors(per_expert)
        assert any(PER_EXPERT.search(k) for k in want) and want.keys() == got.keys(), family_name
        for key, w in want.items():
            assert torch.equal(got[key], w), (family_name, key)


def test_a_full_omni_directory_per_expert_loads_the_thinker(omni_dirs, tmp_path):
    """A full Qwen3-Omni directory (thinker, talker, code2wav) with every MoE layer per expert, the
    talker's too: the thinker's modules load equal to the thinker directory's; no talker key is read."""
    from dhp.models.qwen3_omni.tiny import write_tiny_full_checkpoint

    family = get_family("qwen3_omni")
    fused = write_tiny_full_checkpoint(tmp_path / "full", model_cfg=family.tiny_model_config())
    per_expert = write_per_expert_copy(fused, tmp_path / "full_per_expert", folds=family.expert_folds)
    index = checkpoint_index(per_expert)
    assert any(k.startswith("talker.") and PER_EXPERT.search(k) for k in index)
    thinker_config = family.hf_config_from_dir(omni_dirs[0])
    for name in family.module_names:
        want, _ = build_and_load(
            family, name, fused, hf_config=thinker_config, dtype=torch.float32, device="cpu"
        )
        got, report = build_and_load(
            family, name, per_expert, hf_config=thinker_config, dtype=torch.float32, device="cpu"
        )
        assert not any(k.startswith("talker.") for k in report.keys_read)
        assert set(report.keys_read) == {k for k in index if family.checkpoint_owner(k)[0] == name}
        for fqn, p in want.named_parameters():
            assert torch.equal(dict(got.named_parameters())[fqn], p), (name, fqn)
