"""Each TP rank of the LLM module loads only its shard from the safetensors files (2 gloo ranks).

The LLM module is built on meta, its decoder Linears are distributed with torch's own
``parallelize_module`` (Colwise q/k/v/gate/up, Rowwise o/down) while still on meta, and then
``load_module_weights`` fills each DTensor's local shard straight from the file. Checks: every local
shard equals the slice of the full tensor, and the loss equals the single-process reference within
1e-6 relative (fp32; TP only changes the summation order of the row-parallel all-reduce).
"""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from dhp.models import get_family, load_module_weights, make_tiny_checkpoint
from dhp.models.testing import relative_error, tiny_vl_batch

pytestmark = pytest.mark.parity
RTOL = 1e-6
WORLD = 2
PLAN = {
    "self_attn.q_proj": ColwiseParallel,
    "self_attn.k_proj": ColwiseParallel,
    "self_attn.v_proj": ColwiseParallel,
    "self_attn.o_proj": RowwiseParallel,
    "mlp.gate_proj": ColwiseParallel,
    "mlp.up_proj": ColwiseParallel,
    "mlp.down_proj": RowwiseParallel,
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _batch(hf_config):
    return tiny_vl_batch(hf_config, images=[[], []], text_lens=[19, 12], seed=5)


def _rank(rank: int, port: int, model_dir: str, out_dir: str) -> None:
    torch.set_num_threads(1)  # forked from the test process: no OpenMP pool in the child
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        family = get_family("qwen2_5_vl")
        hf_config = family.hf_config_from_dir(model_dir)
        mesh = init_device_mesh("cpu", (WORLD,))
        llm = family.build_module("llm", hf_config, device="meta", dtype=torch.float32)
        for layer in llm.language_model.layers:
            parallelize_module(layer, mesh, {k: style() for k, style in PLAN.items()})
        load_module_weights(
            llm,
            model_dir,
            family=family,
            module_name="llm",
            hf_config=hf_config,
            dtype=torch.float32,
            device="cpu",
        )
        shards = {n: p.to_local().clone() for n, p in llm.named_parameters() if isinstance(p, DTensor)}
        batch = _batch(hf_config)
        with torch.no_grad():
            out = llm(
                input_ids=batch["input_ids"],
                attention_mask=batch["attention_mask"],
                labels=batch["labels"],
                mm_token_type_ids=batch["mm_token_type_ids"],
                sample_ids=batch["sample_ids"],
            )
        torch.save(
            {"shards": shards, "loss": out.loss_sum / out.num_tokens}, os.path.join(out_dir, f"{rank}.pt")
        )
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_tp_ranks_load_only_their_shards(tmp_path):
    model_dir = make_tiny_checkpoint(tmp_path / "tiny", sharded=True)
    mp.start_processes(
        _rank,
        args=(_free_port(), str(model_dir), str(tmp_path)),
        nprocs=WORLD,
        join=True,
        start_method="fork",
    )

    family = get_family("qwen2_5_vl")
    hf_config = family.hf_config_from_dir(model_dir)
    from transformers import Qwen2_5_VLForConditionalGeneration

    ref = Qwen2_5_VLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32)
    full = family.split_state_dict(ref.state_dict())["llm"]
    batch = _batch(hf_config)
    with torch.no_grad():
        ref_loss = ref(**{k: v for k, v in batch.items() if k != "sample_ids" and v is not None}).loss
    results = [torch.load(tmp_path / f"{r}.pt") for r in range(WORLD)]
    sharded = results[0]["shards"]
    planned = {
        n for n in full if n.startswith("language_model.layers.") and ".".join(n.split(".")[3:5]) in PLAN
    }
    assert set(sharded) == planned  # q/k/v/o/gate/up/down weights and the q/k/v biases
    for name in sharded:
        style = PLAN[".".join(name.split(".")[3:5])]
        dim = 0 if style is ColwiseParallel else 1  # Colwise: out rows (and bias); Rowwise: in columns
        pieces = [res["shards"][name] for res in results]
        assert all(p.shape[dim] == full[name].shape[dim] // WORLD for p in pieces), name  # 1/tp each
        assert torch.equal(torch.cat(pieces, dim=dim), full[name]), name
    for res in results:
        assert relative_error(res["loss"], ref_loss) <= RTOL
