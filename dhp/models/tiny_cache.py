"""The tiny checkpoint a tiny test model reads when it is given real data and no ``model.path``.

:func:`dhp.config.data_shortcuts.use_tiny_checkpoint` names the directory (a pure rule of the config);
:func:`ensure_tiny_checkpoint` writes it once, on the driver, before any actor or data worker reads
it: tokenizer, image processor and random weights from :func:`dhp.models.tiny.make_tiny_checkpoint`
(the same writer as ``scripts/make_tiny_checkpoint.py``) for the run's own ``model`` numbers. The
write goes to a temporary sibling renamed into place, so a concurrent or interrupted writer never
leaves a half-written directory behind the name.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from omegaconf import DictConfig

from dhp.config.data_shortcuts import TINY_CHECKPOINT_SEED, tiny_checkpoint_dir


def ensure_tiny_checkpoint(model: DictConfig, *, say: Callable[[str], None]) -> Path | None:
    """Write ``model.path`` when it is this tiny model's cached checkpoint and missing; returns it.

    None (nothing written, nothing said) when ``model.path`` is the user's own directory or unset.
    ``say`` receives one line naming the directory, so a run never uses it unannounced.
    """
    if not model.tiny or model.path is None:
        return None
    path = Path(str(model.path))
    if path != tiny_checkpoint_dir(model):
        return None
    if not (path / "config.json").is_file():
        # transformers' tokenizer, processor and model classes: only when the checkpoint is written
        # (`dhp train` reaches Ray's start without transformers' model code, dhp.runtime.launch.startup)
        from dhp.models.tiny import make_tiny_checkpoint

        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
        try:
            make_tiny_checkpoint(tmp, model_cfg=model, seed=TINY_CHECKPOINT_SEED)
            os.rename(tmp, path)
        except OSError:
            if not (path / "config.json").is_file():  # not another writer's finished copy: a real failure
                raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    say(
        f"model.path unset: using the tiny random {model.family} checkpoint at {path} "
        f"(tokenizer, image processor, random weights of seed {TINY_CHECKPOINT_SEED}); "
        "set model.path=DIR to use your own"
    )
    return path
