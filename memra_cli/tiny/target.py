"""Tiny random Qwen3 and LLaMA targets (and a matching tiny tokenizer) in the real HF format.

`make_tiny_qwen3(dir)` writes config.json (model_type qwen3, `Qwen3ForCausalLM`) and
model.safetensors; `make_tiny_llama(dir)` the same for model_type llama (`LlamaForCausalLM`:
no q/k norms, `llama3` rope scaling over 64 original positions by default), each or N shards plus model.safetensors.index.json, loadable by both memra and
`transformers`. Weights are random but scaled so the model is not degenerate: projections at
~1/sqrt(fan_in) (attention and MLP move the residual stream, so the context matters), unit
embeddings and an lm_head giving logits of std ~2, so greedy streams wander over the vocabulary
instead of locking into a one-token loop.

`make_tiny_tokenizer(dir, vocab_size)` trains a byte-level BPE on a small built-in text and
puts the special tokens at the top of the vocabulary, as Qwen does:
`<|endoftext|>` = V-4, `<|im_start|>` = V-3, `<|im_end|>` = V-2, `<|MASK|>` = V-1.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from memra_cli.engine.files import default_mode

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|MASK|>")
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
        "beta_fast": 32.0, "beta_slow": 1.0}
# LLaMA-3.1's scaling over a small original context: with head_dim 16 and theta 1e4 the
# wavelengths (2π·1e4^(j/8)) fall in all three bands (kept < 16 < blended < 64 < divided)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

TOKENIZER_CONFIG = {
    "tokenizer_class": "PreTrainedTokenizerFast",
    "model_max_length": 2048,
    "bos_token": None,
    "eos_token": "<|endoftext|>",
    "pad_token": "<|endoftext|>",
    "unk_token": None,
    "mask_token": "<|MASK|>",
    "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
    "chat_template": CHAT_TEMPLATE,
    "clean_up_tokenization_spaces": False,
}


def special_token_ids(vocab: int) -> dict[str, int]:
    """Where the tiny tokenizer puts its special tokens in a vocabulary of `vocab` ids."""
    return {tok: vocab - len(SPECIAL_TOKENS) + i for i, tok in enumerate(SPECIAL_TOKENS)}


# --------------------------------------------------------------------------- model


def _config(a: dict[str, Any]) -> dict[str, Any]:
    rope = {"rope_type": "default"} if a["rope"] is None else dict(a["rope"])
    eos = a["eos_token_id"]
    if eos is None:
        eos = special_token_ids(a["vocab"])["<|endoftext|>"]
    llama = a["family"] == "llama"
    cfg = {
        "architectures": ["LlamaForCausalLM" if llama else "Qwen3ForCausalLM"],
        "model_type": a["family"],
        "vocab_size": a["vocab"],
        "hidden_size": a["hidden"],
        "intermediate_size": a["intermediate"],
        "num_hidden_layers": a["layers"],
        "num_attention_heads": a["heads"],
        "num_key_value_heads": a["kv_heads"],
        "head_dim": a["head_dim"],
        "hidden_act": "silu",
        "max_position_embeddings": a["max_position_embeddings"],
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_theta": a["rope_theta"], **rope},
        "tie_word_embeddings": a["tie"],
        "attention_bias": a["attention_bias"],
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": a["layers"],
        "bos_token_id": special_token_ids(a["vocab"])["<|endoftext|>"],
        "eos_token_id": eos,
        "dtype": "bfloat16" if a["dtype"] == torch.bfloat16 else "float32",
        "use_cache": True,
    }
    if llama:  # LlamaConfig's own keys; no sliding-window switches
        for key in ("use_sliding_window", "sliding_window", "max_window_layers"):
            del cfg[key]
        cfg.update(mlp_bias=False, pretraining_tp=1)
    return cfg


def _tensors(a: dict[str, Any], gen: torch.Generator) -> dict[str, torch.Tensor]:
    """HF-named random tensors; projections ~N(0, 1/fan_in) so every layer does real work."""
    h, hd, ff, v = a["hidden"], a["head_dim"], a["intermediate"], a["vocab"]
    q, kv = a["heads"] * hd, a["kv_heads"] * hd

    def proj(out: int, fan_in: int, gain: float = 1.0) -> torch.Tensor:
        return torch.randn(out, fan_in, generator=gen) * (gain / math.sqrt(fan_in))

    def norm(n: int) -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(n, generator=gen)

    t = {"model.embed_tokens.weight": torch.randn(v, h, generator=gen)}
    for i in range(a["layers"]):
        p, s, m = f"model.layers.{i}.", f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        t.update({
            s + "q_proj.weight": proj(q, h), s + "k_proj.weight": proj(kv, h),
            s + "v_proj.weight": proj(kv, h), s + "o_proj.weight": proj(h, q, 0.7),
            p + "input_layernorm.weight": norm(h), p + "post_attention_layernorm.weight": norm(h),
            m + "gate_proj.weight": proj(ff, h), m + "up_proj.weight": proj(ff, h),
            m + "down_proj.weight": proj(h, ff, 0.7),
        })
        if a["family"] == "qwen3":
            t.update({s + "q_norm.weight": norm(hd), s + "k_norm.weight": norm(hd)})
        if a["attention_bias"]:
            for name, n in (("q_proj", q), ("k_proj", kv), ("v_proj", kv), ("o_proj", h)):
                t[s + name + ".bias"] = 0.1 * torch.randn(n, generator=gen)
    t["model.norm.weight"] = norm(h)
    if not a["tie"]:
        t["lm_head.weight"] = proj(v, h, 2.0)  # logits of std ~2 over a normed hidden
    return t


def save_weights(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """One safetensors file with the permissions of any new file (0666 less the umask), as the
    config.json beside it gets: safetensors writes its files 0600."""
    save_file(tensors, str(path), metadata={"format": "pt"})
    os.chmod(path, default_mode())


def _save(out: Path, tensors: dict[str, torch.Tensor], shards: int) -> None:
    """model.safetensors, or `shards` files + index.json exactly as HF names them."""
    if shards <= 1:
        save_weights(tensors, out / "model.safetensors")
        return
    names = list(tensors)
    per = math.ceil(len(names) / shards)
    weight_map: dict[str, str] = {}
    for k in range(shards):
        part = names[k * per:(k + 1) * per]
        fname = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        save_weights({n: tensors[n] for n in part}, out / fname)
        weight_map.update({n: fname for n in part})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def make_tiny_qwen3(
    directory: Path | str,
    *,
    vocab: int = 512,
    hidden: int = 64,
    layers: int = 4,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 16,
    intermediate: int = 128,
    tie: bool = False,
    rope: dict[str, Any] | None = None,
    rope_theta: float = 10000.0,
    max_position_embeddings: int = 2048,
    attention_bias: bool = False,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    shards: int = 1,
    eos_token_id: int | list[int] | None = None,
    tokenizer: bool = False,
    family: str = "qwen3",
) -> Path:
    """Write a tiny random Qwen3ForCausalLM to `directory`; returns the directory.

    `rope` is None (default rope) or a `rope_parameters` dict such as `YARN`; `eos_token_id`
    defaults to the tiny tokenizer's `<|endoftext|>` (V-4); `tokenizer=True` also writes one.
    `family="llama"` writes a LlamaForCausalLM instead (`make_tiny_llama`).
    """
    a = dict(locals())
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(_config(a), indent=2) + "\n")
    gen = torch.Generator().manual_seed(seed)
    tensors = {k: v.to(dtype).contiguous() for k, v in _tensors(a, gen).items()}
    _save(out, tensors, shards)
    if tokenizer:
        make_tiny_tokenizer(out, vocab)
    return out


def make_tiny_llama(directory: Path | str, *, rope: dict[str, Any] | None = LLAMA3, **kw: Any) -> Path:
    """Write a tiny random LlamaForCausalLM to `directory` (`make_tiny_qwen3`'s arguments;
    `llama3` rope scaling unless `rope` says otherwise); returns the directory."""
    return make_tiny_qwen3(directory, rope=rope, family="llama", **kw)


# --------------------------------------------------------------------------- tokenizer

_TEXT = """\
The quick brown fox jumps over the lazy dog while the patient heron waits by the river.
Speculative decoding lets a small drafter propose several tokens that a large target verifies
in one forward pass; every committed token is still the target's own greedy choice.
A block-diffusion drafter fills a whole block of masked positions at once, conditioned on the
hidden states of a few layers of the target model, and the target accepts the longest prefix.
def fibonacci(n):
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a
print(fibonacci(10), sum(range(100)), [x * x for x in range(12) if x % 3 == 0])
Question: Natalia sold clips to 48 of her friends in April, and then she sold half as many clips
in May. How many clips did Natalia sell altogether in April and May? Answer: 48 + 24 = 72.
Question: Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of
babysitting. How much did she earn? Answer: 12 / 60 = 0.2 per minute, 0.2 * 50 = 10 dollars.
Write a function that returns the longest common prefix of a list of strings; if there is no
common prefix, return an empty string. Explain the time complexity of your solution.
The morning fog lifted slowly from the harbour, revealing fishing boats painted red, blue and
yellow, their nets drying in the sun while gulls circled above the old stone lighthouse.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 32 64 128 256 512 1024 2048 4096 8192.
In mathematics, a prime number is a natural number greater than one that is not a product of
two smaller natural numbers; there are infinitely many primes, as Euclid proved long ago.
class Stack:
    def __init__(self):
        self.items = []
    def push(self, item):
        self.items.append(item)
    def pop(self):
        return self.items.pop()
User: Can you summarize the plot of the story in three sentences?
Assistant: Certainly. A young engineer builds a tiny model, tests it against a reference, and
learns that every fast path must agree with the slow one before anyone trusts the numbers.
"""


def make_tiny_tokenizer(directory: Path | str, vocab_size: int = 512) -> Path:
    """Train a byte-level BPE of exactly `vocab_size` ids into `directory`; returns it.

    Writes tokenizer.json and tokenizer_config.json (with a Qwen-style chat template). Special
    tokens sit at the top (`special_token_ids`); if the built-in text yields fewer merges than
    asked, `<|reserved_k|>` fillers close the gap so the ids stay where promised.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    n_special = len(SPECIAL_TOKENS)
    if vocab_size < 256 + n_special:
        raise ValueError(f"vocab_size {vocab_size} is below the 256 byte tokens + {n_special} specials")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - n_special, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_TEXT.splitlines() * 4, trainer)
    gap = vocab_size - n_special - tok.get_vocab_size()
    fillers = [f"<|reserved_{k}|>" for k in range(gap)]
    tok.add_special_tokens(fillers + list(SPECIAL_TOKENS))
    assert tok.get_vocab_size() == vocab_size
    assert tok.token_to_id("<|MASK|>") == vocab_size - 1
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(TOKENIZER_CONFIG, indent=2) + "\n")
    return out
