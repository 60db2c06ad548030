"""The Qwen3-Omni thinker cut (audio -> audio_embeds, vision -> image_embeds + DeepStack features, both
-> the MoE llm) against the untouched ``Qwen3OmniMoeThinkerForConditionalGeneration``, and the audio
encoder's SP cut against the whole encoder.

fp32 on CPU, one process. The reference is called as HF calls it: padded ``input_features`` with a
``feature_attention_mask``, images and videos apart, one ``use_audio_in_video`` for the call and
``output_router_logits=True`` (its ``loss`` is the mean LM loss + ``router_aux_loss_coef`` x the
load-balancing loss over the call's unpadded tokens). HF takes one flag per call and its aux loss is
defined on the whole call, so each batch here is one HF call: the flag is on where a video carries its
audio (it changes nothing for samples without video).

Tolerances: loss within 1e-5 relative, every parameter's gradient within 1e-4 relative
(max|split - ref| / max|ref|), every parameter of the three modules compared; the audio attention's
key biases, whose gradient is zero by construction (softmax cancels them), within 1e-9 absolute.
Measured: loss ~1e-7, worst gradient ~2e-6 (conv2d1). The audio SP cut: rows within 1e-6 (measured 0:
the same ops per window), summed gradients within 1e-5 relative (the sums run in another order).

Records are lists of parts: ``("text", n)``, ``("audio", frames)``, ``("image", (h, w))`` (patches),
``("video", (t, h, w), seconds_per_grid)``, ``("video+audio", (t, h, w), seconds_per_grid, frames)``:
the video interleaved with its own audio track by ``family.video_with_audio_ids``, which a test below
holds to ``Qwen3OmniMoeProcessor``'s own layout (audio-start, then each temporal grid's video tokens at
its start time among the audio tokens, audio-end).
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from dhp.errors import ConfigError, DataError
from dhp.models import get_family
from dhp.models.qwen3_base.llm import ROUTER_AUX_LOSS
from dhp.models.qwen3_omni.audio import audio_token_counts, shard_audio
from dhp.models.testing import relative_error, skew_routers_
from dhp.ops.cross_entropy import IGNORE_INDEX
from dhp.ops.packed import AUDIO, IMAGE, TEXT, VIDEO

pytestmark = pytest.mark.parity
LOSS_RTOL, GRAD_RTOL = 1e-5, 1e-4  # relative, fp32; see the module docstring
SP_ROWS_TOL, SP_GRAD_RTOL = 1e-6, 1e-5
ZERO_GRAD_ATOL = 1e-9  # gradients that are zero by construction (the audio attention's key bias)
VISION_RTOL = 1e-5  # the encoder over 2 gloo ranks (TP, Ulysses SP): only summation order changes
FAMILY = get_family("qwen3_omni")
TEXT_IDS = (20, 400)  # random text ids: above the specials, below the tiny audio tokens (433..435)

AUDIO_ONLY = [("text", 5), ("audio", 370)]  # 3 full chunks + a 70-frame tail: 2 attention windows
IMAGE_AND_AUDIO = [("text", 3), ("image", (8, 6)), ("text", 2), ("audio", 150)]
# 4 temporal grids 1 s apart (positions 0, 13, 26, 39) and 34 audio tokens, interleaved
VIDEO_WITH_AUDIO = [("text", 4), ("video+audio", (4, 4, 4), 1.0, 260)]
VIDEO_ONLY = [("text", 3), ("video", (2, 4, 6), 0.5)]
TEXT_ONLY = [("text", 12)]


def omni_batch(cfg, records: list[list[tuple]], *, seeds: list[int]) -> dict[str, object]:
    """One right-padded micro-batch of ``records``: dhp's fields and, under ``"hf"``, the thinker's."""
    v, mels, n_window = cfg.vision_config, cfg.audio_config.num_mel_bins, cfg.audio_config.n_window
    merge, row_width = v.spatial_merge_size, v.in_channels * v.temporal_patch_size * v.patch_size**2
    rows, visual, audios, flags = [], [], [], []
    for parts, seed in zip(records, seeds, strict=True):
        gen = torch.Generator().manual_seed(seed)
        ids: list[int] = []
        flags.append(any(p[0] == "video+audio" for p in parts))
        for kind, *spec in parts:
            if kind == "text":
                ids += torch.randint(*TEXT_IDS, (spec[0],), generator=gen).tolist()
            elif kind == "audio":
                audios.append(torch.randn(spec[0], mels, generator=gen))
                n = audio_token_counts(torch.tensor([spec[0]]), n_window=n_window)[0]
                ids += [cfg.audio_start_token_id, *[cfg.audio_token_id] * n, cfg.audio_end_token_id]
            elif kind == "image":
                grid = (1, *spec[0])
                visual.append(
                    ("image", grid, None, torch.randn(int(np.prod(grid)), row_width, generator=gen))
                )
                n = grid[1] * grid[2] // merge**2
                ids += [cfg.vision_start_token_id, *[cfg.image_token_id] * n, cfg.vision_end_token_id]
            else:  # a video, alone or with its audio track
                grid, seconds = spec[0], spec[1]
                visual.append(
                    ("video", grid, seconds, torch.randn(int(np.prod(grid)), row_width, generator=gen))
                )
                if kind == "video":
                    body = [cfg.video_token_id] * (int(np.prod(grid)) // merge**2)
                else:
                    audios.append(torch.randn(spec[2], mels, generator=gen))
                    n = audio_token_counts(torch.tensor([spec[2]]), n_window=n_window)[0]
                    body = FAMILY.video_with_audio_ids(cfg, grid=grid, seconds=seconds, audio_tokens=n)
                ids += [cfg.vision_start_token_id, *body, cfg.vision_end_token_id]
            ids += torch.randint(*TEXT_IDS, (2,), generator=gen).tolist()
        rows.append(ids)
    seq, pad = max(len(r) for r in rows), cfg.text_config.pad_token_id
    input_ids = torch.full((len(rows), seq), pad, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), seq), dtype=torch.long)
    for b, r in enumerate(rows):
        input_ids[b, : len(r)], attention_mask[b, : len(r)] = torch.tensor(r), 1
    types_ = torch.full_like(input_ids, TEXT)
    types_[input_ids == cfg.image_token_id] = IMAGE
    types_[input_ids == cfg.video_token_id] = VIDEO
    types_[input_ids == cfg.audio_token_id] = AUDIO
    specials = torch.tensor(
        [cfg.vision_start_token_id, cfg.vision_end_token_id, cfg.audio_start_token_id, cfg.audio_end_token_id]
    )
    labels = input_ids.clone()
    labels[(types_ != TEXT) | (attention_mask == 0) | torch.isin(input_ids, specials)] = IGNORE_INDEX
    pixels = [p for *_, p in visual]
    grids = torch.tensor([list(g) for _, g, _, _ in visual], dtype=torch.long).reshape(-1, 3)
    is_video = torch.tensor([k == "video" for k, *_ in visual], dtype=torch.bool)
    seconds = torch.tensor([s for k, _, s, _ in visual if k == "video"], dtype=torch.float32)
    hf: dict[str, object] = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
    if (~is_video).any():
        hf["pixel_values"] = torch.cat(
            [p for p, vid in zip(pixels, is_video.tolist(), strict=True) if not vid]
        )
        hf["image_grid_thw"] = grids[~is_video]
    if is_video.any():
        hf["pixel_values_videos"] = torch.cat(
            [p for p, vid in zip(pixels, is_video.tolist(), strict=True) if vid]
        )
        hf["video_grid_thw"], hf["video_second_per_grid"] = grids[is_video], seconds
    if audios:
        longest = max(a.shape[0] for a in audios)
        hf["input_features"] = torch.zeros(len(audios), mels, longest)
        hf["feature_attention_mask"] = torch.zeros(len(audios), longest, dtype=torch.long)
        for i, a in enumerate(audios):
            hf["input_features"][i, :, : a.shape[0]], hf["feature_attention_mask"][i, : a.shape[0]] = a.T, 1
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "labels": labels,
        "mm_token_type_ids": types_,
        "pixel_values": torch.cat(pixels) if pixels else None,
        "image_grid_thw": grids if pixels else None,
        "second_per_grid_ts": seconds if seconds.numel() else None,
        "audio_features": torch.cat(audios) if audios else None,
        "audio_lens": torch.tensor([a.shape[0] for a in audios]) if audios else None,
        "use_audio_in_video": torch.tensor(flags),
        "hf": hf,
    }


@pytest.fixture(scope="module")
def setup():
    family = get_family("qwen3_omni")
    hf_config = family.tiny_hf_config()
    torch.manual_seed(0)
    ref = family.reference_model(hf_config)
    skew_routers_(dict(ref.named_parameters()), hf_config.text_config.hidden_size)
    parts = family.split_state_dict(ref.state_dict())
    modules = {}
    for name in family.module_names:  # as the runtime builds them: meta, then the module's own tensors
        module = family.build_module(name, hf_config, device="meta", dtype=hf_config.dtype)
        module.to_empty(device="cpu")
        module.load_state_dict(parts[name], strict=True)
        family.init_buffers(name, module)
        modules[name] = module
    return family, hf_config, ref, modules


def split_step(modules, batch):
    """audio and vision forwards, every output a leaf into the LLM, the leaves' grads back."""
    for m in modules.values():
        m.zero_grad(set_to_none=True)
    outs = {}
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
    names = list(outs)
    torch.autograd.backward([outs[k] for k in names], [leaves[k].grad for k in names])
    grads = {
        n: {k: p.grad for k, p in m.named_parameters() if p.grad is not None} for n, m in modules.items()
    }
    return loss.detach(), out, grads


def reference_step(ref, batch, *, use_audio_in_video: bool):
    ref.zero_grad(set_to_none=True)
    out = ref(**batch["hf"], use_audio_in_video=use_audio_in_video, output_router_logits=True)
    out.loss.backward()
    grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    return out.loss.detach(), out.aux_loss.detach(), grads


def assert_matches(family, ref, modules, hf_config, batch, *, use_audio_in_video):
    """Loss, aux loss and every gradient of the cut against one HF call on the same batch."""
    ref_loss, ref_aux, ref_grads = reference_step(ref, batch, use_audio_in_video=use_audio_in_video)
    loss, out, grads = split_step(modules, batch)
    assert relative_error(loss, ref_loss) <= LOSS_RTOL, (loss.item(), ref_loss.item())
    aux = out.aux_losses[ROUTER_AUX_LOSS]
    assert relative_error(aux, ref_aux) <= LOSS_RTOL, (aux.item(), ref_aux.item())
    # the aux term is a visible part of the loss (well above the tolerance), not a rounding error
    assert hf_config.text_config.router_aux_loss_coef * ref_aux > 100 * LOSS_RTOL * ref_loss
    every = {(m, n) for m, mod in modules.items() for n, _ in mod.named_parameters()}
    got = {(m, n) for m, g in grads.items() for n in g}
    mapped = {family.checkpoint_owner(k): k for k in ref_grads}
    assert got == every == set(mapped), sorted(got ^ set(mapped))  # every parameter got one, as in HF
    # the audio attention's key bias adds one constant per query row to the scores, which softmax
    # cancels: its gradient is zero by construction (both sides ~1e-13 of noise), compared absolutely
    zero = {(m, n) for m, n in every if m == "audio" and n.endswith("self_attn.k_proj.bias")}
    for m, n in zero:
        assert max(grads[m][n].abs().max(), ref_grads[mapped[(m, n)]].abs().max()) <= ZERO_GRAD_ATOL, n
    errors = {(m, n): relative_error(grads[m][n], ref_grads[mapped[(m, n)]]) for m, n in every - zero}
    worst = max(errors, key=errors.get)
    assert errors[worst] <= GRAD_RTOL, f"worst relative grad error {errors[worst]} at {worst}"


def test_split_matches_reference(setup):
    """Audio-only, image + audio, video with its audio track, text-only: one batch, one HF call."""
    family, hf_config, ref, modules = setup
    batch = omni_batch(
        hf_config, [AUDIO_ONLY, IMAGE_AND_AUDIO, VIDEO_WITH_AUDIO, TEXT_ONLY], seeds=[1, 2, 3, 4]
    )
    assert batch["use_audio_in_video"].tolist() == [False, False, True, False]
    assert (batch["attention_mask"] == 0).any()  # padding: the aux loss must mask it as HF does
    assert_matches(family, ref, modules, hf_config, batch, use_audio_in_video=True)


def test_split_matches_reference_with_images_and_a_plain_video(setup):
    """A video without audio beside an image: DeepStack joins the image and video rows in token order."""
    family, hf_config, ref, modules = setup
    batch = omni_batch(hf_config, [VIDEO_ONLY, IMAGE_AND_AUDIO], seeds=[5, 6])
    assert_matches(family, ref, modules, hf_config, batch, use_audio_in_video=False)


def _positions(llm, batch, **flags):
    """The LLM's TMRoPE positions of ``batch`` (zero rows for every edge)."""
    width, n_visual = llm.vl_config.text_config.hidden_size, int(batch["image_grid_thw"].prod(-1).sum()) // 4
    n_audio = int((batch["mm_token_type_ids"] == AUDIO).sum())
    keys = ("input_ids", "attention_mask", "labels", "mm_token_type_ids", "image_grid_thw", "audio_lens")
    with torch.no_grad():
        return llm.prepare(
            **{k: batch[k] for k in keys},
            image_embeds=torch.zeros(n_visual, width),
            deepstack_embeds_0=torch.zeros(n_visual, width),
            deepstack_embeds_1=torch.zeros(n_visual, width),
            audio_embeds=torch.zeros(n_audio, width),
            second_per_grid_ts=batch["second_per_grid_ts"],
            **flags,
        ).kwargs["position_ids"]


def test_use_audio_in_video_is_read_from_each_samples_tokens(setup):
    """The flag is the tokens' (<|vision_start|><|audio_start|>), observed: the interleaved sample's
    positions are transformers' with the flag on and differ from its positions with it off; the other
    sample's do not change; a flag the tokens contradict is refused."""
    from dhp.models.qwen3_omni.modules import _visual_kinds, tmrope_positions

    _, hf_config, _, modules = setup
    batch = omni_batch(hf_config, [VIDEO_WITH_AUDIO, AUDIO_ONLY], seeds=[3, 1])
    read = _positions(modules["llm"], batch)
    assert torch.equal(
        read, _positions(modules["llm"], batch, use_audio_in_video=torch.tensor([True, False]))
    )
    off = tmrope_positions(
        config=hf_config,
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        kinds=_visual_kinds(batch["input_ids"], batch["mm_token_type_ids"]),
        grids=batch["image_grid_thw"],
        audio_lens=batch["audio_lens"],
        use_audio_in_video=[False, False],
        second_per_grid_ts=batch["second_per_grid_ts"],
        sample_ids=["a", "b"],
    )
    assert not torch.equal(read[:, 0], off[:, 0]) and torch.equal(read[:, 1], off[:, 1])
    with pytest.raises(DataError, match="no video of theirs has its audio track"):
        _positions(modules["llm"], batch, use_audio_in_video=torch.tensor([True, True]))
    mixed = omni_batch(hf_config, [[*VIDEO_WITH_AUDIO, *VIDEO_ONLY]], seeds=[3])
    with pytest.raises(DataError, match="a video with its audio track interleaved and a video without"):
        _positions(modules["llm"], mixed)


def test_video_with_audio_ids_are_the_processors_layout(setup):
    """The family's interleaving of a video with its audio is ``Qwen3OmniMoeProcessor``'s own
    (``replace_video_with_audio_token``, called on a stand-in that names each token by one letter)."""
    import types

    from transformers.models.qwen3_omni_moe.processing_qwen3_omni_moe import Qwen3OmniMoeProcessor

    family, cfg, _, _ = setup
    letters = {cfg.audio_start_token_id: "<", cfg.audio_end_token_id: ">", cfg.video_token_id: "V"}
    letters[cfg.audio_token_id] = "A"
    stand_in = types.SimpleNamespace(
        audio_bos_token="<", audio_eos_token=">", video_token="V", audio_token="A",
        video_processor=types.SimpleNamespace(merge_size=cfg.vision_config.spatial_merge_size),
    )  # fmt: skip
    for grid, seconds, n in [((4, 4, 4), 1.0, 34), ((2, 4, 6), 0.5, 3), ((3, 2, 2), 2.0, 100)]:
        want = Qwen3OmniMoeProcessor.replace_video_with_audio_token(
            stand_in,
            {"video_grid_thw": [grid], "video_second_per_grid": [seconds]},
            0,
            {"num_audio_tokens": [n]},
            0,
            position_id_per_seconds=cfg.position_id_per_seconds,
        )
        got = family.video_with_audio_ids(cfg, grid=grid, seconds=seconds, audio_tokens=n)
        assert "".join(letters[i] for i in got) == want, grid


def test_reference_kwargs_call_the_thinker_as_the_runtime_does(setup):
    """``family.reference_kwargs`` of the verify path's inputs (dhp's batch, images and videos apart,
    audio padded) is the HF call above: the same loss; the thinker's flag read from the tokens."""
    import types

    from dhp.data.audio_sample import reference_audio_kwargs
    from dhp.data.video import reference_visual_kwargs

    family, hf_config, ref, _ = setup
    batch = omni_batch(hf_config, [VIDEO_ONLY, IMAGE_AND_AUDIO], seeds=[5, 6])
    view = types.SimpleNamespace(**{k: v for k, v in batch.items() if k != "hf"})
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "labels", "mm_token_type_ids")}
    kwargs = family.reference_kwargs(
        {**inputs, **reference_visual_kwargs(view), **reference_audio_kwargs(view)}
    )
    assert kwargs["use_audio_in_video"] is False and "mm_token_type_ids" not in kwargs
    with torch.no_grad():
        got = ref(**kwargs, output_router_logits=True).loss
        want = ref(**batch["hf"], use_audio_in_video=False, output_router_logits=True).loss
    assert torch.equal(got, want)
    interleaved = omni_batch(hf_config, [VIDEO_WITH_AUDIO, TEXT_ONLY], seeds=[3, 4])
    assert family.reference_kwargs({"mm_token_type_ids": interleaved["mm_token_type_ids"]})[
        "use_audio_in_video"
    ]
    both = omni_batch(hf_config, [VIDEO_WITH_AUDIO, VIDEO_ONLY], seeds=[3, 5])
    with pytest.raises(DataError, match="one use_audio_in_video per call"):
        family.reference_kwargs({"mm_token_type_ids": both["mm_token_type_ids"]})


def test_audio_tokens_and_rows_must_agree(setup):
    _, hf_config, _, modules = setup
    batch = omni_batch(hf_config, [AUDIO_ONLY], seeds=[1])
    rows = modules["audio"](input_features=batch["audio_features"], audio_lens=batch["audio_lens"])
    with pytest.raises(DataError, match="audio tokens"):
        modules["llm"](
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            labels=batch["labels"],
            mm_token_type_ids=batch["mm_token_type_ids"],
            audio_embeds=rows["audio_embeds"][:-1],
            audio_lens=batch["audio_lens"],
        )


def test_family_counts_match_the_modules(setup):
    """The torch-free architecture's parameter counts equal the built modules' (meta init)."""
    family, _, _, modules = setup
    from omegaconf import OmegaConf

    arch = family.arch.architecture(OmegaConf.structured(family.tiny_model_config()))
    for name, module in modules.items():
        assert arch.modules[name].params.total == sum(p.numel() for p in module.parameters()), name
    assert [h.kwarg for h in family.handoffs_for(family.tiny_hf_config())] == [
        "audio_embeds", "image_embeds", "deepstack_embeds_0", "deepstack_embeds_1",
    ]  # fmt: skip


# --- the audio encoder's SP cut ------------------------------------------------------------------
# frames: 2 windows + a tail, a tail-only audio, tiny ones, exactly 2 windows (window = 200 frames)
SP_AUDIOS = [450, 37, 8, 3, 400, 261]


@pytest.mark.parametrize("sp", [2, 3])
def test_audio_sp_shards_give_the_whole_encoders_rows_and_grads(setup, sp):
    _, hf_config, _, modules = setup
    audio, a = modules["audio"], hf_config.audio_config
    gen = torch.Generator().manual_seed(sp)
    lens = torch.tensor(SP_AUDIOS)
    frames = torch.randn(int(lens.sum()), a.num_mel_bins, generator=gen)
    audio.zero_grad(set_to_none=True)
    whole = audio(input_features=frames, audio_lens=lens)["audio_embeds"]
    upstream = torch.randn(whole.shape, generator=gen)
    (whole * upstream).sum().backward()
    whole_grads = {n: p.grad.clone() for n, p in audio.named_parameters()}

    shards = shard_audio(frames, lens, sp_size=sp, n_window=a.n_window, n_window_infer=a.n_window_infer)
    assert len(shards) == sp and all(s.num_patches > 0 for s in shards)
    assert torch.equal(torch.cat([s.token_index for s in shards]), torch.arange(whole.shape[0]))
    window = (a.n_window_infer // (2 * a.n_window)) * 2 * a.n_window
    audio.zero_grad(set_to_none=True)
    got = torch.empty_like(whole)
    audio_starts = [0, *torch.cumsum(lens, 0).tolist()]
    start = 0
    for shard in shards:  # every rank starts on an attention-window boundary of its audio
        first = max(s for s in audio_starts if s <= start)
        assert (start - first) % window == 0, (start, first)
        start += shard.num_patches
    for shard in shards:
        rows = audio(**shard.forward_kwargs())["audio_embeds"]
        got[shard.token_index] = rows.detach()
        (rows * upstream[shard.token_index]).sum().backward()  # grads accumulate: the SP group's sum
    assert (got - whole.detach()).abs().max() <= SP_ROWS_TOL
    frames_per_rank = [s.num_patches for s in shards]
    assert max(frames_per_rank) - min(frames_per_rank) <= 2 * window
    for n, g in whole_grads.items():
        got_g = dict(audio.named_parameters())[n].grad
        if n.endswith("self_attn.k_proj.bias"):  # zero by construction
            assert max(got_g.abs().max(), g.abs().max()) <= ZERO_GRAD_ATOL, n
        else:
            assert relative_error(got_g, g) <= SP_GRAD_RTOL, n


def test_audio_sp_cut_needs_window_boundaries_and_the_whole_padding(setup):
    """Why the rule is what it is, observed: a cut on a chunk boundary inside an attention window changes
    the rows; a shard of short chunks padded to its own longest chunk (not the micro-batch's) too."""
    _, hf_config, _, modules = setup
    audio = copy.deepcopy(modules["audio"])
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # O(1) signals (the tiny init's 0.02 hides both effects) and a visible conv bias
        for p in audio.parameters():
            if p.ndim >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) / p[0].numel() ** 0.5)
        audio.audio_tower.conv2d1.bias.fill_(0.5)  # zero padding frames become gelu(0.5), not zeros
    a = hf_config.audio_config
    frames = torch.randn(400, a.num_mel_bins, generator=gen)
    whole = audio(frames, torch.tensor([400]))["audio_embeds"]
    chunk_cut = torch.cat([audio(frames[:100], torch.tensor([100]))["audio_embeds"],
                           audio(frames[100:], torch.tensor([300]))["audio_embeds"]])  # fmt: skip
    assert (chunk_cut - whole).abs().max() > 1e-2 * whole.abs().max()
    lens = torch.tensor([200, 37, 30])  # rank 1 holds only the short audios; the batch's chunks are 100
    frames = torch.randn(int(lens.sum()), a.num_mel_bins, generator=gen)
    whole = audio(frames, lens)["audio_embeds"]
    shards = shard_audio(frames, lens, sp_size=2, n_window=a.n_window, n_window_infer=a.n_window_infer)
    assert shards[1].audio_lens.tolist() == [37, 30] and int(shards[1].chunk_frames) == 100
    tail = whole[shards[1].token_index]
    assert (audio(**shards[1].forward_kwargs())["audio_embeds"] - tail).abs().max() <= SP_ROWS_TOL
    own_padding = audio(shards[1].input_features, shards[1].audio_lens)["audio_embeds"]
    assert (own_padding - tail).abs().max() > 1e-2 * tail.abs().max()


def test_audio_sp_refuses_a_geometry_transformers_does_not_build():
    frames, lens = torch.zeros(300, 8), torch.tensor([300])
    with pytest.raises(ConfigError, match="13 rows"):
        shard_audio(frames, lens, sp_size=2, n_window=40, n_window_infer=400)
    with pytest.raises(ConfigError, match="at least one chunk"):
        shard_audio(frames, lens, sp_size=2, n_window=50, n_window_infer=50)


def test_audio_sp_rank_without_windows_returns_no_rows(setup):
    _, hf_config, _, modules = setup
    a = hf_config.audio_config
    frames, lens = torch.randn(5, a.num_mel_bins), torch.tensor([5])
    shards = shard_audio(frames, lens, sp_size=2, n_window=a.n_window, n_window_infer=a.n_window_infer)
    assert [s.num_patches for s in shards] == [5, 0]
    modules["audio"].zero_grad(set_to_none=True)
    out = modules["audio"](**shards[1].forward_kwargs())["audio_embeds"]
    assert out.shape == (0, hf_config.text_config.hidden_size)
    out.sum().backward()  # still connected to the parameters (FSDP's gathers meet every rank)
    grads = [p.grad for p in modules["audio"].parameters() if p.grad is not None]
    assert grads and all(not g.any() for g in grads)  # ... with zero gradients
    modules["audio"].zero_grad(set_to_none=True)


def test_tiny_checkpoint_loads_into_the_modules(tmp_path):
    """The tiny directory (``dhp.models.qwen3_omni.tiny``) reads back: its config, every module's
    tensors equal to transformers' own ``from_pretrained``, the audio tokens and the audio processor."""
    from dhp.models import make_tiny_checkpoint
    from dhp.models.loading import build_and_load

    family = get_family("qwen3_omni")
    cfg = family.tiny_model_config()
    make_tiny_checkpoint(tmp_path, model_cfg=cfg, sharded=True)
    hf_config = family.hf_config_from_dir(tmp_path)
    assert (hf_config.vision_start_token_id, hf_config.audio_end_token_id) == (9, 435)
    ref = dict(
        family.reference_class(hf_config).from_pretrained(tmp_path, dtype=torch.float32).named_parameters()
    )
    for name in family.module_names:
        module, _ = build_and_load(
            family, name, tmp_path, hf_config=hf_config, dtype=torch.float32, device="cpu"
        )
        for fqn, p in module.named_parameters():
            assert torch.equal(p, ref[family.hf_key(name, fqn)]), (name, fqn)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tmp_path)
    text = tok.apply_chat_template([{"role": "user", "content": [{"type": "audio"}]}], tokenize=False)
    assert "<|audio_start|><|audio_pad|><|audio_end|>" in text
    assert tok.convert_tokens_to_ids("<|audio_pad|>") == cfg.tokens.audio_token_id
    assert family.load_audio_processor(str(tmp_path)).feature_size == cfg.audio.num_mel_bins


def test_parallel_plans_cover_the_modules(setup):
    """Every nn.Linear of the vision encoder (transformers' ``merger_list`` DeepStack mergers included)
    and of the LLM matches exactly one TP glob, the routers and 3-D experts none (EP splits them); the
    audio encoder has no TP and FSDP blocks that match its layers; Ulysses SP sits on every vision block."""
    from dhp.parallel.plan_match import glob_match, matching

    family, hf_config, _, modules = setup
    for name in ("vision", "llm"):
        globs = [g for g in family.parallel_plan(name, hf_config).tp(False) if not g.endswith("embed_tokens")]
        for fqn, sub in modules[name].named_modules():
            hits = [g for g in globs if glob_match(fqn, g)]
            if isinstance(sub, torch.nn.Linear):
                assert len(hits) == 1, (fqn, hits)
            if fqn.endswith((".mlp.gate", ".mlp.experts")):
                assert hits == [], (fqn, hits)
        assert all(matching(modules[name], [g]) for g in globs), name
    assert {"visual.merger_list.*.mlp.0", "visual.merger.mlp.2"} <= set(
        family.parallel_plan("vision", hf_config).tp(False)
    )
    audio = family.parallel_plan("audio", hf_config)
    assert audio.tp is None and audio.sp == ()
    assert len(matching(modules["audio"], audio.blocks)) == hf_config.audio_config.encoder_layers
    assert family.parallel_plan("vision", hf_config).sp[0].modules == "visual.blocks.*.attn"
    llm = family.parallel_plan("llm", hf_config)
    assert (llm.moe_blocks, llm.experts) == ("language_model.layers.*.mlp", 8)


def _vision_tp_and_sp(rank: int, world: int) -> None:
    """One gloo rank of :func:`test_vision_tp2_and_sp2_match_one_process`."""
    import fnmatch
    import types

    import torch.distributed as dist
    from parallel_harness import assert_grads_match, assert_rel_close, full_grads
    from test_qwen3_vl_vision_parallel import _ulysses_attention
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    family = get_family("qwen3_omni")
    cfg = family.tiny_hf_config()
    batch = omni_batch(cfg, [IMAGE_AND_AUDIO, VIDEO_ONLY], seeds=[2, 5])  # an image and a 2-frame video
    pixels, grid = batch["pixel_values"], batch["image_grid_thw"]

    def build():
        torch.manual_seed(0)
        return family.build_module("vision", cfg, device="cpu", dtype=torch.float32)

    ref = build()
    ref_out = ref(pixels, grid)
    gen = torch.Generator().manual_seed(7)
    cotangents = {k: torch.randn(v.shape, generator=gen) for k, v in ref_out.items()}
    torch.autograd.backward([ref_out[k] for k in cotangents], list(cotangents.values()))
    want = {n: p.grad for n, p in ref.named_parameters()}
    tp = build()  # TP=2 by the family's plan: transformers' merger_list and mlp.0 / mlp.2 included
    plan = tp.parallel_plan
    parallelize_module(tp, init_device_mesh("cpu", (world,)), dict(plan.tp(False)))
    for fqn, sub in tp.named_modules():
        if any(fnmatch.fnmatchcase(fqn, g) for g in plan.tp_heads):
            sub.num_heads //= world
    tp_out = tp(pixels, grid)
    for name in ref_out:
        assert_rel_close(tp_out[name], ref_out[name], rtol=VISION_RTOL, name=f"tp rank {rank} {name}")
    torch.autograd.backward([tp_out[k] for k in cotangents], list(cotangents.values()))
    assert_grads_match(full_grads(tp), want, rtol=VISION_RTOL, tag=f"tp rank {rank}")
    sp = build()  # Ulysses SP=2 on the family's shards
    for fqn, sub in sp.named_modules():
        if any(fnmatch.fnmatchcase(fqn, site.modules) for site in plan.sp):
            sub.forward = types.MethodType(_ulysses_attention, sub)
    shard = family.shard_inputs("vision", cfg, rows=pixels, meta=grid, sp_size=world)[rank]
    sp_out = sp(**shard.forward_kwargs())
    rows = shard.token_index
    for name in ref_out:
        assert_rel_close(sp_out[name], ref_out[name][rows], rtol=VISION_RTOL, name=f"sp rank {rank} {name}")
    torch.autograd.backward([sp_out[k] for k in cotangents], [cotangents[k][rows] for k in cotangents])
    got = {}
    for n, p in sp.named_parameters():
        got[n] = p.grad.clone()
        dist.all_reduce(got[n])  # each SP rank holds its rows' partial sum
    assert_grads_match(got, want, rtol=VISION_RTOL, tag=f"sp rank {rank}")


def test_vision_tp2_and_sp2_match_one_process():
    """transformers' Qwen3-Omni encoder over 2 gloo ranks: TP by the family's plan, Ulysses SP on the
    family's shards (an image and a video); every edge's rows and every summed gradient as one process
    (fp32, <= 1e-5 relative in norm, as the Qwen3-VL encoder's test)."""
    from parallel_harness import spawn

    spawn(_vision_tp_and_sp, 2)
