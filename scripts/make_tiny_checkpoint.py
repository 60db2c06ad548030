#!/usr/bin/env python
"""Write a tiny, complete HF directory (config, safetensors, tokenizer with its chat template,
processor) of one model family, in the layout of that family's released checkpoints.

python scripts/make_tiny_checkpoint.py --out /tmp/tiny_qwen [--model tiny] [--sharded] [--seed 0]

--model names a conf/model entry of a tiny model: tiny (Qwen2.5-VL, the default), tiny_qwen3_vl,
tiny_qwen3_vl_moe, tiny_qwen3_5, tiny_qwen3_5_moe. Its numbers are the ones `smoke=true` shrinks a
recipe of that family to, so `dhp train conf=RECIPE smoke=true model.path=OUT data.path=FILE` reads it.
"""

from __future__ import annotations

import argparse

from dhp.models import make_tiny_checkpoint
from dhp.models.entries import model_entry


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", required=True, help="output directory (created if missing)")
    parser.add_argument("--model", default="tiny", help="a conf/model entry of a tiny model (default: tiny)")
    parser.add_argument(
        "--sharded", action="store_true", help="write several safetensors shards + index.json"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    args = parser.parse_args()
    model = model_entry(args.model)
    path = make_tiny_checkpoint(args.out, model_cfg=model, sharded=args.sharded, seed=args.seed)
    print(f"wrote the tiny {model.family} checkpoint ({args.model}) to {path}")


if __name__ == "__main__":
    main()
