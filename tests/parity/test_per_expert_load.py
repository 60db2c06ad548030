"""Per-expert checkpoints (the released Qwen3.5-MoE / Qwen3-Omni layout) loaded under expert sharding.

On 2 gloo ranks, the LLM of tiny Qwen3.5-MoE and of tiny Qwen3-Omni (the release's ``thinker.*`` names)
is built on meta, parallelized, and loaded from the per-expert directory and, apart, from the fused one
it was written from (``dhp.models.tiny.write_per_expert_copy``), for
(a) fsdp=2 x ep=2: each rank owns half of every layer's experts (EP), the dense parameters FSDP-sharded;
(b) dp=2 with expert FSDP (ep=1, edp=2): the experts FSDP-sharded over the 2 ranks;
(c) tp=2 with expert TP (etp=2): the experts cut over the 2 TP ranks, attention TP-sharded.
Both loads gather (``full_param_dict``) to parameters equal (``torch.equal``: a load only moves bytes) to a
single-process load of the fused directory; the per-expert load reads exactly the bytes the fused one
reads (each rank only its experts' slices: half the experts' bytes), and names every per-expert key
of the module as read.
"""

from __future__ import annotations

import re

import pytest
import torch
from parallel_harness import spawn
from torch.distributed.device_mesh import init_device_mesh

from dhp.layout import ParallelLayout
from dhp.models import get_family
from dhp.models.entries import model_entry
from dhp.models.loading import build_and_load, checkpoint_index, load_module_weights
from dhp.models.tiny import make_tiny_checkpoint, write_per_expert_copy
from dhp.parallel import full_param_dict, parallelize
from dhp.parallel.ep import expert_params

pytestmark = pytest.mark.parity

PER_EXPERT = re.compile(r"\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$")
LAYOUTS = (
    (ParallelLayout(fsdp=2, ep=2), ((2,), ("fsdp",))),
    (ParallelLayout(dp=2, expert_fsdp=True), ((2,), ("dp",))),
    (ParallelLayout(tp=2, etp=2), ((1, 2), ("dp", "tp"))),
)


def _thinker_release_name(key: str) -> str:
    """A thinker key (transformers 5's names) -> the full Qwen3-Omni release's (``thinker.model.layers``)."""
    for new, old in (("model.language_model.", "thinker.model."), ("model.", "thinker."), ("", "thinker.")):
        if key.startswith(new):
            return old + key[len(new) :]
    raise AssertionError(key)


def _load(family, model_dir: str, hf_config, mesh, layout: ParallelLayout):
    module = family.build_module("llm", hf_config, device="meta", dtype=torch.float32)
    parallelize("llm", module, mesh, layout=layout, activation_checkpointing="off", mixed_precision="fp32")
    report = load_module_weights(module, model_dir, family=family, module_name="llm", hf_config=hf_config,
                                 dtype=torch.float32, device="cpu")  # fmt: skip
    return module, report


def _ranks(rank: int, world: int, dirs: dict[str, tuple[str, str]]) -> None:
    for family_name, (fused, per_expert) in dirs.items():
        family = get_family(family_name)
        hf_config = family.hf_config_from_dir(fused)
        single, _ = build_and_load(
            family, "llm", fused, hf_config=hf_config, dtype=torch.float32, device="cpu"
        )
        want = dict(single.named_parameters())
        expert_bytes = sum(w.numel() * 4 for n, w in want.items() if ".mlp.experts." in n)
        per_expert_keys = {k for k in checkpoint_index(per_expert) if PER_EXPERT.search(k)}
        for layout, (shape, axes) in LAYOUTS:
            tag = f"{family_name} {layout}"
            mesh = init_device_mesh("cpu", shape, mesh_dim_names=axes)
            from_fused, fused_report = _load(family, fused, hf_config, mesh, layout)
            module, report = _load(family, per_expert, hf_config, mesh, layout)
            sharded = [p for n, p in module.named_parameters() if ".mlp.experts." in n]
            assert sharded and all(p.to_local().numel() * 2 == p.numel() for p in sharded), tag
            if layout.ep > 1:
                assert len(expert_params(module)) == len(sharded), tag
            assert report.bytes_read == fused_report.bytes_read, tag  # the same slices, no more
            assert report.bytes_read <= sum(w.numel() * 4 for w in want.values()) - expert_bytes // 2, tag
            assert per_expert_keys <= set(report.keys_read), tag
            for got in (full_param_dict(module), full_param_dict(from_fused)):
                assert got.keys() == want.keys(), tag
                for name, w in want.items():
                    assert torch.equal(got[name], w), f"{tag}: {name} differs from the single-process load"


def test_per_expert_checkpoints_load_under_ep_and_expert_fsdp(tmp_path):
    dirs = {}
    for family_name, cfg, rename in (
        ("qwen3_5", model_entry(get_family("qwen3_5").arch.moe.tiny), None),
        ("qwen3_omni", get_family("qwen3_omni").tiny_model_config(), _thinker_release_name),
    ):
        fused = make_tiny_checkpoint(tmp_path / family_name / "fused", model_cfg=cfg, sharded=True)
        out = tmp_path / family_name / "per_expert"
        write_per_expert_copy(fused, out, folds=get_family(family_name).expert_folds, rename=rename)
        dirs[family_name] = (str(fused), str(out))
    spawn(_ranks, 2, dirs)
