"""Small datasets in the layouts peers write, from the shipped photographs and clips.

The JSON files ship in ``dhp/data_assets/demo`` (shaped like the peers' public demo files; docs/DATA.md
names which); the WebDataset layouts real converters write are built here as tar shards.
"""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

from dhp.config.schema import DatasetEntry

DEMO = Path(__file__).resolve().parents[3] / "dhp" / "data_assets" / "demo"
PKG = "pkg://dhp.data_assets/demo"


def _tar(path: Path, members: dict[str, bytes]) -> None:
    with tarfile.open(path, "w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def _photo(name: str) -> bytes:
    return (DEMO / "images" / name).read_bytes()


def wds_turn_list(root: Path) -> DatasetEntry:
    """``<key>.json`` is a bare list of turns, ``<key>.jpg`` its image (converters that write only the
    conversation)."""
    turns = lambda q, a: [{"from": "human", "value": f"<image>\n{q}"}, {"from": "gpt", "value": a}]  # noqa: E731
    members = {
        "000000.json": json.dumps(turns("What is this?", "A close-up of a tabby cat.")).encode(),
        "000000.jpg": _photo("cat.jpg"),
        "000001.json": json.dumps(turns("What is shown?", "Two dozen ancient silver coins.")).encode(),
        "000001.jpg": _photo("coins.jpg"),
    }
    _tar(root / "turns-0000.tar", members)
    return DatasetEntry(name="wds_turns", path=str(root / "turns-0000.tar"))


def wds_llava_record(root: Path) -> DatasetEntry:
    """``<key>.json`` is a whole LLaVA record whose ``image`` names the member file (``"000123.jpg"``)."""
    rec = {
        "id": "000123",
        "image": "000123.jpg",
        "conversations": [
            {"from": "human", "value": "<image>\nDescribe the photo."},
            {"from": "gpt", "value": "A white rocket on its launch pad at dusk."},
        ],
    }
    members = {"000123.json": json.dumps(rec).encode(), "000123.jpg": _photo("rocket.jpg")}
    _tar(root / "llava-0000.tar", members)
    return DatasetEntry(name="wds_llava", path=str(root / "llava-0000.tar"))


def wds_extension(root: Path) -> DatasetEntry:
    """The layout read before: ``<key>.json`` (messages) + ``<key>.jpg``, the image named by extension."""
    rec = {
        "messages": [
            {"role": "user", "content": "<image>What is in the cup?"},
            {"role": "assistant", "content": "An espresso with light crema."},
        ],
        "images": ["jpg"],
    }
    _tar(root / "ext-0000.tar", {"a.json": json.dumps(rec).encode(), "a.jpg": _photo("espresso.jpg")})
    return DatasetEntry(name="wds_ext", path=str(root / "ext-0000.tar"))


def shipped_entries() -> dict[str, DatasetEntry]:
    """One entry per shipped peer-shaped file (the audio demo is left out: it is refused by design)."""
    info = f"{PKG}/dataset_info.json"
    return {
        "llamafactory_mllm_demo": DatasetEntry(name="mllm_demo", info=info),
        "llamafactory_video": DatasetEntry(name="mllm_video_demo", info=info),
        "sharegpt": DatasetEntry(name="sharegpt_demo", info=info),
        "llamafactory_v1": DatasetEntry(name="v1_mm", path=f"{PKG}/v1_mm_demo.jsonl"),
        "swift": DatasetEntry(name="swift_mm", path=f"{PKG}/swift_mm.jsonl"),
    }


def every_layout(root: Path) -> list[DatasetEntry]:
    """The shipped files and the three WebDataset layouts: one entry each."""
    return [
        *shipped_entries().values(),
        wds_turn_list(root),
        wds_llava_record(root),
        wds_extension(root),
        wds_captions(root),
    ]


def wds_captions(root: Path) -> DatasetEntry:
    """img2dataset's caption shards: ``<key>.jpg``, ``<key>.txt`` (the caption) and a metadata
    ``<key>.json`` (url, size, status; its ``caption`` too)."""
    meta = {"url": "https://example.invalid/cat.jpg", "key": "000000000", "status": "success", "width": 448}
    members = {
        "000000000.jpg": _photo("cat.jpg"),
        "000000000.txt": b"A close-up of a tabby cat with yellow-green eyes.",
        "000000000.json": json.dumps({**meta, "caption": "A close-up of a tabby cat."}).encode(),
        "000000001.jpg": _photo("gravel.jpg"),
        "000000001.json": json.dumps({**meta, "key": "000000001", "caption": "Loose grey gravel."}).encode(),
    }
    _tar(root / "captions-00000.tar", members)
    return DatasetEntry(name="wds_captions", path=str(root / "captions-00000.tar"))
