"""Training pieces for the embedded default models (used by `python -m memra_cli.assets.build`).

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
import math
import textwrap
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

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


def fit_steps(steps: int, step: int, t0: float, t_warm: float, now: float, budget_s: float | None) -> int:
    """Re-plan the total so the run fits `budget_s`, from the steady step time measured since
    step WARM_STEPS (the first steps pay CUDA start-up and allocator warm-up; timing from step
    0 once cut a 150 s budget to 31 s of training). The cosine schedule is re-planned around
    the new total, so it still finishes its decay."""
    if budget_s is None or step <= WARM_STEPS:
        return steps
    per_step = (now - t_warm) / (step - WARM_STEPS)
    remaining = budget_s - (now - t0)
    return max(step + 1, min(steps, step + int(remaining / per_step)))


WARM_STEPS = 10
PLAN_AT_STEP = 40


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def cosine_lr(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def optimize(params, opt, steps: int, lr: float, device, loss_fn, log, label: str, budget_s: float | None = None,
             log_every: int = 200, stop=None) -> tuple[list[float], int]:
    """The shared training loop: cosine LR with warm-up, clipped AdamW steps, a wall-clock
    budget planned from steady-state step time. `loss_fn(step) -> loss`. Returns (losses logged,
    steps actually run). `stop(step) -> bool`, when given, is asked after every step and ends the
    run early (early stopping)."""
    import time

    losses, t0, t_warm, step = [], time.time(), 0.0, 0
    while step < steps:
        if step == WARM_STEPS:
            _sync(device)
            t_warm = time.time()
        if step == PLAN_AT_STEP:
            _sync(device)
            steps = fit_steps(steps, step, t0, t_warm, time.time(), budget_s)
        for g in opt.param_groups:
            g["lr"] = cosine_lr(step, steps, lr, max(1, steps // 20))
        loss = loss_fn(step)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if step % log_every == 0 or step == steps - 1:
            losses.append(loss.item())
            log(f"{label} step {step}/{steps} loss {loss.item():.3f}")
        step += 1
        if stop is not None and stop(step):
            log(f"{label} stopped early at step {step}/{steps}")
            return losses, step
    return losses, steps


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


@torch.no_grad()
def target_taps(model, ids: torch.Tensor, taps: tuple[int, ...]) -> torch.Tensor:
    """`[B, L, n_taps*hidden]` raw layer outputs (-1 = embedding output), model dtype."""
    # the decoder stack only (`model.model`): the taps never need the lm_head's `[B, L, V]` logits
    hs = model.model(input_ids=ids, output_hidden_states=True).hidden_states
    # transformers replaces the last entry with the final-normed state: taps never use it here
    assert max(taps) < len(hs) - 2, "a tap on the last target layer needs the raw (pre-norm) state"
    return torch.cat([hs[t + 1] for t in taps], dim=-1)


# --------------------------------------------------------------------------- trainable drafter


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """x `[B, H, T, D]`, pos `[B, T]` (rotate-half layout, float32 angles)."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
    ang = pos.float()[..., None] * inv
    cos, sin = torch.cat([ang, ang], -1).cos()[:, None].to(x.dtype), torch.cat([ang, ang], -1).sin()[:, None].to(x.dtype)
    half = d // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


class TrainDrafter(nn.Module):
    """Trainable drafter whose `state_dict` has exactly the checkpoint's tensor names."""

    def __init__(self, hidden: int, layers: int, heads: int, kv: int, ffn: int, n_taps: int, vocab: int,
                 markov_rank: int = 0, confidence: bool = False):
        super().__init__()
        self.hidden, self.heads, self.kv, self.hd = hidden, heads, kv, hidden // heads
        self.fc = nn.Linear(n_taps * hidden, hidden, bias=False)
        self.hidden_norm = nn.RMSNorm(hidden)
        self.norm = nn.RMSNorm(hidden)
        self.layers = nn.ModuleList([_TrainLayer(hidden, heads, kv, ffn) for _ in range(layers)])
        self.markov_head = _Markov(vocab, markov_rank) if markov_rank else None
        self.confidence_head = _Confidence(hidden + markov_rank) if confidence else None

    def forward(self, taps: torch.Tensor, noise: torch.Tensor, ctx_pos: torch.Tensor, blk_pos: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        """taps `[B, L, n_taps*h]`, noise `[B, Q, h]`, positions `[B, L]` / `[B, Q]`, mask
        `[B, 1, Q, L+Q]` (True = attend). Returns final-normed hidden `[B, Q, h]`."""
        ctx = _rms(self.fc(taps), self.hidden_norm.weight)
        x = noise
        for layer in self.layers:
            x = layer(x, ctx, ctx_pos, blk_pos, mask, self)
        return _rms(x, self.norm.weight)


class _TrainLayer(nn.Module):
    def __init__(self, hidden: int, heads: int, kv: int, ffn: int):
        super().__init__()
        hd = hidden // heads
        self.input_layernorm, self.post_attention_layernorm = nn.RMSNorm(hidden), nn.RMSNorm(hidden)
        self.self_attn = nn.Module()
        self.self_attn.q_proj = nn.Linear(hidden, heads * hd, bias=False)
        self.self_attn.k_proj = nn.Linear(hidden, kv * hd, bias=False)
        self.self_attn.v_proj = nn.Linear(hidden, kv * hd, bias=False)
        self.self_attn.o_proj = nn.Linear(heads * hd, hidden, bias=False)
        self.self_attn.q_norm, self.self_attn.k_norm = nn.RMSNorm(hd), nn.RMSNorm(hd)
        self.mlp = nn.Module()
        self.mlp.gate_proj = nn.Linear(hidden, ffn, bias=False)
        self.mlp.up_proj = nn.Linear(hidden, ffn, bias=False)
        self.mlp.down_proj = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x, ctx, ctx_pos, blk_pos, mask, d: TrainDrafter):
        a, B, Q = self.self_attn, x.shape[0], x.shape[1]
        L = ctx.shape[1]
        xn = _rms(x, self.input_layernorm.weight)
        q = _rms(a.q_proj(xn).view(B, Q, d.heads, d.hd), a.q_norm.weight).transpose(1, 2)
        kin = torch.cat([ctx, xn], 1)  # ctx rows are not input-layernormed
        k = _rms(a.k_proj(kin).view(B, L + Q, d.kv, d.hd), a.k_norm.weight).transpose(1, 2)
        v = a.v_proj(kin).view(B, L + Q, d.kv, d.hd).transpose(1, 2)
        pos = torch.cat([ctx_pos, blk_pos], 1)
        q, k = _rope(q, blk_pos, 10000.0), _rope(k, pos, 10000.0)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        x = x + a.o_proj(o.transpose(1, 2).reshape(B, Q, -1))
        h = _rms(x, self.post_attention_layernorm.weight)
        return x + self.mlp.down_proj(F.silu(self.mlp.gate_proj(h)) * self.mlp.up_proj(h))


class _Markov(nn.Module):
    def __init__(self, vocab: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab, rank)
        self.markov_w2 = nn.Linear(rank, vocab, bias=False)
        nn.init.normal_(self.markov_w1.weight, std=0.02)
        nn.init.zeros_(self.markov_w2.weight)  # starts as a no-op on the backbone's logits


class _Confidence(nn.Module):
    def __init__(self, in_dim: int):
        super().__init__()
        self.proj = nn.Linear(in_dim, 1)
