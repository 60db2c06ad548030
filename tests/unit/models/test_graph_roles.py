"""``dhp.models.graph``: the roles the generic layers ask for, read from each family's declaration, and
checked against what each family's typed architecture says its modules do (pure, no torch)."""

from __future__ import annotations

import pytest
from omegaconf import DictConfig, OmegaConf

from dhp.config.loader import CONF_DIR
from dhp.config.schema import ModelConfig
from dhp.models.graph import (
    consumer_name,
    image_module,
    known_consumer,
    known_image_module,
    producer_names,
    run_module_names,
    seq_limits,
)
from dhp.models.registry import family_names, get_arch

pytestmark = pytest.mark.unit


def _tiny(family: str) -> DictConfig:
    path = CONF_DIR / "model" / f"tiny_{family}.yaml"
    tiny = OmegaConf.load(path if path.is_file() else CONF_DIR / "model" / "tiny.yaml")
    model = OmegaConf.merge(OmegaConf.structured(ModelConfig), tiny)
    model.family = family
    return model


@pytest.mark.parametrize("family", family_names())
def test_roles_follow_the_declaration_and_the_architecture(family: str) -> None:
    arch = get_arch(family)
    names = arch.module_names
    assert consumer_name(family) == names[-1]
    assert producer_names(family, names) == list(names[:-1])
    modules = arch.architecture(_tiny(family)).modules
    assert modules[consumer_name(family)].vocab > 0  # the consumer computes the loss
    # the image encoder is the module that hands the LLM its image embeddings
    feeds = [n for n, m in modules.items() if "image_embeds" in m.outputs]
    assert feeds == [image_module(family)]


def test_a_run_without_the_image_encoder_has_no_patch_limit() -> None:
    family = "qwen2_5_vl"
    consumer, image = consumer_name(family), image_module(family)
    both = {image: OmegaConf.create({"seq_len": 64}), consumer: OmegaConf.create({"seq_len": 32})}
    assert seq_limits(family, both) == (64, 32)
    assert seq_limits(family, {consumer: both[consumer]}) == (0, 32)
    assert run_module_names(family, [consumer, "other"]) == [consumer]
    assert producer_names(family, [consumer]) == []


def test_an_unknown_family_has_no_roles() -> None:
    assert known_consumer("no_such_family") is None
    assert known_image_module("no_such_family") is None
    assert known_consumer("qwen2_5_vl") == consumer_name("qwen2_5_vl")
