"""Input checks at the cut between an encoder and an LLM: every mismatch is a DataError.

Family-neutral: they read the transformers config's ``vision_config`` (patch, temporal patch, merge
sizes, channels), ``image_token_id`` / ``video_token_id`` and ``text_config.hidden_size``, which every
Qwen-style vision-language config has.

Image tokens and image embeddings must agree exactly, image by image and sample by sample.
Nothing is truncated or padded to make them fit.
"""

from __future__ import annotations

import itertools

import torch
from transformers import PretrainedConfig

from dhp.errors import DataError

IMAGE_TYPE = 1
VIDEO_TYPE = 2


def image_token_counts(image_grid_thw: torch.Tensor, spatial_merge_size: int) -> list[int]:
    """LLM tokens per image: t*h*w / merge**2."""
    return [int(n) for n in (image_grid_thw.prod(-1) // spatial_merge_size**2).tolist()]


def check_vision_inputs(
    *,
    pixel_values: torch.Tensor,
    image_grid_thw: torch.Tensor,
    config: PretrainedConfig,
    shard_rows: int | None = None,
) -> None:
    """Pixel rows must be ``sum(t*h*w)`` patches of width C*T*P*P; h and w divisible by the merge size.

    ``shard_rows``: an SP shard's own patch count (its local windows' total): the rows must equal it
    instead of the whole grid's."""
    width = config.in_channels * config.temporal_patch_size * config.patch_size**2
    if pixel_values.ndim != 2 or pixel_values.shape[1] != width:
        raise DataError(
            f"pixel_values has shape {tuple(pixel_values.shape)}; the encoder expects (N_patches, {width}) "
            f"= (N, in_channels*temporal_patch_size*patch_size**2). Fix: build pixel_values with the "
            f"model's image processor (patch_size={config.patch_size}, temporal_patch_size="
            f"{config.temporal_patch_size})."
        )
    if image_grid_thw.ndim != 2 or image_grid_thw.shape[1] != 3:
        raise DataError(f"image_grid_thw has shape {tuple(image_grid_thw.shape)}; expected (N_images, 3).")
    merge = config.spatial_merge_size
    bad = [i for i, (_, h, w) in enumerate(image_grid_thw.tolist()) if h % merge or w % merge]
    if bad:
        raise DataError(
            f"image(s) {bad} have grid h or w not divisible by spatial_merge_size={merge} "
            f"(grids {image_grid_thw[bad].tolist()}). Fix: resize images to multiples of "
            f"patch_size*merge = {config.patch_size * merge} px (the image processor does this)."
        )
    patches = int(image_grid_thw.prod(-1).sum()) if shard_rows is None else shard_rows
    if patches != pixel_values.shape[0]:
        raise DataError(
            f"pixel_values has {pixel_values.shape[0]} patch rows but image_grid_thw "
            f"{image_grid_thw.tolist()} describes {patches}. Fix: pass the grid that the processor "
            f"returned with these pixels."
        )


def _image_runs(types_row: torch.Tensor) -> list[int]:
    """Lengths of the contiguous runs of image or video tokens (type 1 or 2) in one sample, in order."""
    return [
        len(list(g)) for key, g in itertools.groupby(types_row.tolist()) if key in (IMAGE_TYPE, VIDEO_TYPE)
    ]


def check_image_alignment(
    *,
    input_ids: torch.Tensor,
    mm_token_type_ids: torch.Tensor | None,
    image_grid_thw: torch.Tensor | None,
    image_embeds: torch.Tensor | None,
    config: PretrainedConfig,
    sample_ids: list[str],
    rows_at: torch.Tensor | None = None,
) -> None:
    """Each image's token run must match its grid, and all grids must match the embedding rows.

    Images are assigned to samples in order: sample b's k image runs take the next k grids.
    ``rows_at`` (B, S) bool: the tokens whose rows ``image_embeds`` holds (context parallelism: this
    rank's own tokens); None: every token's.
    """
    if mm_token_type_ids is None:
        raise DataError(
            f"samples {sample_ids}: mm_token_type_ids is missing. M-RoPE positions of image tokens depend "
            f"on it; without it transformers silently falls back to 1D positions and the loss changes. "
            f"Fix: pass mm_token_type_ids (0 text, 1 image, 2 video) as dhp.data's VLBatch does."
        )
    is_image = input_ids == config.image_token_id
    if not torch.equal(is_image, mm_token_type_ids == IMAGE_TYPE):
        row = int((is_image != (mm_token_type_ids == IMAGE_TYPE)).any(-1).nonzero()[0])
        raise DataError(
            f"sample {sample_ids[row]}: {int(is_image[row].sum())} image tokens (id {config.image_token_id}) "
            f"but {int((mm_token_type_ids[row] == IMAGE_TYPE).sum())} positions marked as image in "
            f"mm_token_type_ids. Fix: derive mm_token_type_ids from input_ids."
        )
    is_video = input_ids == config.video_token_id
    if not torch.equal(is_video, mm_token_type_ids == VIDEO_TYPE):
        row = int((is_video != (mm_token_type_ids == VIDEO_TYPE)).any(-1).nonzero()[0])
        raise DataError(
            f"sample {sample_ids[row]}: {int(is_video[row].sum())} video tokens (id {config.video_token_id}) "
            f"but {int((mm_token_type_ids[row] == VIDEO_TYPE).sum())} positions marked as video in "
            f"mm_token_type_ids. Fix: derive mm_token_type_ids from input_ids."
        )
    # images and videos are one ordered stream of visual items (grids, embedding rows): video.py
    n_tokens = int((is_image | is_video).sum())
    n_rows = 0 if image_embeds is None else int(image_embeds.shape[0])
    grids = image_grid_thw if image_grid_thw is not None else torch.zeros(0, 3, dtype=torch.long)
    per_image = image_token_counts(grids, config.vision_config.spatial_merge_size)
    if image_embeds is not None and image_embeds.shape[-1] != config.text_config.hidden_size:
        raise DataError(
            f"image_embeds has width {image_embeds.shape[-1]} but the LLM hidden size is "
            f"{config.text_config.hidden_size}. Fix: the encoder's out_hidden_size must equal the LLM's."
        )
    want = sum(per_image) if rows_at is None else int(((is_image | is_video) & rows_at).sum())
    if want != n_rows:
        where = "" if rows_at is None else f" ({want} of them at this context-parallel rank's tokens)"
        raise DataError(
            f"samples {sample_ids}: image_grid_thw {grids.tolist()} describes {sum(per_image)} image "
            f"embeddings{where} but {n_rows} were given. Fix: pass the encoder output for exactly these images."
        )
    _check_per_sample(mm_token_type_ids, per_image, sample_ids, n_tokens)


def _check_per_sample(
    mm_token_type_ids: torch.Tensor, per_image: list[int], sample_ids: list[str], n_tokens: int
) -> None:
    """Walk samples and their image runs against the per-image embedding counts, in order."""
    cursor = 0
    for b, sample in enumerate(sample_ids):
        runs = _image_runs(mm_token_type_ids[b])
        mine = per_image[cursor : cursor + len(runs)]
        if len(mine) < len(runs) or sum(mine) != sum(runs) or mine != runs:
            raise DataError(
                f"sample {sample}: {sum(runs)} image tokens in {len(runs)} image(s) (runs {runs}) but "
                f"{sum(mine)} image embeddings for it (per image {mine}). Fix: the text must hold exactly "
                f"one <|image_pad|> per embedding; re-run the processor on this sample, never truncate it."
            )
        cursor += len(runs)
    if cursor != len(per_image):
        raise DataError(
            f"samples {sample_ids}: {n_tokens} image tokens for {cursor} image(s), but "
            f"{len(per_image)} images ({sum(per_image)} embeddings) were given; images "
            f"{list(range(cursor, len(per_image)))} have no tokens. Fix: drop those images or add their tokens."
        )


def check_text_only(
    *,
    input_ids: torch.Tensor,
    mm_token_type_ids: torch.Tensor | None,
    image_embeds: torch.Tensor | None,
    sample_ids: list[str],
) -> None:
    """A text-only model config takes no images: any image input is a DataError naming the samples."""
    with_images: list[str] = []
    if mm_token_type_ids is not None:
        rows = (mm_token_type_ids != 0).any(-1).nonzero().flatten().tolist()
        with_images = [sample_ids[r] for r in rows]
    if image_embeds is not None or with_images:
        raise DataError(
            f"the model config is text-only (no vision_config) but images were given "
            f"(samples with image tokens: {with_images or 'none'}; image_embeds given: "
            f"{image_embeds is not None}). Fix: use a vision-language checkpoint (qwen2_5_vl with a "
            f"vision_config) or drop the images from the data."
        )
