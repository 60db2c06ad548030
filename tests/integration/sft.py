"""What the SFT tests share (imported as a sibling module, like ``procs``): a LLaMA-Factory
file of real photographs (scikit-image's bundled ones, captions written here) and the tiny
checkpoint, in its family's real layout, that a recipe's ``smoke=true`` run reads."""

from __future__ import annotations

import json
from pathlib import Path

#: scikit-image's photographs (skimage/data) and what each shows
PHOTOS = {
    "astronaut.png": "An astronaut in a white suit stands in front of an American flag.",
    "coffee.png": "A cup of coffee with a heart drawn in the milk foam, on a saucer.",
    "chelsea.png": "A tabby cat looks to the side, its whiskers long and white.",
    "camera.png": "A man with a camera on a tripod, in black and white.",
    "coins.png": "Two dozen old coins lie in rows on a dark background.",
    "rocket.jpg": "A rocket stands on its launch pad against a blue sky.",
    "motorcycle_left.png": "A red motorcycle parked in a garage, seen from its left side.",
    "moon.png": "The surface of the moon, full of craters, in grey.",
    "hubble_deep_field.jpg": "Hundreds of distant galaxies on a black sky.",
    "retina.jpg": "A photograph of the back of an eye, with red blood vessels.",
    "brick.png": "A wall of grey bricks laid in rows.",
    "grass.png": "Green blades of grass, close up.",
}


def photo_dir() -> Path:
    import skimage

    return Path(skimage.__file__).parent / "data"


def llamafactory_file(path: Path, names: list[str] | None = None) -> Path:
    """A LLaMA-Factory (sharegpt ``messages`` + ``images``) JSON file: one record per photo, two turns
    for every third, absolute image paths."""
    rows = []
    for i, name in enumerate(names or list(PHOTOS)):
        msgs = [
            {"role": "user", "content": "<image>What is in this photo?"},
            {"role": "assistant", "content": PHOTOS[name]},
        ]
        if i % 3 == 0:
            msgs += [
                {"role": "user", "content": "Say it in three words."},
                {"role": "assistant", "content": " ".join(PHOTOS[name].split()[:3])},
            ]
        rows.append({"messages": msgs, "images": [str(photo_dir() / name)]})
    path.write_text(json.dumps(rows, indent=1))
    return path


def tiny_checkpoint(recipe: str, out: Path, overrides: list[str] | None = None) -> Path:
    """The tiny checkpoint of ``recipe``'s family at the numbers its smoke run shrinks to."""
    from dhp.models import make_tiny_checkpoint
    from dhp.validation import load_config

    model = load_config(recipe, list(overrides or []), smoke=True).model
    return make_tiny_checkpoint(out, model_cfg=model)
