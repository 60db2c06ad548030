"""Render the demo's short video clips (dhp/data_assets/demo/images/clips): simple moving scenes.

Each clip is 8 frames of 112x84 px at 4 fps (2 s). Three are written as folders of PNG frames
(readable with Pillow alone), one also as an MPEG-4 file (needs PyAV: ``pip install 'dhp[video]'``).
Deterministic; a few KB per clip.

    .venv/bin/python scripts/make_demo_clips.py [--out dhp/data_assets/demo/images/clips]
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from PIL import Image, ImageDraw

W, H, FRAMES, FPS = 112, 84, 8, 4


def ball(k: int) -> Image.Image:
    """A red ball moving left to right over a blue sky and green ground."""
    im = Image.new("RGB", (W, H), (135, 190, 235))
    d = ImageDraw.Draw(im)
    d.rectangle([0, 60, W, H], fill=(60, 150, 60))
    x = 8 + k * (W - 24) / (FRAMES - 1)
    y = 40 - 24 * math.sin(math.pi * k / (FRAMES - 1))
    d.ellipse([x, y, x + 14, y + 14], fill=(220, 30, 30))
    return im


def square(k: int) -> Image.Image:
    """A yellow square turning clockwise on black."""
    im = Image.new("RGB", (W, H), (0, 0, 0))
    a = math.pi / 2 * k / FRAMES
    c, s, r = math.cos(a), math.sin(a), 22
    pts = [
        (W / 2 + r * (c * u - s * v), H / 2 + r * (s * u + c * v))
        for u, v in ((-1, -1), (1, -1), (1, 1), (-1, 1))
    ]
    ImageDraw.Draw(im).polygon(pts, fill=(240, 220, 40))
    return im


def sunset(k: int) -> Image.Image:
    """An orange sun sinking below a dark sea while the sky darkens."""
    t = k / (FRAMES - 1)
    im = Image.new("RGB", (W, H), (int(250 - 150 * t), int(170 - 120 * t), int(90 - 40 * t)))
    d = ImageDraw.Draw(im)
    y = 20 + 40 * t
    d.ellipse([W / 2 - 12, y, W / 2 + 12, y + 24], fill=(255, 140, 0))
    d.rectangle([0, 56, W, H], fill=(20, 40, 90))
    return im


CLIPS = {"ball": ball, "square": square, "sunset": sunset}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="dhp/data_assets/demo/images/clips")
    args = ap.parse_args()
    out = Path(args.out)
    for name, draw in CLIPS.items():
        folder = out / name
        folder.mkdir(parents=True, exist_ok=True)
        for k in range(FRAMES):
            draw(k).save(folder / f"{k:03d}.png", optimize=True)
    import av

    with av.open(str(out / "ball.mp4"), mode="w") as container:
        stream = container.add_stream("mpeg4", rate=FPS)
        stream.width, stream.height, stream.pix_fmt = W, H, "yuv420p"
        for k in range(FRAMES):
            for packet in stream.encode(av.VideoFrame.from_image(ball(k))):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    print(f"wrote {len(CLIPS)} frame folders and ball.mp4 under {out}")


if __name__ == "__main__":
    main()
