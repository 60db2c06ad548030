#!/usr/bin/env python
"""Write a tiny, complete HF directory of a model family (config, safetensors, tokenizer, processor).

python scripts/make_tiny_checkpoint.py --out /tmp/tiny_qwen [--family qwen2_5_vl] [--sharded] [--seed 0]
"""

from __future__ import annotations

import argparse

from dhp.models import make_tiny_checkpoint


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", required=True, help="output directory (created if missing)")
    parser.add_argument(
        "--sharded", action="store_true", help="write several safetensors shards + index.json"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    parser.add_argument(
        "--family", default="qwen2_5_vl", help="model family: qwen2_5_vl, qwen3_vl, qwen3_vl_moe, qwen3_5"
    )
    args = parser.parse_args()
    path = make_tiny_checkpoint(args.out, family=args.family, sharded=args.sharded, seed=args.seed)
    print(f"wrote tiny {args.family} checkpoint to {path}")


if __name__ == "__main__":
    main()
