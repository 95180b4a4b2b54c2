"""`python -m memra_cli.tiny OUT_DIR`: write tiny random checkpoints to try memra on.

Writes OUT_DIR/target (an HF Qwen3 directory with a tiny byte-level BPE tokenizer),
OUT_DIR/dflash (z-lab DFlash format) and OUT_DIR/dspark (DeepSpec format: markov and confidence
heads, a -1 tap), all mutually compatible; and OUT_DIR/qwen3_5 (a Qwen3.5 hybrid target: Gated
DeltaNet + gated attention, in the published multimodal layout, with the same tokenizer) with
OUT_DIR/qwen3_5_dflash (a z-lab DFlash drafter tapping it); OUT_DIR/gemma4 (a Gemma 4 text target:
sliding + full layers, k_eq_v, softcap, tied head, with the same tokenizer) with OUT_DIR/gemma4_dflash
(a z-lab DFlash drafter tapping it) and OUT_DIR/gemma4_dspark (a DeepSpec Gemma4DSparkModel drafter:
Gemma 4 layers, markov and confidence heads, the target's embedding and head); OUT_DIR/qwen3_moe (a Qwen3-MoE target: 8 experts, top-2,
layer 1 dense, with the same tokenizer) with OUT_DIR/qwen3_moe_dflash (a z-lab DFlash drafter for it);
OUT_DIR/qwen3_5_moe (the Qwen3.5 mixture-of-experts hybrid, multimodal layout: 8 experts, top-2, a
gated shared expert, with the same tokenizer) with OUT_DIR/qwen3_5_moe_dflash; OUT_DIR/gemma4_moe (Gemma 4
with its MoE block: 8 experts, top-2, beside the dense MLP, with the same tokenizer) with
OUT_DIR/gemma4_moe_dflash;
and OUT_DIR/llama (a LLaMA target: no q/k norm, llama3 rope scaling, with the same tokenizer) with
OUT_DIR/llama_dflash (a z-lab DFlash drafter tapping it). Random weights: for exercising the tools,
not for acceptance.
"""

from __future__ import annotations

import sys
from pathlib import Path

from memra_cli.engine.errors import MemraError
from memra_cli.engine.files import check_output
from memra_cli.tiny.draft import make_tiny_draft
from memra_cli.tiny.gemma4 import DEFAULT_LAYER_TYPES as GEMMA4_LAYER_TYPES, make_tiny_gemma4
from memra_cli.tiny.gemma4_dspark import make_tiny_gemma4_dspark
from memra_cli.tiny.qwen3_moe import make_tiny_qwen3_moe
from memra_cli.tiny.qwen3_5 import DEFAULT_LAYER_TYPES, make_tiny_qwen35
from memra_cli.tiny.target import make_tiny_llama, make_tiny_qwen3

# the hybrid drafter taps a full-attention and a DeltaNet layer of the tiny hybrid (L F L L F)
QWEN35_DRAFT_TAPS = (1, 3)
# the Gemma 4 drafter taps the embedding, a sliding and a full layer of the tiny target (S S F S F)
GEMMA4_DRAFT_TAPS = (-1, 1, 2)
LLAMA_LAYERS, LLAMA_DRAFT_TAPS = 4, (0, 2)
TINY_MOE = (8, 2, 32)  # the MoE hybrid's and MoE Gemma's experts: (count, top-k, intermediate)


USAGE = "usage: python -m memra_cli.tiny OUT_DIR"


def main(argv: list[str]) -> int:
    if argv in (["-h"], ["--help"]):  # asked for: the usage and what is written, on stdout, exit 0
        print(f"{USAGE}\n\n{__doc__.strip().split(chr(10), 1)[1].strip()}")
        return 0
    if len(argv) != 1 or argv[0].startswith("-"):
        print(USAGE, file=sys.stderr)
        return 2
    out = Path(argv[0])
    try:  # the rule of every output, before anything is written
        check_output(out, "OUT_DIR", directory=True)
    except MemraError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    target = make_tiny_qwen3(out / "target", tokenizer=True)
    make_tiny_draft(out / "dflash", "zlab")
    # taps short of the last layer (3), as the embedded DSpark drafter's are: no load warns about the pair
    make_tiny_draft(out / "dspark", "deepspec", markov_rank=32, confidence="markov", target_layer_ids=(-1, 1, 2),
                    extra_tensors=_target_tables(target))
    make_tiny_qwen35(out / "qwen3_5", layout="multimodal", tokenizer=True)
    make_tiny_draft(out / "qwen3_5_dflash", "zlab", target_layer_ids=QWEN35_DRAFT_TAPS,
                    num_target_layers=len(DEFAULT_LAYER_TYPES))
    gemma4 = make_tiny_gemma4(out / "gemma4", tokenizer=True)
    make_tiny_draft(out / "gemma4_dflash", "zlab", target_layer_ids=GEMMA4_DRAFT_TAPS,
                    num_target_layers=len(GEMMA4_LAYER_TYPES))
    make_tiny_gemma4_dspark(out / "gemma4_dspark", target=gemma4)
    make_tiny_qwen3_moe(out / "qwen3_moe", tokenizer=True)
    make_tiny_draft(out / "qwen3_moe_dflash", "zlab")
    make_tiny_qwen35(out / "qwen3_5_moe", layout="multimodal", moe=TINY_MOE, tokenizer=True, seed=5)
    make_tiny_draft(out / "qwen3_5_moe_dflash", "zlab", target_layer_ids=QWEN35_DRAFT_TAPS,
                    num_target_layers=len(DEFAULT_LAYER_TYPES), seed=6)
    make_tiny_gemma4(out / "gemma4_moe", moe=TINY_MOE, tie=False, tokenizer=True, seed=7)
    make_tiny_draft(out / "gemma4_moe_dflash", "zlab", target_layer_ids=GEMMA4_DRAFT_TAPS,
                    num_target_layers=len(GEMMA4_LAYER_TYPES), seed=8)
    make_tiny_llama(out / "llama", layers=LLAMA_LAYERS, tokenizer=True, seed=11)
    make_tiny_draft(out / "llama_dflash", "zlab", target_layer_ids=LLAMA_DRAFT_TAPS, num_target_layers=LLAMA_LAYERS,
                    seed=12)
    print(f"wrote {out / 'target'} (Qwen3 + tokenizer), {out / 'dflash'} (z-lab DFlash), {out / 'dspark'} (DeepSpec DSpark), "
          f"{out / 'qwen3_5'} (Qwen3.5 hybrid, multimodal layout + tokenizer), {out / 'qwen3_5_dflash'} (z-lab DFlash for it), "
          f"{out / 'gemma4'} (Gemma 4 text + tokenizer), {out / 'gemma4_dflash'} (z-lab DFlash for it), "
          f"{out / 'gemma4_dspark'} (DeepSpec Gemma 4 DSpark for it), "
          f"{out / 'qwen3_moe'} (Qwen3-MoE + tokenizer), {out / 'qwen3_moe_dflash'} (z-lab DFlash for it), "
          f"{out / 'qwen3_5_moe'} (Qwen3.5 MoE hybrid + tokenizer), {out / 'qwen3_5_moe_dflash'} "
          f"(z-lab DFlash for it), "
          f"{out / 'gemma4_moe'} (Gemma 4 with its MoE block + tokenizer), {out / 'gemma4_moe_dflash'} "
          f"(z-lab DFlash for it), "
          f"{out / 'llama'} (LLaMA + tokenizer), {out / 'llama_dflash'} (z-lab DFlash for it)")
    return 0


def _target_tables(target: Path) -> dict:
    """The target's embed_tokens / lm_head under the names a DeepSpec export carries its copies
    by: a DSpark drafter trained on this target ships exactly these (random copies would make
    every load warn that the drafter's tables differ from the target's)."""
    from safetensors.torch import load_file

    weights = load_file(str(target / "model.safetensors"))
    return {"embed_tokens.weight": weights["model.embed_tokens.weight"], "lm_head.weight": weights["lm_head.weight"]}


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
