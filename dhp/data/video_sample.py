"""A conversation with videos (and possibly images) -> one :class:`~dhp.data.batch.Sample`.

Videos go through :mod:`dhp.data.video`, images through the model's image processor, the text through
the chat template (``<video>`` renders as one ``<|video_pad|>`` between vision start/end tokens).
Each pad token is then expanded to its item's merged token count (``t*h*w / merge**2``), marked
``IMAGE`` or ``VIDEO`` in ``mm_token_type_ids``, and the items' patch rows and grids are laid out in
the order of their tokens, the one ordered visual stream the encoder and the LLM read.
``second_per_grid_ts`` holds one entry per video. Limits are checked before the pixels are built
for images; a video is decoded first (its patch count depends on its length).
"""

from __future__ import annotations

import torch

from dhp.data import bad
from dhp.data.batch import IGNORE_INDEX, IMAGE, TEXT, VIDEO, Sample
from dhp.data.images import open_image
from dhp.data.video import process_video


def process_with_videos(proc, record) -> Sample:
    """``proc`` (SampleProcessor, with its ``video`` spec) applied to ``record`` holding videos."""
    loc = record.location
    spec = proc.video
    if proc.video_refusal:
        raise bad.BadSampleError(
            location=loc,
            reason=bad.UNSUPPORTED_MODALITY,
            detail=proc.video_refusal,
            fix="drop the video records from the dataset, or train them with a family that declares video",
        )
    if spec is None:
        raise bad.BadSampleError(
            location=loc,
            reason=bad.CORRUPT_VIDEO,
            detail="the record has a video but the processor was built without video settings",
            fix="build the processor through dhp.data.source (it reads data.video_*)",
        )
    images = [open_image(p, loc=loc) for p in record.images]
    videos = [process_video(p, spec=spec, loc=loc) for p in record.videos]
    img_patches = [proc.image_processor.get_number_of_image_patches(im.height, im.width) for im in images]
    vid_patches = [v.pixel_values.shape[0] for v in videos]
    total = sum(img_patches) + sum(vid_patches)
    if proc.limits.broken(patches=total):
        raise bad.BadSampleError(
            location=loc,
            reason=bad.VISION_TOO_LONG,
            detail=f"{total} patches (images {img_patches}, videos {vid_patches}) > {proc.limits.patch_key}="
            f"{proc.limits.patch_seq_len}",
            fix=f"raise {proc.limits.patch_key}, lower data.video_max_frames / data.video_max_pixels",
        )
    with proc._text_lock:
        ids, labels, text_chars = proc._tokenize(record)
    merge2 = proc.merge**2
    counts = {
        proc.tokens.image_token_id: ([p // merge2 for p in img_patches], IMAGE),
        proc.tokens.video_token_id: ([v.tokens(proc.merge) for v in videos], VIDEO),
    }
    ids, labels, types, order = _expand(ids, labels, counts, loc=loc)
    if proc.limits.broken(tokens=ids.numel()):
        raise bad.BadSampleError(
            location=loc,
            reason=bad.TEXT_TOO_LONG,
            detail=f"{ids.numel()} tokens > {proc.limits.token_key}={proc.limits.token_seq_len}",
            fix=f"raise {proc.limits.token_key}, lower data.video_max_frames, or shorten the conversation",
        )
    image_rows: list[torch.Tensor] = []
    image_grids: list[list[int]] = []
    if images:
        out = proc.image_processor(images=images, return_tensors="pt")
        image_grids = out["image_grid_thw"].tolist()
        image_rows = list(
            out["pixel_values"].to(torch.float32).split([g[0] * g[1] * g[2] for g in image_grids])
        )
    rows, grids = [], []
    for kind, k in order:
        if kind == IMAGE:
            rows.append(image_rows[k])
            grids.append(image_grids[k])
        else:
            rows.append(videos[k].pixel_values)
            grids.append(list(videos[k].grid))
    return Sample(
        sample_id=loc,
        input_ids=ids,
        labels=labels,
        mm_token_type_ids=types,
        pixel_values=torch.cat(rows),
        image_grid_thw=torch.tensor(grids, dtype=torch.long),
        text_chars=text_chars,
        second_per_grid_ts=torch.tensor([v.second_per_grid_t for v in videos], dtype=torch.float32),
    )


def _expand(ids, labels, counts: dict[int, tuple[list[int], int]], *, loc: str):
    """Expand every image/video pad to its item's token count; the items in token order."""
    pads = torch.isin(ids, torch.tensor(list(counts)))
    where = pads.nonzero().flatten().tolist()
    for pad, (per_item, _) in counts.items():
        found = int((ids == pad).sum())
        if found != len(per_item):
            raise bad.BadSampleError(
                location=loc,
                reason=bad.PLACEHOLDER_MISMATCH,
                detail=f"rendered text has {found} pad token(s) {pad} for {len(per_item)} item(s)",
                fix="remove literal image and video special tokens from the text; one <image>/<video> per item",
            )
    seen = dict.fromkeys(counts, 0)
    out_ids, out_lab, out_typ, order, prev = [], [], [], [], 0
    for pos in where:
        pad = int(ids[pos])
        per_item, kind = counts[pad]
        k = seen[pad]
        seen[pad] += 1
        n = per_item[k]
        out_ids += [ids[prev:pos], torch.full((n,), pad, dtype=torch.long)]
        out_lab += [labels[prev:pos], torch.full((n,), IGNORE_INDEX, dtype=torch.long)]
        out_typ += [
            torch.full((pos - prev,), TEXT, dtype=torch.long),
            torch.full((n,), kind, dtype=torch.long),
        ]
        order.append((kind, k))
        prev = pos + 1
    out_ids.append(ids[prev:])
    out_lab.append(labels[prev:])
    out_typ.append(torch.full((ids.numel() - prev,), TEXT, dtype=torch.long))
    return torch.cat(out_ids), torch.cat(out_lab), torch.cat(out_typ), order
