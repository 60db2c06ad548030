"""The Qwen2.5-Omni thinker cut (audio -> audio_embeds, vision -> image_embeds, both -> llm) against the
untouched ``Qwen2_5OmniThinkerForConditionalGeneration``, and the audio encoder's SP cut against the
whole encoder.

fp32 on CPU, one process. Tolerances: loss within 1e-5 relative, every parameter's gradient within 1e-4
relative (max|split - ref| / max|ref|); measured ~1e-7 and ~1.5e-6: the cut runs the same ops, the split
side's loss is dhp's chunked cross-entropy, and images and videos go through the vision encoder in one
call where HF makes two. The audio SP cut: rows within 1e-6 (measured 0: the same ops per chunk), summed
gradients within 1e-5 (the sums run in another order).

HF's forward takes one ``use_audio_in_video`` per batch; dhp's LLM takes one per sample. A batch whose
only video has its audio interleaved runs as one HF call with the flag on (the flag changes nothing for
samples without video); a batch mixing a video with and a video without its audio is compared against
one HF call per flag, the losses combined by their label tokens.
"""

from __future__ import annotations

import pytest
import torch
from omni_batch import omni_batch

from dhp.errors import ConfigError, DataError
from dhp.models import get_family
from dhp.models.qwen2_5_omni.audio import shard_audio
from dhp.ops.cross_entropy import IGNORE_INDEX

pytestmark = pytest.mark.parity
LOSS_RTOL, GRAD_RTOL = 1e-5, 1e-4  # relative, fp32; see the module docstring
SP_ROWS_TOL, SP_GRAD_RTOL = 1e-6, 1e-5

AUDIO_ONLY = [("text", 5), ("audio", 37)]
IMAGE_AND_AUDIO = [("text", 3), ("image", (8, 6)), ("text", 2), ("audio", 20)]
# 4 temporal patches 1 s apart and 60 audio tokens: two 2-second chunks of each, interleaved
VIDEO_WITH_AUDIO = [("text", 4), ("video+audio", (4, 4, 4), 1.0, 240)]
VIDEO_ONLY = [("text", 3), ("video", (2, 4, 6), 0.5)]
TEXT_ONLY = [("text", 12)]


@pytest.fixture(scope="module")
def setup():
    family = get_family("qwen2_5_omni")
    hf_config = family.hf_config(family.tiny_model_config())
    torch.manual_seed(0)
    ref = family.reference_model(hf_config)
    parts = family.split_state_dict(ref.state_dict())
    modules = {}
    for name in family.module_names:  # as the runtime builds them: meta, then the module's own tensors
        module = family.build_module(name, hf_config, device="meta", dtype=hf_config.dtype)
        module.to_empty(device="cpu")
        module.load_state_dict(parts[name], strict=True)
        family.init_buffers(name, module)
        modules[name] = module
    return family, hf_config, ref, modules


def split_step(modules, batch) -> tuple[torch.Tensor, dict[str, dict[str, torch.Tensor]]]:
    """audio and vision forwards, their outputs as leaves into the LLM, the leaves' grads back."""
    for m in modules.values():
        m.zero_grad(set_to_none=True)
    outs, leaves = {}, {}
    if batch["audio_features"] is not None:
        outs.update(modules["audio"](input_features=batch["audio_features"], audio_lens=batch["audio_lens"]))
    if batch["pixel_values"] is not None:
        outs.update(modules["vision"](batch["pixel_values"], batch["image_grid_thw"]))
    leaves = {k: t.detach().requires_grad_(True) for k, t in outs.items()}
    out = modules["llm"](
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        labels=batch["labels"],
        mm_token_type_ids=batch["mm_token_type_ids"],
        image_grid_thw=batch["image_grid_thw"],
        audio_lens=batch["audio_lens"],
        use_audio_in_video=batch["use_audio_in_video"],
        second_per_grid_ts=batch["second_per_grid_ts"],
        **leaves,
    )
    loss = out.loss_sum / out.num_tokens
    loss.backward()
    for k in outs:
        outs[k].backward(leaves[k].grad)
    grads = {
        n: {k: p.grad for k, p in m.named_parameters() if p.grad is not None} for n, m in modules.items()
    }
    return loss.detach(), grads


def reference_step(ref, batches: list[tuple[dict, bool]]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """HF's mean loss over ``batches`` (each ``(hf kwargs, use_audio_in_video)``, combined by label
    tokens) and every parameter's gradient."""
    ref.zero_grad(set_to_none=True)
    counts = [int((b["labels"][:, 1:] != IGNORE_INDEX).sum()) for b, _ in batches]
    losses = [ref(**b, use_audio_in_video=flag).loss for b, flag in batches]
    loss = sum(part * n for part, n in zip(losses, counts, strict=True)) / sum(counts)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}


def assert_matches(family, modules, ref, loss, grads, ref_loss, ref_grads):
    assert abs(loss - ref_loss) / abs(ref_loss) <= LOSS_RTOL, (loss.item(), ref_loss.item())
    mapped = {family.checkpoint_owner(k): k for k in ref_grads}
    got = {(m, n) for m, g in grads.items() for n in g}
    assert got == set(mapped), f"params with grads differ: {sorted(got ^ set(mapped))}"
    for (m, n), k in mapped.items():
        ref_g = ref_grads[k]
        err = (grads[m][n] - ref_g).abs().max() / ref_g.abs().max()
        assert err <= GRAD_RTOL, f"{m}.{n}: relative grad error {err}"
    # every parameter of the three modules got one, but the audio bos/eos table the thinker never reads
    every = {(m, n) for m, mod in modules.items() for n, _ in mod.named_parameters()}
    assert every - got == {("audio", "audio_tower.audio_bos_eos_token.weight")}


def test_split_matches_reference(setup):
    family, hf_config, ref, modules = setup
    batch = omni_batch(
        hf_config, [AUDIO_ONLY, IMAGE_AND_AUDIO, VIDEO_WITH_AUDIO, TEXT_ONLY], seeds=[1, 2, 3, 4]
    )
    assert batch["use_audio_in_video"].tolist() == [False, False, True, False]
    ref_loss, ref_grads = reference_step(ref, [(batch["hf"], True)])  # no other sample has a video
    loss, grads = split_step(modules, batch)
    assert_matches(family, modules, ref, loss, grads, ref_loss, ref_grads)


def test_mixed_use_audio_in_video_matches_one_reference_call_per_flag(setup):
    family, hf_config, ref, modules = setup
    batch = omni_batch(hf_config, [VIDEO_ONLY, VIDEO_WITH_AUDIO, IMAGE_AND_AUDIO], seeds=[5, 6, 7])
    assert batch["use_audio_in_video"].tolist() == [False, True, False]
    without = omni_batch(hf_config, [VIDEO_ONLY, IMAGE_AND_AUDIO], seeds=[5, 7])  # the same records
    with_audio = omni_batch(hf_config, [VIDEO_WITH_AUDIO], seeds=[6])
    ref_loss, ref_grads = reference_step(ref, [(without["hf"], False), (with_audio["hf"], True)])
    loss, grads = split_step(modules, batch)
    assert_matches(family, modules, ref, loss, grads, ref_loss, ref_grads)


def test_use_audio_in_video_is_read_per_sample(setup):
    """The flag is observed: the interleaved sample's positions differ without it (TMRoPE aligns the
    video's and the audio's time axes only with it), and the other samples' do not change."""
    _, hf_config, _, modules = setup
    batch = omni_batch(hf_config, [VIDEO_WITH_AUDIO, AUDIO_ONLY], seeds=[3, 1])
    llm = modules["llm"]
    with torch.no_grad():
        calls = [
            llm.prepare(
                input_ids=batch["input_ids"],
                attention_mask=batch["attention_mask"],
                labels=batch["labels"],
                mm_token_type_ids=batch["mm_token_type_ids"],
                image_grid_thw=batch["image_grid_thw"],
                image_embeds=torch.zeros(int(batch["image_grid_thw"].prod(-1).sum()) // 4, 128),
                audio_embeds=torch.zeros(int((batch["mm_token_type_ids"] == 3).sum()), 128),
                audio_lens=batch["audio_lens"],
                use_audio_in_video=torch.tensor(flags),
                second_per_grid_ts=batch["second_per_grid_ts"],
            ).kwargs["position_ids"]
            for flags in ([True, False], [False, False])
        ]
    assert not torch.equal(calls[0][:, 0], calls[1][:, 0])
    assert torch.equal(calls[0][:, 1], calls[1][:, 1])


def test_audio_tokens_and_rows_must_agree(setup):
    _, hf_config, _, modules = setup
    batch = omni_batch(hf_config, [AUDIO_ONLY], seeds=[1])
    rows = modules["audio"](input_features=batch["audio_features"], audio_lens=batch["audio_lens"])[
        "audio_embeds"
    ]
    with pytest.raises(DataError, match="audio tokens"):
        modules["llm"](
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            labels=batch["labels"],
            mm_token_type_ids=batch["mm_token_type_ids"],
            audio_embeds=rows[:-1],
            audio_lens=batch["audio_lens"],
        )


# --- the audio encoder's SP cut ------------------------------------------------------------------
SP_AUDIOS = [37, 240, 8, 3, 61]  # frames: partial, many and single chunks, a 3-frame tail


@pytest.mark.parametrize("sp", [2, 3])
def test_audio_sp_shards_give_the_whole_encoders_rows_and_grads(setup, sp):
    _, hf_config, _, modules = setup
    audio = modules["audio"]
    gen = torch.Generator().manual_seed(sp)
    lens = torch.tensor(SP_AUDIOS)
    frames = torch.randn(int(lens.sum()), hf_config.audio_config.num_mel_bins, generator=gen)
    audio.zero_grad(set_to_none=True)
    whole = audio(input_features=frames, audio_lens=lens)["audio_embeds"]
    upstream = torch.randn(whole.shape, generator=gen)
    (whole * upstream).sum().backward()
    whole_grads = {n: p.grad.clone() for n, p in audio.named_parameters() if p.grad is not None}

    shards = shard_audio(frames, lens, sp_size=sp, n_window=hf_config.audio_config.n_window)
    assert len(shards) == sp and all(s.num_patches > 0 for s in shards)
    assert torch.equal(torch.cat([s.token_index for s in shards]), torch.arange(whole.shape[0]))
    audio.zero_grad(set_to_none=True)
    got = torch.empty_like(whole)
    for shard in shards:
        rows = audio(**shard.forward_kwargs())["audio_embeds"]
        got[shard.token_index] = rows.detach()
        (rows * upstream[shard.token_index]).sum().backward()  # grads accumulate: the SP group's sum
    assert (got - whole.detach()).abs().max() <= SP_ROWS_TOL
    frames_per_rank = [s.num_patches for s in shards]
    assert max(frames_per_rank) - min(frames_per_rank) <= 2 * hf_config.audio_config.n_window * 2
    for n, g in whole_grads.items():
        p = dict(audio.named_parameters())[n]
        assert (p.grad - g).abs().max() / g.abs().max() <= SP_GRAD_RTOL, n


def test_audio_sp_needs_an_even_n_window():
    frames, lens = torch.zeros(30, 8), torch.tensor([30])
    with pytest.raises(ConfigError, match="even"):
        shard_audio(frames, lens, sp_size=2, n_window=5)
    (shard,) = shard_audio(frames, lens, sp_size=1, n_window=5)  # one rank: the whole input, any n_window
    assert shard.num_patches == 30 and shard.audio_lens.tolist() == [30]


def test_audio_sp_rank_without_chunks_returns_no_rows(setup):
    _, hf_config, _, modules = setup
    frames, lens = torch.randn(5, hf_config.audio_config.num_mel_bins), torch.tensor([5])
    shards = shard_audio(frames, lens, sp_size=2, n_window=hf_config.audio_config.n_window)
    assert [s.num_patches for s in shards] == [5, 0]
    modules["audio"].zero_grad(set_to_none=True)
    out = modules["audio"](**shards[1].forward_kwargs())["audio_embeds"]
    assert out.shape == (0, hf_config.text_config.hidden_size)
    out.sum().backward()  # still connected to the parameters (FSDP's gathers meet every rank)
    grads = [p.grad for p in modules["audio"].parameters() if p.grad is not None]
    assert grads and all(not g.any() for g in grads)  # ... with zero gradients
    modules["audio"].zero_grad(set_to_none=True)
