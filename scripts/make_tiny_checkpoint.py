#!/usr/bin/env python
"""Write a tiny, complete Qwen2.5-VL HF directory (config, safetensors, tokenizer, processor).

python scripts/make_tiny_checkpoint.py --out /tmp/tiny_qwen [--sharded] [--seed 0]
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
    args = parser.parse_args()
    path = make_tiny_checkpoint(args.out, sharded=args.sharded, seed=args.seed)
    print(f"wrote tiny Qwen2.5-VL checkpoint to {path}")


if __name__ == "__main__":
    main()
