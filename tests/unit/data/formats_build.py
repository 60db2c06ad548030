"""Build the shipped demo set (real photographs) in every supported format, with one bad record each.

Used by the format tests and the ``dhp data check`` integration test. Each builder returns
``(DatasetEntry, bad_location)``; ``bad_location`` is the location string the check must name.
"""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

from dhp.config.schema import DatasetEntry

DEMO = Path(__file__).resolve().parents[3] / "dhp" / "data_assets" / "demo"


def demo_records() -> list[dict]:
    """The 25 LLaVA records of the demo set (captions.json then mixed.jsonl)."""
    records = json.loads((DEMO / "captions.json").read_text())
    records += [json.loads(line) for line in (DEMO / "mixed.jsonl").read_text().splitlines() if line.strip()]
    return records


def _images(rec: dict) -> list[str]:
    img = rec.get("image")
    return [] if img is None else [img] if isinstance(img, str) else list(img)


def _messages(rec: dict) -> list[dict]:
    role = {"human": "user", "gpt": "assistant", "system": "system"}
    return [{"role": role[t["from"]], "content": t["value"]} for t in rec["conversations"]]


def _parts(text: str, images: list[str]) -> list[dict]:
    """``<image>`` placeholders -> typed parts; each image part names its file inline."""
    out, it = [], iter(images)
    for k, chunk in enumerate(text.split("<image>")):
        if k:
            out.append({"type": "image", "image": next(it)})
        if chunk:
            out.append({"type": "text", "text": chunk})
    return out


def write_messages_jsonl(root: Path, *, bad: bool = True) -> tuple[DatasetEntry, str]:
    """LLaMA-Factory/ms-swift style: string content with ``<image>`` and an ``images`` list.
    Line 4 lists one image too few for its tags (placeholder_mismatch)."""
    path = root / "messages.jsonl"
    lines = []
    for rec in demo_records():
        out = {"id": rec["id"], "messages": _messages(rec)}
        if _images(rec):
            out["images"] = _images(rec)
        lines.append(out)
    if bad:
        lines[3]["images"] = lines[3]["images"][:-1]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    return DatasetEntry(name="messages", path=str(path), image_root=str(DEMO / "images")), f"{path}:4"


def write_parts_json(root: Path, *, bad: bool = True) -> tuple[DatasetEntry, str]:
    """transformers chat-template style: content as typed parts with inline image paths.
    Record 2 holds an audio part (unsupported_modality)."""
    path = root / "parts.json"
    out = []
    for rec in demo_records():
        imgs = _images(rec)
        msgs = []
        for m in _messages(rec):
            content = _parts(m["content"], imgs) if "<image>" in m["content"] else m["content"]
            msgs.append({"role": m["role"], "content": content})
        out.append({"id": rec["id"], "messages": msgs})
    if bad:
        out[2]["messages"][0]["content"] = [
            {"type": "audio_url", "value": "clip.wav"},
            {"type": "text", "text": "Hi"},
        ]
    path.write_text(json.dumps(out))
    return DatasetEntry(name="parts", path=str(path), image_root=str(DEMO / "images")), f"{path}[2]"


def write_parquet(root: Path, *, bad: bool = True, rows_per_group: int = 8) -> tuple[DatasetEntry, str]:
    """HF-style export: ``messages`` + ``images`` as ``{bytes, path}`` structs (bytes embedded).
    Row 5's first image is cut to 4 KB (corrupt_image)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = []
    for rec in demo_records():
        imgs = [{"bytes": (DEMO / "images" / n).read_bytes(), "path": n} for n in _images(rec)]
        rows.append({"id": rec["id"], "messages": _messages(rec), "images": imgs})
    if bad:
        rows[5]["images"][0]["bytes"] = rows[5]["images"][0]["bytes"][:4096]
    path = root / "train-00000-of-00001.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=rows_per_group)
    return DatasetEntry(name="parquet", path=str(path)), f"{path}[5]"


def write_webdataset(root: Path, *, bad: bool = True, per_shard: int = 10) -> tuple[DatasetEntry, str]:
    """Tar shards ``shard-000N.tar`` of ``<key>.json`` (LLaVA record) + ``<key>.jpg`` / ``<key>.K.jpg``.
    Sample 12 (second shard) loses its ``.json`` member (malformed_record)."""
    recs = demo_records()
    shards = (len(recs) + per_shard - 1) // per_shard
    bad_loc = ""
    for s in range(shards):
        shard = root / f"shard-{s:04d}.tar"
        with tarfile.open(shard, "w") as tar:
            for k in range(s * per_shard, min(len(recs), (s + 1) * per_shard)):
                rec, key = recs[k], f"sample{k:05d}"
                imgs = _images(rec)
                members = {}
                if k != 12 or not bad:
                    members["json"] = json.dumps({"conversations": rec["conversations"]}).encode()
                else:
                    bad_loc = f"{shard}:{key}"
                for i, n in enumerate(imgs):
                    ext = "jpg" if len(imgs) == 1 else f"{i}.jpg"
                    members[ext] = (DEMO / "images" / n).read_bytes()
                for ext, data in members.items():
                    info = tarfile.TarInfo(f"{key}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    spec = str(root / f"shard-{{0000..{shards - 1:04d}}}.tar")
    return DatasetEntry(name="wds", path=spec), bad_loc


BUILDERS = {
    "messages": write_messages_jsonl,
    "parts": write_parts_json,
    "parquet": write_parquet,
    "webdataset": write_webdataset,
}
