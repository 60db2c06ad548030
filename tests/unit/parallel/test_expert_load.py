"""Expert-load statistics (``dhp.parallel.expert_load``) on transformers' own sparse-MoE blocks, the
metrics record and ``dhp report``'s rows (expert load, router loss), and LoRA on experts refused (one process)."""

from __future__ import annotations

import io

import pytest
import torch
from omegaconf import OmegaConf
from rich.console import Console
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers.models.qwen3_vl_moe.configuration_qwen3_vl_moe import Qwen3VLMoeTextConfig
from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeTextSparseMoeBlock

from dhp.errors import ConfigError, PlanError
from dhp.metrics.report import render_report_summary
from dhp.parallel.expert_load import summarize, track_expert_load
from dhp.parallel.lora import lora_targets

pytestmark = pytest.mark.unit

E, K, H, T = 4, 2, 16, 10


def _blocks() -> nn.Module:
    cfg = Qwen3VLMoeTextConfig(
        hidden_size=H, moe_intermediate_size=8, num_experts=E, num_experts_per_tok=K, num_hidden_layers=2
    )
    torch.manual_seed(0)
    holder = nn.Module()
    holder.layers = nn.ModuleList([Qwen3VLMoeTextSparseMoeBlock(cfg) for _ in range(2)])
    with torch.no_grad():  # layer 0: every token's top-2 is experts {0, 1}; layer 1 stays random
        holder.layers[0].gate.weight.copy_(torch.tensor([1.0, 0.5, 0.0, -1.0]).unsqueeze(1).expand(E, H))
    return holder


def test_summary_of_a_known_unbalanced_table() -> None:
    s = summarize(torch.tensor([[10, 10, 0, 0], [6, 4, 5, 5]]))
    assert (s.worst_layer, s.max, s.mean, s.max_over_mean) == (0, 10.0, 5.0, 2.0)
    assert s.per_layer == (2.0, 1.2)
    assert s.as_record() == {
        "tokens_per_expert_max": 10.0,
        "tokens_per_expert_mean": 5.0,
        "max_over_mean": 2.0,
        "worst_layer": 0,
        "layers": 2,
    }


def test_hooks_count_the_router_top_k_once_even_under_recompute() -> None:
    holder = _blocks()
    load = track_expert_load(holder, "layers.*")
    x = torch.rand(1, T, H) + 0.1  # positive rows: layer 0's router ranks expert 0 > 1 > 2 > 3
    h = holder.layers[0](x)
    # layer 1 under activation checkpointing: backward re-runs its forward (and so the hook)
    out = checkpoint(holder.layers[1], h, use_reentrant=False)
    router = torch.softmax(holder.layers[1].gate.weight.detach() @ h.detach()[0].T, dim=0).T
    want1 = torch.bincount(torch.topk(router, K, -1).indices.reshape(-1), minlength=E)
    out.sum().backward()
    s = load.take(device=torch.device("cpu"))
    want = summarize(torch.stack([torch.tensor([T, T, 0, 0]), want1]))
    assert s == want and s.worst_layer == 0 and s.max_over_mean == E / K  # fully unbalanced: E/top_k
    assert load.take(device=torch.device("cpu")) is None  # reset: nothing routed since
    with pytest.raises(PlanError, match="no module matches"):
        track_expert_load(holder, "nothing.*")


def test_report_shows_the_worst_expert_load_and_the_router_loss(tmp_path) -> None:
    rows = []
    for step, ratio in ((1, 1.5), (2, 2.0), (3, 1.2)):
        load = {"tokens_per_expert_max": 8 * ratio, "tokens_per_expert_mean": 8.0}
        load |= {"max_over_mean": ratio, "worst_layer": step, "layers": 4}
        rows.append(
            {
                "step": step,
                "loss": 1.0,
                "expert_load": {"llm": load},
                "aux_losses": {"router_aux_loss": ratio},
            }
        )
    (tmp_path / "metrics.jsonl").write_text("")
    out = io.StringIO()
    render_report_summary(tmp_path, rows, [], console=Console(file=out, width=200))
    assert "llm expert load max/mean (median; worst)" in out.getvalue()
    assert "1.50 (2.00 at step 2, layer 2: 16 / 8.0 tokens)" in out.getvalue()
    assert (
        "router_aux_loss first -> last (unweighted)" in out.getvalue()
        and "1.5000 -> 1.2000" in out.getvalue()
    )


def test_lora_on_experts_is_refused_with_the_fix() -> None:
    holder = _blocks()
    lora = OmegaConf.create({"rank": 8, "alpha": 16.0, "dropout": 0.0, "targets": ["layers.*.experts"]})
    with pytest.raises(ConfigError) as e:
        lora_targets(holder, module_name="llm", lora=lora)
    (issue,) = e.value.issues
    assert issue.path == "modules.llm.lora.targets[0]"
    assert "LoRA on experts is not supported" in issue.rule and "self_attn" in issue.fix


def test_router_loss_is_label_token_weighted_over_the_step() -> None:
    from dhp.runtime.loop.driver_step import _aux_losses

    # micro-batch 0: both replica leaders report the group's value 2.0 with 3 and 1 label tokens;
    # micro-batch 1: one leader, 1.0 over 4 tokens; T = 8 -> (2*4 + 1*4) / 8
    stats = [
        [
            {"aux_losses": {"router_aux_loss": 2.0}, "num_tokens": 3},
            {"aux_losses": {"router_aux_loss": 2.0}, "num_tokens": 1},
        ],
        [{"aux_losses": {"router_aux_loss": 1.0}, "num_tokens": 4}],
    ]
    assert _aux_losses(stats, 8) == {"router_aux_loss": 1.5}
    assert _aux_losses([[{"aux_losses": {}, "num_tokens": 5}]], 5) == {}  # a dense LLM: nothing
