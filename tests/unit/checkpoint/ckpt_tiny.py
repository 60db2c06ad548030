"""Tiny TP'able transformers module shared by the checkpoint tests (no dhp layers needed)."""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLTextConfig
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLTextModel

VOCAB = 128


def tiny_text_model(*, seed: int, hidden: int = 32) -> nn.Module:
    """A 2-layer Qwen2.5-VL text model (4 heads, 2 KV heads) with seeded random init."""
    torch.manual_seed(seed)
    cfg = Qwen2_5_VLTextConfig(
        hidden_size=hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=2 * hidden,
        vocab_size=VOCAB,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=0,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]},
    )
    return Qwen2_5_VLTextModel(cfg)


def apply_tp(model: nn.Module, tp: int) -> nn.Module:
    """Megatron-style TP over the default world: colwise q/k/v/gate/up, rowwise o/down."""
    mesh = init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))
    plan = {
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(),
    }
    for layer in model.layers:
        parallelize_module(layer, mesh, plan)
    return model


def train_step(model: nn.Module, opt: torch.optim.Optimizer, *, seed: int) -> torch.Tensor:
    """One deterministic fwd/bwd/AdamW step on a fixed random batch; returns the loss."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (2, 8), generator=g)
    loss = model(input_ids=ids).last_hidden_state.pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def full_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every parameter and AdamW state as full tensors keyed ``param:`` / ``optim:<fqn>:<key>`` (collective)."""

    def full(t: torch.Tensor) -> torch.Tensor:
        return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()

    out = {f"param:{n}": full(p) for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        for k, v in opt.state[p].items():
            out[f"optim:{n}:{k}"] = full(v)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_gloo(rank: int, world: int, port: int) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)


def close_gloo() -> None:
    dist.barrier()
    dist.destroy_process_group()
