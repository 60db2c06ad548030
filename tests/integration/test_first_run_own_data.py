"""A user's first run on their own data, for every tiny recipe: `dhp train conf=R data.path=F
train.steps=2` with F a LLaMA-Factory-style file of real photos (scikit-image's), a short video (the
shipped demo clip) and text-only records, no model.path (each model's tiny checkpoint is written to
the cache and read as a downloaded one), collocated as the recipe is, and the same file
disaggregated; a whole text-only dataset too. A family that declares no video (the Qwen3-style ones)
is given the file without the video, and its plan refuses the video record by name.

One cache (the tiny checkpoints, the sampled rows) and one Ray for the module; each run is the CLI's
own command in this process (``cli_here``). The fast case is tiny_vlm on the mixed file; the family
matrix is ``slow``.
"""

from __future__ import annotations

import importlib.util
import json
import math
import shutil
from pathlib import Path

import pytest
import skimage
from cli_here import dhp_here, explain

import dhp.data_assets
from dhp.config.data_shortcuts import CACHE_ENV
from dhp.errors import ConfigError

pytestmark = pytest.mark.integration
PHOTOS = ("astronaut.png", "chelsea.png", "coffee.png", "rocket.jpg", "motorcycle_left.png")
CLIPS = Path(dhp.data_assets.__file__).parent / "demo" / "images" / "clips"
HAS_AV = importlib.util.find_spec("av") is not None
#: recipe -> whether its family declares video (it is then given the file with the video)
RECIPES = {
    "tiny_vlm": True,
    "tiny_vlm_lora": True,
    "tiny_vlm_packed": True,
    "tiny_vlm_video": True,
    "tiny_vlm_demo": True,
    "tiny_qwen3_vl": False,
    "tiny_qwen3_vl_moe": False,
    "tiny_qwen3_5": False,
    "tiny_qwen3_5_moe": False,
}
DISAGGREGATED = ["placement=disaggregated", "modules.vision.gpus=1", "modules.vision.parallel.sp=1"]


def _chat(question: str, answer: str, **media) -> dict:
    return {
        "messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}],
        **media,
    }


@pytest.fixture(scope="module")
def own(tmp_path_factory) -> dict[str, Path]:
    """The user's files (absolute media paths, as LLaMA-Factory's mllm_demo holds them) and the cache."""
    root = tmp_path_factory.mktemp("my_data")
    for name in PHOTOS:
        shutil.copy(Path(skimage.__file__).parent / "data" / name, root / name)
    clip = root / ("ball.mp4" if HAS_AV else "ball")  # an MP4 needs PyAV; a folder of frames does not
    (shutil.copy if HAS_AV else shutil.copytree)(CLIPS / clip.name, clip)
    photos = [
        _chat(
            "<image>What is in the photo?", "An astronaut in a white suit.", images=[str(root / PHOTOS[0])]
        ),
        _chat("<image>Describe it.", "A cat lies on a sofa.", images=[str(root / PHOTOS[1])]),
        _chat("<image>What drink is this?", "A cup of coffee.", images=[str(root / PHOTOS[2])]),
        _chat("<image>Where is it?", "A rocket on the pad.", images=[str(root / PHOTOS[3])]),
        _chat("<image>What vehicle?", "A red motorcycle.", images=[str(root / PHOTOS[4])]),
    ]
    text = [
        _chat("What is two plus two?", "Four."),
        _chat("Say hello.", "Hello."),
        _chat("Name a color.", "Red."),
    ]
    video = _chat("<video>What happens in the clip?", "A red ball flies over the grass.", videos=[str(clip)])

    def write(name: str, rows: list[dict]) -> Path:
        path = root / name
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return path

    return {
        "root": root,
        "mixed": write("mixed.jsonl", [photos[0], text[0], video, photos[1], text[1], photos[2], video]),
        "images_text": write(
            "images_text.jsonl", [photos[0], text[0], photos[3], photos[1], text[1], photos[4]]
        ),
        "text": write("chat.jsonl", text * 2),
    }


@pytest.fixture
def cache(own, monkeypatch) -> Path:
    monkeypatch.setenv(CACHE_ENV, str(own["root"] / "cache"))  # shared: each checkpoint written once
    return own["root"] / "cache"


def trains(own, recipe: str, data: Path, *extra: str) -> list[dict]:
    """`dhp train conf=RECIPE data.path=DATA train.steps=2 ...` succeeds; its metrics rows."""
    out = own["root"] / "runs" / f"{recipe}-{data.stem}-{len(extra)}"
    result = dhp_here(
        "train", f"conf={recipe}", f"data.path={data}", "train.steps=2", f"train.output_dir={out}", *extra
    )
    assert result.exit_code == 0, explain(result)
    (run_dir,) = (out / recipe).iterdir()
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2] and all(math.isfinite(r["loss"]) for r in rows)
    assert all(r["bad_samples"] == {} for r in rows)  # every row trained: none skipped, none refused
    return rows


@pytest.mark.slow
def test_tiny_vlm_trains_photos_a_video_and_text(ray_local, own, cache):
    rows = trains(own, "tiny_vlm", own["mixed"])
    assert all(r["tokens_per_s_vision"] > 0 for r in rows)
    (ckpt,) = (cache / "tiny_checkpoints").iterdir()
    assert ckpt.name.startswith("qwen2_5_vl-")


def test_a_family_without_video_refuses_the_video_record_by_name(own, cache):
    result = dhp_here("plan", "conf=tiny_qwen3_vl", f"data.path={own['mixed']}", "--dry-run")
    assert isinstance(result.exception, ConfigError), explain(result)
    issues = [str(i) for i in result.exception.issues]
    assert all("(unsupported_modality): model family qwen3_vl does not declare video" in i for i in issues)
    assert [i.split("'")[1] for i in issues] == [f"{own['mixed']}:3", f"{own['mixed']}:7"]


@pytest.mark.slow
@pytest.mark.parametrize("recipe", [r for r in RECIPES if r != "tiny_vlm"])
def test_every_tiny_recipe_trains_the_users_file(ray_local, own, cache, recipe):
    trains(own, recipe, own["mixed" if RECIPES[recipe] else "images_text"])


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["tiny_vlm", "tiny_qwen3_vl"])
def test_the_file_trains_disaggregated(ray_local, own, cache, recipe):
    trains(own, recipe, own["mixed" if RECIPES[recipe] else "images_text"], *DISAGGREGATED)


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["tiny_vlm", "tiny_qwen3_vl"])
def test_a_text_only_dataset_trains(ray_local, own, cache, recipe):
    """No image in any micro-batch: the encoder runs nothing, the LLM gets every edge as None."""
    rows = trains(own, recipe, own["text"])
    assert all(r["tokens_per_s_vision"] == 0 for r in rows)
