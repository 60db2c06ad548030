#!/usr/bin/env python
"""Write a tiny, complete HF directory (config, safetensors, tokenizer with its chat template,
processor) of one model family, in the layout of that family's released checkpoints.

python scripts/make_tiny_checkpoint.py --out /tmp/tiny_qwen [--model tiny | --family qwen2_5_vl] [--sharded] [--seed 0]

--model names a conf/model entry of a tiny model: tiny (Qwen2.5-VL), tiny_qwen3_vl,
tiny_qwen3_vl_moe, tiny_qwen3_5, tiny_qwen3_5_moe. Its numbers are the ones `smoke=true` shrinks a
recipe of that family to, so `dhp train conf=RECIPE smoke=true model.path=OUT data.path=FILE` reads it.
--family (without --model) writes the family's own tiny numbers.
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
    parser.add_argument(
        "--sharded", action="store_true", help="write several safetensors shards + index.json"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--model", default=None, help="a conf/model entry of a tiny model, e.g. tiny_qwen3_vl")
    which.add_argument(
        "--family", default="qwen2_5_vl", help="model family: qwen2_5_vl, qwen3_vl, qwen3_vl_moe, qwen3_5"
    )
    args = parser.parse_args()
    if args.model is not None:
        model = model_entry(args.model)
        path = make_tiny_checkpoint(args.out, model_cfg=model, sharded=args.sharded, seed=args.seed)
        print(f"wrote the tiny {model.family} checkpoint ({args.model}) to {path}")
        return
    path = make_tiny_checkpoint(args.out, family=args.family, sharded=args.sharded, seed=args.seed)
    print(f"wrote tiny {args.family} checkpoint to {path}")


if __name__ == "__main__":
    main()
