"""`python -m memra_cli.tiny OUT_DIR`: write tiny random checkpoints to try memra on.

Writes OUT_DIR/target (an HF Qwen3 directory with a tiny byte-level BPE tokenizer),
OUT_DIR/dflash (z-lab DFlash format) and OUT_DIR/dspark (DeepSpec format: markov and confidence
heads, a -1 tap), all mutually compatible; and OUT_DIR/qwen3_5 (a Qwen3.5 hybrid target: Gated
DeltaNet + gated attention, in the published multimodal layout, with the same tokenizer) with
OUT_DIR/qwen3_5_dflash (a z-lab DFlash drafter tapping it). Random weights: for exercising the
tools, not for acceptance.
"""

from __future__ import annotations

import sys
from pathlib import Path

from memra_cli.tiny.draft import make_tiny_draft
from memra_cli.tiny.qwen3_5 import DEFAULT_LAYER_TYPES, make_tiny_qwen35
from memra_cli.tiny.target import make_tiny_qwen3

# the hybrid drafter taps a full-attention and a DeltaNet layer of the tiny hybrid (L F L L F)
QWEN35_DRAFT_TAPS = (1, 3)


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0].startswith("-"):
        print("usage: python -m memra_cli.tiny OUT_DIR", file=sys.stderr)
        return 2
    out = Path(argv[0])
    make_tiny_qwen3(out / "target", tokenizer=True)
    make_tiny_draft(out / "dflash", "zlab")
    make_tiny_draft(out / "dspark", "deepspec", markov_rank=32, confidence="markov", target_layer_ids=(-1, 1, 3))
    make_tiny_qwen35(out / "qwen3_5", layout="multimodal", tokenizer=True)
    make_tiny_draft(out / "qwen3_5_dflash", "zlab", target_layer_ids=QWEN35_DRAFT_TAPS,
                    num_target_layers=len(DEFAULT_LAYER_TYPES))
    print(f"wrote {out / 'target'} (Qwen3 + tokenizer), {out / 'dflash'} (z-lab DFlash), {out / 'dspark'} (DeepSpec DSpark), "
          f"{out / 'qwen3_5'} (Qwen3.5 hybrid, multimodal layout + tokenizer), {out / 'qwen3_5_dflash'} (z-lab DFlash for it)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
