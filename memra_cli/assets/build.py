"""Build the embedded default models: `python -m memra_cli.assets.build [--out DIR] [--smoke]`.

Reproducible recipe (the embedded-pair build), sized for one lent H200 in well under 15
minutes of GPU time:

1. corpus = the build machine's CPython stdlib `.py` files (Python version and a hash of the
   file list are recorded); every 20th file is held out;
2. a byte-level BPE tokenizer, vocabulary 4096, with `<|endoftext|>` (0) and `<|MASK|>` (1);
3. a Qwen3-architecture target (~5.8M parameters) trained with transformers' Qwen3ForCausalLM;
4. drafter data = the target's own greedy continuations of corpus prompts;
5. a DFlash drafter (z-lab format, mask-fill) and a DSpark drafter (DeepSpec format, shifted
   labels, vanilla markov head, confidence head), 2 layers over 3 taps, blocks of 16;
6. held-out target loss and per-slot acceptance of each drafter go to build_info.json.

Weights are saved in bf16. `--smoke` runs every stage at toy size for a few steps (the CI test).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from memra_cli.assets.train import (
    SPECIALS, TrainDrafter, collect_corpus, encode_corpus, greedy_continuations, heldout_loss, make_target,
    train_target, train_tokenizer, windows,
)
from memra_cli.assets.train_draft import DraftSpec, evaluate, param_count, train_drafter

ASSETS = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Recipe:
    vocab: int = 4096
    hidden: int = 256
    target_layers: int = 6
    heads: int = 4
    kv_heads: int = 2
    ffn: int = 768
    max_pos: int = 4096
    target_steps: int = 2400
    target_batch: int = 64
    seq_len: int = 512
    target_lr: float = 3e-3
    n_prompts: int = 3072
    prompt_len: int = 128
    cont_len: int = 256
    gen_batch: int = 512
    draft_layers: int = 2
    block: int = 16
    dflash_taps: tuple[int, ...] = (1, 3, 4)
    dspark_taps: tuple[int, ...] = (-1, 2, 4)
    markov_rank: int = 64
    draft_steps: int = 2500
    draft_batch: int = 32
    anchors: int = 32
    draft_lr: float = 2e-3
    eval_prompts: int = 256
    max_files: int | None = None
    heldout_every: int = 20
    target_budget_s: float | None = 150.0  # wall-clock caps: the whole build fits one 10-minute call
    draft_budget_s: float | None = 90.0


SMOKE = Recipe(vocab=300, hidden=32, target_layers=4, heads=2, kv_heads=1, ffn=64, max_pos=512, target_steps=1,
               target_batch=2, seq_len=64, n_prompts=8, prompt_len=16, cont_len=24, gen_batch=8, draft_layers=1,
               block=4, dflash_taps=(0, 2), dspark_taps=(-1, 2), markov_rank=8, draft_steps=1, draft_batch=2,
               anchors=4, eval_prompts=4, max_files=12, heldout_every=4,
               target_budget_s=None, draft_budget_s=None)


def _log(msg: str) -> None:
    print(f"[build {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _draft_config(kind: str, r: Recipe, taps: tuple[int, ...]) -> dict:
    base = {
        "model_type": "qwen3", "hidden_size": r.hidden, "num_hidden_layers": r.draft_layers,
        "num_attention_heads": r.heads, "num_key_value_heads": r.kv_heads, "head_dim": r.hidden // r.heads,
        "intermediate_size": r.ffn, "hidden_act": "silu", "rms_norm_eps": 1e-6, "vocab_size": r.vocab,
        "max_position_embeddings": r.max_pos, "attention_bias": False, "tie_word_embeddings": False,
        "num_target_layers": r.target_layers, "layer_types": ["full_attention"] * r.draft_layers,
        "sliding_window": None,
    }
    if kind == "dflash":  # z-lab DFlash v1 layout (legacy keys, as its exports carry)
        return {**base, "architectures": ["DFlashDraftModel"], "rope_theta": 10000.0, "rope_scaling": None,
                "torch_dtype": "bfloat16", "block_size": r.block,
                "dflash_config": {"mask_token_id": SPECIALS.index("<|MASK|>"), "target_layer_ids": list(taps)}}
    return {**base, "architectures": ["Qwen3DSparkModel"], "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
            "dtype": "bfloat16", "block_size": r.block, "mask_token_id": SPECIALS.index("<|MASK|>"),
            "target_layer_ids": list(taps), "num_anchors": r.anchors, "markov_rank": r.markov_rank,
            "markov_head_type": "vanilla", "enable_confidence_head": True, "confidence_head_with_markov": True}


def _save_drafter(out: Path, drafter: TrainDrafter, config: dict, target=None) -> None:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to(torch.bfloat16).contiguous().cpu() for k, v in drafter.state_dict().items()}
    if target is not None:  # DeepSpec exports carry copies of the target's tables
        emb = target.get_input_embeddings().weight.detach().to(torch.bfloat16).cpu()
        tensors["embed_tokens.weight"] = emb.clone()
        tensors["lm_head.weight"] = target.get_output_embeddings().weight.detach().to(torch.bfloat16).cpu().clone()
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})


def _save_target(out: Path, model, tok) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    model.float()
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
        "mask_token": "<|MASK|>", "model_max_length": 4096, "clean_up_tokenization_spaces": False,
    }, indent=2) + "\n")


def build(out: Path, r: Recipe, device: torch.device) -> dict:
    t0, info = time.time(), {"recipe": asdict(r), "device": str(device)}
    torch.manual_seed(0)
    corpus = collect_corpus(heldout_every=r.heldout_every, max_files=r.max_files)
    info["corpus"] = {"python": corpus.python_version, "files": corpus.n_files, "bytes": corpus.n_bytes,
                      "files_sha256": corpus.files_sha256, "heldout_files": len(corpus.heldout)}
    _log(f"corpus: Python {corpus.python_version} stdlib, {corpus.n_files} files, {corpus.n_bytes / 1e6:.1f} MB")
    tok = train_tokenizer(corpus.train, r.vocab)
    eos = tok.token_to_id("<|endoftext|>")
    train_ids, held_ids = encode_corpus(tok, corpus.train, eos), encode_corpus(tok, corpus.heldout, eos)
    info["tokens"] = {"train": int(train_ids.numel()), "heldout": int(held_ids.numel()), "vocab": tok.get_vocab_size()}
    _log(f"tokenizer: vocab {tok.get_vocab_size()}, {train_ids.numel()} train tokens")

    target = make_target(tok.get_vocab_size(), r.hidden, r.target_layers, r.heads, r.kv_heads, r.ffn, r.max_pos)
    info["target_params"] = param_count(target)
    t = time.time()
    losses, steps = train_target(target, train_ids, r.target_steps, r.target_batch, r.seq_len, r.target_lr, device, _log,
                                 r.target_budget_s)
    info["target_train_s"], info["target_steps_run"] = round(time.time() - t, 1), steps
    info["target_loss"] = {"train_last": losses[-1], "heldout": heldout_loss(target, held_ids, r.seq_len, device)}
    _log(f"target: {info['target_params'] / 1e6:.2f}M params, held-out loss {info['target_loss']['heldout']:.3f}")

    gen = torch.Generator().manual_seed(7)
    t = time.time()
    seqs = greedy_continuations(target, windows(train_ids, r.n_prompts, r.prompt_len, gen), r.cont_len, r.gen_batch, device)
    held = greedy_continuations(target, windows(held_ids, r.eval_prompts, r.prompt_len, gen), r.cont_len, r.gen_batch, device)
    info["datagen_s"] = round(time.time() - t, 1)
    _log(f"drafter data: {seqs.shape[0]} train / {held.shape[0]} held-out sequences of {seqs.shape[1]} tokens")

    mask_id = tok.token_to_id("<|MASK|>")
    for kind, taps in (("dflash", r.dflash_taps), ("dspark", r.dspark_taps)):
        spec = DraftSpec(kind, r.block, taps, mask_id)
        dspark = kind == "dspark"
        drafter = TrainDrafter(r.hidden, r.draft_layers, r.heads, r.kv_heads, r.ffn, len(taps), tok.get_vocab_size(),
                               markov_rank=r.markov_rank if dspark else 0, confidence=dspark)
        t = time.time()
        dl, steps = train_drafter(drafter, target, seqs, spec, steps=r.draft_steps, batch=r.draft_batch, anchors=r.anchors,
                                  prompt_len=r.prompt_len, lr=r.draft_lr, device=device, log=_log, budget_s=r.draft_budget_s)
        metrics = evaluate(drafter, target, held, spec, anchors=r.anchors, prompt_len=r.prompt_len, device=device)
        info[kind] = {"params": param_count(drafter), "train_s": round(time.time() - t, 1), "steps_run": steps,
                      "loss_last": dl[-1], **metrics}
        _log(f"{kind}: tau_full {metrics['tau_full']}, p_prefix {metrics['p_prefix'][:6]}")
        _save_drafter(out / kind, drafter, _draft_config(kind, r, taps), target if dspark else None)
    _save_target(out / "target", target, tok)
    info["total_s"] = round(time.time() - t0, 1)
    (out / "build_info.json").write_text(json.dumps(info, indent=2) + "\n")
    return info


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m memra_cli.assets.build", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=ASSETS, help="output folder (default: the package's assets)")
    p.add_argument("--smoke", action="store_true", help="toy sizes, one step per stage (CI)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--target-steps", type=int)
    p.add_argument("--draft-steps", type=int)
    a = p.parse_args(argv)
    recipe = SMOKE if a.smoke else Recipe()
    if a.target_steps is not None:
        recipe = replace(recipe, target_steps=a.target_steps)
    if a.draft_steps is not None:
        recipe = replace(recipe, draft_steps=a.draft_steps)
    info = build(a.out, recipe, torch.device(a.device))
    _log(f"done in {info['total_s']} s -> {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
