"""Training pieces for the embedded default models (used by `python -m memra_cli.assets.build`):
the corpus, tokenizer, target and its greedy data. The drafter, its losses and its exporter are
`memra train`'s (memra_cli/train/), shared so the two cannot drift.

Corpus: the CPython standard library's Python sources on the build machine. Tokenizer: byte-level
BPE. Target: transformers' Qwen3ForCausalLM (so the shipped weights are HF format by
construction). Drafters: a trainable twin of the engine's drafter (same tensor names, same
attention semantics) trained on the target's own greedy continuations, with many random anchors
per sequence and a block-structured attention mask:

- DFlash (mask-fill): row k of the block [anchor, MASK...] predicts the token at anchor+k, rows
  1..b-1 supervised.
- DSpark (shifted): row k predicts anchor+k+1, all b rows supervised; a vanilla markov head adds
  `w2 · w1[prev]` (teacher-forced prev = the true token at anchor+k) and a confidence head is
  trained with BCE against whether each slot's greedy draft equals its label.

Nothing here runs at inference time; transformers and tokenizers are needed only to build.
"""

from __future__ import annotations

import ast
import hashlib
import textwrap
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from memra_cli.train.drafter import TrainDrafter  # noqa: F401  (the build and its tests import it from here)
from memra_cli.train.schedule import PLAN_AT_STEP, WARM_STEPS, cosine_lr, fit_steps, optimize  # noqa: F401
from memra_cli.train.taps import hf_taps as target_taps  # noqa: F401

SPECIALS = ("<|endoftext|>", "<|MASK|>")


# --------------------------------------------------------------------------- corpus + tokenizer


@dataclass
class Corpus:
    train: list[str]
    heldout: list[str]
    python_version: str
    files_sha256: str
    n_files: int
    n_bytes: int
    heldout_names: list[str]  # the held-out files' paths relative to the stdlib root


def collect_corpus(root: Path | None = None, heldout_every: int = 20, max_files: int | None = None) -> Corpus:
    """Every .py under the stdlib (site-packages excluded), sorted; every `heldout_every`-th file
    (by sorted order) is held out. The file list's hash pins the corpus."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    files = sorted(f for f in root.rglob("*.py") if "site-packages" not in f.parts)
    if max_files is not None:
        files = files[:max_files]
    digest = hashlib.sha256()
    train, heldout, heldout_names, n_bytes = [], [], [], 0
    for i, f in enumerate(files):
        data = f.read_bytes()
        n_bytes += len(data)
        digest.update(f"{f.relative_to(root)}\0{len(data)}\0".encode())
        text = data.decode("utf-8", errors="replace")
        if i % heldout_every == heldout_every - 1:
            heldout.append(text)
            heldout_names.append(f.relative_to(root).as_posix())
        else:
            train.append(text)
    version = ".".join(map(str, sys.version_info[:3]))
    return Corpus(train, heldout, version, digest.hexdigest(), len(files), n_bytes, heldout_names)


def tokenized_heads(tok, texts: list[str], max_tokens: int):
    """Every function head of `texts` as a stand-alone prompt: yields (file index, head, prompt
    text, token ids) for heads of 4..`max_tokens` tokens, in file order."""
    for i, text in enumerate(texts):
        for head in function_heads(text):
            prompt = head_prompt(text, head)
            if prompt:
                ids = tok.encode(prompt, add_special_tokens=False).ids
                if 4 <= len(ids) <= max_tokens:
                    yield i, head, prompt, ids


def stdlib_prompts(corpus: Corpus, tok, limit: int, max_tokens: int) -> list[dict]:
    """The `stdlib` bench prompt set: held-out functions' heads (signature + docstring, dedented),
    in file order, at most `limit`, each at most `max_tokens` tokens. Rows carry their source."""
    rows = [{"turns": [prompt], "source": f"{corpus.heldout_names[i]}:{head.qualname}", "python": corpus.python_version}
            for i, head, prompt, _ in tokenized_heads(tok, corpus.heldout, max_tokens)]
    if len(rows) <= limit:
        return rows
    step = len(rows) / limit  # spread over every held-out file rather than the first few
    return [rows[int(i * step)] for i in range(limit)]


def train_tokenizer(texts: list[str], vocab_size: int):
    """Byte-level BPE with `<|endoftext|>` = 0 and `<|MASK|>` = 1."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIALS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    return tok


def encode_corpus(tok, texts: list[str], eos: int) -> torch.Tensor:
    """All files as one id stream, each followed by `<|endoftext|>`."""
    ids: list[int] = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        ids += enc.ids + [eos]
    return torch.tensor(ids, dtype=torch.int32)


def windows(stream: torch.Tensor, n: int, length: int, gen: torch.Generator) -> torch.Tensor:
    """`n` random windows `[n, length]` (long) from a 1-D id stream."""
    starts = torch.randint(0, stream.numel() - length - 1, (n,), generator=gen)
    return torch.stack([stream[s : s + length] for s in starts.tolist()]).long()


@dataclass(frozen=True)
class FunctionHead:
    """A function with a docstring: `text[start:end]` is its `def` line(s) through the docstring's
    last line (the shape of a HumanEval prompt), `qualname` like `Class.method`."""

    qualname: str
    start: int  # char offset of the line holding `def`
    end: int  # char offset just past the docstring's last line (its newline included)


def function_heads(text: str) -> list[FunctionHead]:
    """Every function or method of a source file that has a docstring followed by a body.
    Files that do not parse give none."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    line_start = [0]
    for line in text.splitlines(keepends=True):
        line_start.append(line_start[-1] + len(line))
    heads: list[FunctionHead] = []

    def visit(body, prefix: str) -> None:
        for node in body:
            if isinstance(node, ast.ClassDef):
                visit(node.body, f"{prefix}{node.name}.")
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = node.body[0]
                if (ast.get_docstring(node) and len(node.body) >= 2 and isinstance(doc, ast.Expr)
                        and doc.end_lineno is not None and doc.end_lineno < len(line_start)):
                    heads.append(FunctionHead(prefix + node.name, line_start[node.lineno - 1], line_start[doc.end_lineno]))
                visit(node.body, f"{prefix}{node.name}.")

    visit(tree.body, "")
    return heads


def head_prompt(text: str, head: FunctionHead) -> str | None:
    """The head as a stand-alone prompt (dedented); None when it does not start with a def."""
    prompt = textwrap.dedent(text[head.start : head.end])
    return prompt if prompt.startswith(("def ", "async def ")) else None


# --------------------------------------------------------------------------- target


def make_target(vocab: int, hidden: int, layers: int, heads: int, kv: int, ffn: int, max_pos: int):
    from memra_cli.hf_compat import protect_kernels_name
    protect_kernels_name()  # our kernels/ folder must not shadow HF kernels
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv, head_dim=hidden // heads,
        max_position_embeddings=max_pos, rope_theta=10000.0, tie_word_embeddings=True,
        rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=0, pad_token_id=0, use_cache=True,
        attn_implementation="sdpa",
    )
    return Qwen3ForCausalLM(cfg)


def train_target(model, stream: torch.Tensor, steps: int, batch: int, length: int, lr: float, device, log,
                 budget_s: float | None = None, val_stream: torch.Tensor | None = None, val_every: int = 200,
                 patience: int = 3) -> tuple[list[float], int, list[tuple[int, float]]]:
    """Next-token training on random windows of the id stream. With `val_stream`, early stopping:
    the loss on it is measured every `val_every` steps, the best weights are kept, and training
    ends after `patience` measurements without improvement (a 5.8M model memorises a 3M-token
    corpus in a few thousand steps; a memorising target regurgitates rather than writes, which is
    not what it does on a bench prompt). Returns (losses, steps run, validation curve)."""
    model.to(device).train()
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.1, fused=device.type == "cuda")
    gen = torch.Generator().manual_seed(1)

    def loss_fn(step: int) -> torch.Tensor:
        x = windows(stream, batch, length + 1, gen).to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = model(input_ids=x[:, :-1]).logits
        return F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten())

    curve: list[tuple[int, float]] = []
    best: dict = {"loss": float("inf"), "state": None, "since": 0}

    def stop(step: int) -> bool:
        if val_stream is None or step % val_every:
            return False
        loss = heldout_loss(model, val_stream, length, device, max_windows=32)
        model.train()
        curve.append((step, round(loss, 4)))
        log(f"target step {step}: validation loss {loss:.3f}")
        if loss < best["loss"]:
            best.update(loss=loss, since=0, state={k: v.detach().clone() for k, v in model.state_dict().items()})
            return False
        best["since"] += 1
        return best["since"] >= patience

    losses, run = optimize(params, opt, steps, lr, device, loss_fn, log, "target", budget_s, stop=stop)
    if best["state"] is not None:
        model.load_state_dict(best["state"])
    model.eval()
    return losses, run, curve


@torch.no_grad()
def heldout_loss(model, stream: torch.Tensor, length: int, device, max_windows: int = 64) -> float:
    n = min(max_windows, (stream.numel() - 1) // length)
    x = stream[: n * length + 1]
    inp = torch.stack([x[i * length : (i + 1) * length] for i in range(n)]).long().to(device)
    tgt = torch.stack([x[i * length + 1 : (i + 1) * length + 1] for i in range(n)]).long().to(device)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        logits = model(input_ids=inp).logits
    return F.cross_entropy(logits.float().flatten(0, 1), tgt.flatten()).item()


@torch.no_grad()
def greedy_forced(model, prompts: list[list[int]], total: int, batch: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts of any lengths (each < `total`) -> (`[n, total]` sequences, `[n]` prompt lengths):
    each prompt from position 0, then the model's greedy continuation up to `total` tokens. Rows
    of different prompt lengths share one batch: decoding runs one position at a time for the
    whole batch and a row still inside its prompt takes its prompt token instead of its argmax
    (so no padding, and every row is what a bench run of that prompt would see)."""
    from memra_cli.hf_compat import protect_kernels_name
    protect_kernels_name()  # our kernels/ folder must not shadow HF kernels
    from transformers import DynamicCache

    seqs, plens = [], []
    for lo in range(0, len(prompts), batch):
        chunk = prompts[lo : lo + batch]
        p = torch.tensor([len(x) for x in chunk])
        x = torch.zeros(len(chunk), total, dtype=torch.long)
        for i, ids in enumerate(chunk):
            x[i, : len(ids)] = torch.tensor(ids[:total])
        x, p_dev = x.to(device), p.to(device)
        start = int(p.min())
        cache = DynamicCache()
        logits = model(input_ids=x[:, :start], past_key_values=cache, use_cache=True).logits[:, -1]
        for t in range(start, total):
            x[:, t] = torch.where(t < p_dev, x[:, t], logits.argmax(-1))
            if t + 1 < total:
                logits = model(input_ids=x[:, t : t + 1], past_key_values=cache, use_cache=True).logits[:, -1]
        seqs.append(x.cpu())
        plens.append(p)
    if not seqs:
        return torch.empty(0, total, dtype=torch.long), torch.empty(0, dtype=torch.long)
    return torch.cat(seqs), torch.cat(plens)


