"""``dhp data check --show N``: one processed sample as text a person can check.

The rendered conversation (roles as the chat template writes them), each image or video as
``<image 1: 64 tokens>`` where its tokens sit, and every token that carries loss inside ``[[ ... ]]``.
The header line says which chat template rendered it and which tokens carry the loss
(``data.train_on``).
"""

from __future__ import annotations

from dhp.data.batch import IGNORE_INDEX, IMAGE, VIDEO, Sample

LOSS_ON = {"assistant": "assistant turns only", "all": "every text token"}  # data.train_on


def describe_sample(
    sample: Sample, *, tokenizer, template: str = "the checkpoint's own", train_on: str = "assistant"
) -> str:
    """The sample as one multi-line string (see the module docstring); ``template``: where the chat
    template comes from (``dhp.data.processing.template_source``), ``train_on``: ``data.train_on``."""
    ids = sample.input_ids.tolist()
    types = sample.mm_token_type_ids.tolist()
    loss = [lab != IGNORE_INDEX for lab in sample.labels.tolist()]
    out: list[str] = []
    counters = {IMAGE: 0, VIDEO: 0}
    i = 0
    while i < len(ids):
        j = i
        while j < len(ids) and types[j] == types[i] and (types[i] != 0 or loss[j] == loss[i]):
            j += 1
        if types[i] in counters:
            counters[types[i]] += 1
            kind = "image" if types[i] == IMAGE else "video"
            out.append(f"<{kind} {counters[types[i]]}: {j - i} tokens>")
        else:
            text = tokenizer.decode(ids[i:j])
            out.append(f"[[{text}]]" if loss[i] else text)
        i = j
    head = (
        f"--- {sample.sample_id}: {len(ids)} tokens, {sum(loss)} with loss ([[...]]: "
        f"{LOSS_ON[train_on]}, data.train_on={train_on}), "
        f"{sample.num_images - sample.num_videos} image(s), {sample.num_videos} video(s); "
        f"chat template: {template}"
    )
    return head + "\n" + "".join(out)
