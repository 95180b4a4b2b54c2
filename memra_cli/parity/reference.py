"""An oracle maker that is not the engine: a plain-torch drafter from HF transformers' Qwen3 blocks.

`make_oracle(ckpt, out)` draws random inputs (raw target taps, an anchor token), runs a drafter
written the obvious way, in float64, and writes every stage it can compute as a `memra-oracle/1`
file. It shares no numerics with `draft.py` / `layers.py` (neither is imported here):

- norms, MLP and rotary tables are transformers' own `Qwen3RMSNorm`, `Qwen3MLP` and
  `Qwen3RotaryEmbedding` (YaRN through the HF config's `rope_parameters`, parsed by transformers
  from the checkpoint's raw config.json, not by our config reader);
- attention is a dense masked softmax in float64 over explicitly repeated K/V heads, with the
  mask built row by row from absolute positions: keys `window` or more positions back are
  dropped on sliding layers, later block rows are hidden on layers causal in the block (sliding
  layers unless the config says `is_causal: false`; full layers only if it says `true`);
- ctx rows (hidden_norm(fc(taps))) feed K/V without input_layernorm; q/k get per-head RMS norm,
  then rope at absolute positions;
- heads: logits = lm_head(hidden_out); markov chain over ALL b rows, greedy, first previous token
  = the anchor, each step adding w2 @ w1[prev]; confidence = proj([hidden ; w1[prev]]) + bias with
  prev = [anchor, chain[:-1]].

transformers is a test dependency: it is imported inside functions and its absence is refused.
The reference reads tensors through `checkpoint.open_checkpoint` and geometry through the census
(file I/O and config keys, not numerics).
"""

from __future__ import annotations

import json
import logging
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

from memra_cli.engine.formats.names import CONF_B, CONF_W, MARKOV_W1, MARKOV_W2, OWN_EMBED, OWN_LM_HEAD
from memra_cli.engine.formats.census import Census, take_census
from memra_cli.engine.formats.checkpoint import open_checkpoint
from memra_cli.engine.formats.config import DraftConfig
from memra_cli.engine.errors import MemraError
from memra_cli.parity.oracle import FORMAT, target_tables, write_oracle

SOURCE = "memra reference (float64 plain torch + transformers Qwen3RMSNorm/Qwen3MLP/Qwen3RotaryEmbedding)"
GEMMA4_SOURCE = ("memra reference (float64 plain torch + transformers Gemma4RMSNorm/Gemma4TextMLP/"
                 "Gemma4TextRotaryEmbedding/Gemma4TextScaledWordEmbedding)")
OUTLIER_GAIN = 20.0  # a few "massive activation" channels per tap, as real residual streams have
F64 = torch.float64


class ReferenceError(MemraError):
    """The reference implementation cannot run (transformers missing, an unusable checkpoint)."""


def _qwen3_modules():
    try:
        from memra_cli.hf_compat import protect_kernels_name
        protect_kernels_name()  # our kernels/ folder must not shadow HF kernels
        from transformers import Qwen3Config
        from transformers.models.qwen3 import modeling_qwen3
    except ImportError as exc:
        raise ReferenceError(
            f"--make-oracle needs HF transformers (a test dependency: pip install 'memra[test]'); import failed: {exc}"
        ) from None
    return Qwen3Config, modeling_qwen3


@contextmanager
def _quiet_transformers():
    """transformers logs config advisories (e.g. a YaRN factor note) that are not ours to print."""
    logger = logging.getLogger("transformers")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _raw_config(path: Path) -> dict[str, Any]:
    if path.is_dir():
        return json.loads((path / "config.json").read_text(encoding="utf-8"))
    embedded = getattr(open_checkpoint(path), "embedded_config", None)
    if embedded is None:
        raise ReferenceError(f"{path}: no config.json to read")
    return dict(embedded)


def _hf_config(raw: dict[str, Any], cfg: DraftConfig):
    """A transformers Qwen3Config with the checkpoint's own rope keys (new or legacy form)."""
    Qwen3Config, _ = _qwen3_modules()
    rope_keys = {k: raw[k] for k in ("rope_parameters", "rope_scaling", "rope_theta") if raw.get(k) is not None}
    with _quiet_transformers():
        return Qwen3Config(
            hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
            num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
            head_dim=cfg.head_dim, num_hidden_layers=cfg.num_hidden_layers, rms_norm_eps=cfg.rms_norm_eps,
            max_position_embeddings=cfg.max_position_embeddings, hidden_act=raw.get("hidden_act", "silu"),
            vocab_size=cfg.vocab_size or 1, **rope_keys,
        )


def layer_rules(cfg: DraftConfig) -> list[tuple[int | None, bool]]:
    """(window, causal_in_block) per layer, from the config's own keys (docs/architecture.md § one round)."""
    out = []
    for kind in cfg.layer_types:
        sliding = kind == "sliding_attention"
        causal = sliding if cfg.causal is None else cfg.causal
        out.append((cfg.sliding_window if sliding else None, causal))
    return out


def allowed(q_pos: torch.Tensor, k_pos: torch.Tensor, n_ctx: int, window: int | None, causal: bool) -> torch.Tensor:
    """`[b, n]` True where block query i may attend key j (keys = ctx rows, then block rows)."""
    b, n = q_pos.shape[0], k_pos.shape[0]
    ok = torch.ones(b, n, dtype=torch.bool)
    for i in range(b):
        for j in range(n):
            back = int(q_pos[i]) - int(k_pos[j])
            if window is not None and back >= window:
                ok[i, j] = False
            if causal and j >= n_ctx and back < 0:
                ok[i, j] = False
    return ok


class ReferenceDrafter:
    """The drafter written the obvious way (float64), for oracles. Not for speed."""

    def __init__(self, path: Path, census: Census | None = None):
        _, mq = _qwen3_modules()
        self.mq = mq
        self.census = census or take_census(Path(path))
        self.cfg = self.census.config
        self.ckpt = open_checkpoint(Path(path))
        self.hf = _hf_config(_raw_config(Path(path)), self.cfg)
        with _quiet_transformers():
            self.rotary = mq.Qwen3RotaryEmbedding(self.hf)
        self.rules = layer_rules(self.cfg)

    def w(self, name: str) -> torch.Tensor:
        return self.ckpt.load(name, F64)

    def norm(self, name: str) -> Any:
        weight = self.w(name)
        module = self.mq.Qwen3RMSNorm(weight.shape[0], eps=self.cfg.rms_norm_eps).to(F64)
        module.weight.data.copy_(weight)
        return module

    def mlp(self, prefix: str) -> Any:
        with torch.device("meta"):  # no random init of big matrices that are overwritten anyway
            module = self.mq.Qwen3MLP(self.hf)
        module = module.to_empty(device="cpu").to(F64)
        for part in ("gate_proj", "up_proj", "down_proj"):
            getattr(module, part).weight.data.copy_(self.w(f"{prefix}mlp.{part}.weight"))
        return module

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x `[t, heads, hd]`, cos/sin `[t, hd]`: the rotate-half form transformers uses."""
        return x * cos[:, None, :] + self.mq.rotate_half(x) * sin[:, None, :]

    def attention(self, li: int, xn: torch.Tensor, ctx: torch.Tensor, pos: torch.Tensor, cos, sin) -> torch.Tensor:
        cfg, p = self.cfg, f"layers.{li}.self_attn."
        nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        n_ctx, b = ctx.shape[0], xn.shape[0]
        q_norm, k_norm = self.norm(p + "q_norm.weight"), self.norm(p + "k_norm.weight")
        wq, wk, wv, wo = (self.w(p + f"{m}_proj.weight") for m in "qkvo")
        kv_in = torch.cat([ctx, xn])  # ctx rows enter K/V as they are: no input_layernorm
        q = self.rope(q_norm((xn @ wq.T).view(b, nh, hd)), cos[n_ctx:], sin[n_ctx:])
        k = self.rope(k_norm((kv_in @ wk.T).view(n_ctx + b, nkv, hd)), cos, sin)
        v = (kv_in @ wv.T).view(n_ctx + b, nkv, hd)
        k, v = k.repeat_interleave(nh // nkv, dim=1), v.repeat_interleave(nh // nkv, dim=1)
        scores = torch.einsum("ihd,jhd->hij", q, k) * hd ** -0.5
        window, causal = self.rules[li]
        mask = allowed(pos[n_ctx:], pos, n_ctx, window, causal)
        probs = torch.softmax(scores.masked_fill(~mask[None], float("-inf")), dim=-1)
        out = torch.einsum("hij,jhd->ihd", probs, v).reshape(b, nh * hd)
        return out @ wo.T

    def forward(self, taps: torch.Tensor, noise: torch.Tensor, pos: torch.Tensor) -> dict[str, torch.Tensor]:
        """taps `[ctx, n_taps*hidden]`, noise `[b, hidden]`, pos `[ctx+b]` -> float64 stages."""
        taps, x = taps.to(F64), noise.to(F64)
        ctx = self.norm("hidden_norm.weight")(taps @ self.w("fc.weight").T)
        cos, sin = self.rotary(x, pos[None].long())
        cos, sin = cos[0].to(F64), sin[0].to(F64)
        layers = []
        for li in range(self.cfg.num_hidden_layers):
            p = f"layers.{li}."
            x = x + self.attention(li, self.norm(p + "input_layernorm.weight")(x), ctx, pos, cos, sin)
            x = x + self.mlp(p)(self.norm(p + "post_attention_layernorm.weight")(x))
            layers.append(x)
        return {"ctx_features": ctx, "layer_out": torch.stack(layers), "hidden_out": self.norm("norm.weight")(x)}

    # ----------------------------------------------------------------------- heads

    embed_scale = 1.0  # what the embedding output (a -1 tap) multiplies the table's rows by

    def block_rows(self, embed: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The block's input rows `[b, hidden]` float32 from embedding table rows of `ids`."""
        return embed[ids].float()

    def logits(self, hidden: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
        """float64 draft logits `[b, V]`."""
        return _logits(hidden, head)

    def markov_chain(self, logits: torch.Tensor, anchor: int) -> torch.Tensor:
        """Greedy over all rows: token_k = argmax(logits_k + w2 @ w1[prev]), prev_0 = anchor."""
        w1, w2 = self.w(MARKOV_W1), self.w(MARKOV_W2)
        prev, out = anchor, []
        for k in range(logits.shape[0]):
            prev = int(torch.argmax(logits[k] + w2 @ w1[prev]))
            out.append(prev)
        return torch.tensor(out, dtype=torch.long)

    def confidence(self, hidden: torch.Tensor, prev_ids: torch.Tensor) -> torch.Tensor:
        w, bias = self.w(CONF_W)[0], self.w(CONF_B)[0]
        feats = hidden
        if self.census.confidence is not None and self.census.confidence.with_markov:
            feats = torch.cat([hidden, self.w(MARKOV_W1)[prev_ids]], dim=-1)
        return feats @ w + bias


class Gemma4ReferenceDrafter(ReferenceDrafter):
    """DeepSpec's Gemma4DSparkModel written the obvious way (float64), from transformers' Gemma 4
    pieces: `Gemma4RMSNorm`'s normalization (its `_norm`, applied in float64, times the weight as
    Gemma 4 does: no `1 + w`), `Gemma4TextMLP` (GELU-tanh), `Gemma4TextRotaryEmbedding`'s
    `full_attention` tables over `global_head_dim` (transformers resolves the head dim and the
    proportional rope from the checkpoint's raw config), `apply_rotary_pos_emb`, and
    `Gemma4TextScaledWordEmbedding` for the block rows (√hidden-scaled). Attention, layer order,
    layer scalar and softcap are written here: scaling 1.0, every block row over every ctx and
    block key, K/V from [ctx ; normed block rows], v from the raw key projection with k_eq_v."""

    def __init__(self, path: Path, census: Census | None = None):
        self.census = census or take_census(Path(path))
        self.cfg = self.census.config
        self.ckpt = open_checkpoint(Path(path))
        self.mg, config_cls = _gemma4_modules()
        raw = _raw_config(Path(path))
        self.embed_scale = self.cfg.hidden_size ** 0.5  # a -1 tap is the scaled embedding
        with _quiet_transformers():
            self.hf = config_cls(**{k: v for k, v in raw.items() if k in config_cls().to_dict() or k in HF_HEAD_KEYS})
            self.rotary = self.mg.Gemma4TextRotaryEmbedding(self.hf)

    def gnorm(self, x: torch.Tensor, name: str | None) -> torch.Tensor:
        """Gemma 4's RMSNorm in float64 (`name` None: the unweighted v norm)."""
        module = self.mg.Gemma4RMSNorm(x.shape[-1], eps=self.cfg.rms_norm_eps, with_scale=False)
        out = module._norm(x)
        return out if name is None else out * self.w(name)

    def mlp(self, prefix: str) -> Any:
        with torch.device("meta"):
            module = self.mg.Gemma4TextMLP(self.hf, 0)
        module = module.to_empty(device="cpu").to(F64)
        for part in ("gate_proj", "up_proj", "down_proj"):
            getattr(module, part).weight.data.copy_(self.w(f"{prefix}mlp.{part}.weight"))
        return module

    def attention(self, li: int, xn: torch.Tensor, ctx: torch.Tensor, pos: torch.Tensor, cos, sin) -> torch.Tensor:
        cfg, p = self.cfg, f"layers.{li}.self_attn."
        nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        n_ctx, b = ctx.shape[0], xn.shape[0]
        kv_in = torch.cat([ctx, xn])  # ctx rows enter K/V as they are: no input_layernorm
        q = self.gnorm((xn @ self.w(p + "q_proj.weight").T).view(b, nh, hd), p + "q_norm.weight")
        k_raw = (kv_in @ self.w(p + "k_proj.weight").T).view(n_ctx + b, nkv, hd)
        v_raw = k_raw  # k_eq_v: V is the raw key projection
        if not cfg.gemma4.attention_k_eq_v:
            v_raw = (kv_in @ self.w(p + "v_proj.weight").T).view(n_ctx + b, nkv, hd)
        k, v = self.gnorm(k_raw, p + "k_norm.weight"), self.gnorm(v_raw, None)
        q = self.mg.apply_rotary_pos_emb(q, cos[n_ctx:], sin[n_ctx:], unsqueeze_dim=1)
        k = self.mg.apply_rotary_pos_emb(k, cos, sin, unsqueeze_dim=1)
        k, v = k.repeat_interleave(nh // nkv, dim=1), v.repeat_interleave(nh // nkv, dim=1)
        probs = torch.softmax(torch.einsum("ihd,jhd->hij", q, k), dim=-1)  # scaling 1.0, no mask
        out = torch.einsum("hij,jhd->ihd", probs, v).reshape(b, nh * hd)
        return out @ self.w(p + "o_proj.weight").T

    def forward(self, taps: torch.Tensor, noise: torch.Tensor, pos: torch.Tensor) -> dict[str, torch.Tensor]:
        """taps `[ctx, n_taps*hidden]`, noise `[b, hidden]` (scaled rows), pos `[ctx+b]` -> float64 stages."""
        taps, x = taps.to(F64), noise.to(F64)
        ctx = self.gnorm(taps @ self.w("fc.weight").T, "hidden_norm.weight")
        cos, sin = self.rotary(x, pos[None].long(), "full_attention")
        cos, sin = cos[0].to(F64), sin[0].to(F64)
        layers = []
        for li in range(self.cfg.num_hidden_layers):
            p = f"layers.{li}."
            attn = self.attention(li, self.gnorm(x, p + "input_layernorm.weight"), ctx, pos, cos, sin)
            x = x + self.gnorm(attn, p + "post_attention_layernorm.weight")
            mlp = self.mlp(p)(self.gnorm(x, p + "pre_feedforward_layernorm.weight"))
            x = (x + self.gnorm(mlp, p + "post_feedforward_layernorm.weight")) * self.w(p + "layer_scalar")
            layers.append(x)
        return {"ctx_features": ctx, "layer_out": torch.stack(layers), "hidden_out": self.gnorm(x, "norm.weight")}

    def block_rows(self, embed: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The drafter's own embedding: rows times √hidden (transformers' scaled embedding, float32)."""
        module = self.mg.Gemma4TextScaledWordEmbedding(embed.shape[0], embed.shape[1], None,
                                                        embed_scale=self.cfg.hidden_size ** 0.5)
        module.weight.data.copy_(embed.float())
        with torch.no_grad():
            return module(ids).float()

    def logits(self, hidden: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
        z, cap = _logits(hidden, head), self.cfg.gemma4.final_logit_softcapping
        return z if cap is None else torch.tanh(z / cap) * cap


HF_HEAD_KEYS = ("global_head_dim", "num_global_key_value_heads")  # consumed by Gemma4TextConfig's init


def _gemma4_modules():
    try:
        from memra_cli.hf_compat import protect_kernels_name
        protect_kernels_name()
        from transformers import Gemma4TextConfig
        from transformers.models.gemma4 import modeling_gemma4
    except ImportError as exc:
        raise ReferenceError(
            f"--make-oracle needs HF transformers with Gemma 4 (a test dependency: pip install 'memra[test]'); "
            f"import failed: {exc}") from None
    return modeling_gemma4, Gemma4TextConfig


def reference_for(path: Path) -> ReferenceDrafter:
    """The reference of a checkpoint's layers: Gemma 4 (DeepSpec's Gemma4DSparkModel) or Qwen3."""
    census = take_census(Path(path))
    cls = Gemma4ReferenceDrafter if census.config.backbone == "gemma4" else ReferenceDrafter
    return cls(Path(path), census)


def _logits(hidden: torch.Tensor, head: torch.Tensor, chunk: int = 16384) -> torch.Tensor:
    """float64 `hidden @ head.T`, widening the table a chunk of rows at a time."""
    return torch.cat([hidden @ head[i : i + chunk].to(F64).T for i in range(0, head.shape[0], chunk)], dim=-1)


def _tap_scales(cfg: DraftConfig, embed: torch.Tensor | None) -> list[float]:
    """Per-tap RMS: the embedding's row RMS for a -1 tap (1.0 if unknown); residual streams grow
    with depth, so layer i's output is drawn at sqrt(2 + i)."""
    emb_rms = float(embed.float()[:4096].pow(2).mean().sqrt()) if embed is not None else 1.0
    return [emb_rms if t == -1 else float(np.sqrt(2.0 + t)) for t in cfg.target_layer_ids]


def random_taps(cfg: DraftConfig, ctx: int, gen: torch.Generator, embed: torch.Tensor | None) -> torch.Tensor:
    """`[ctx, n_taps*hidden]` float32 raw taps with per-tap scales and a few outlier channels."""
    h, parts = cfg.hidden_size, []
    n_out = max(1, h // 64)
    for scale in _tap_scales(cfg, embed):
        x = torch.randn(ctx, h, generator=gen) * scale
        idx = torch.randperm(h, generator=gen)[:n_out]
        x[:, idx] *= OUTLIER_GAIN
        parts.append(x)
    return torch.cat(parts, dim=-1).float()


def _tables(census: Census, ckpt, target_dir: Path | None) -> tuple[torch.Tensor | None, str, torch.Tensor | None, str]:
    """(embed, its source, lm_head, its source); the --target's tables win over the checkpoint's."""
    embed = head = None
    e_src = h_src = "none"
    if target_dir is not None:
        embed, head = target_tables(Path(target_dir), torch.float32, "cpu", census.config.hidden_size)
        e_src = h_src = f"target {target_dir}"
    if embed is None and OWN_EMBED in ckpt:
        embed, e_src = ckpt.load(OWN_EMBED, torch.float32), "checkpoint embed_tokens"
    if head is None and OWN_LM_HEAD in ckpt:
        head, h_src = ckpt.load(OWN_LM_HEAD, torch.float32), "checkpoint lm_head"
    return embed, e_src, head, h_src


def _vocab(cfg: DraftConfig, embed, head, ckpt) -> int | None:
    for table in (head, embed):
        if table is not None:
            return int(table.shape[0])
    if MARKOV_W1 in ckpt:
        return int(ckpt.tensors[MARKOV_W1].shape[0])
    return cfg.vocab_size


def make_oracle(ckpt_path: Path | str, out_npz: Path | str, target_dir: Path | str | None = None,
                ctx: int = 32, seed: int = 0) -> dict[str, Any]:
    """Write a `memra-oracle/1` file for `ckpt_path` from random inputs; returns its meta
    (plus `stages`, the keys written)."""
    ckpt_path = Path(ckpt_path)
    if ctx < 1:
        raise ReferenceError(f"--ctx {ctx}: the context needs at least one row")
    ref = reference_for(ckpt_path)
    cfg, census, ckpt = ref.cfg, ref.census, ref.ckpt
    b = cfg.block_size
    if ctx + b > cfg.max_position_embeddings:  # the positions run 0 .. ctx + b - 1
        raise ReferenceError(f"--ctx {ctx}: expected at most {cfg.max_position_embeddings - b} (the drafter's "
                             f"max_position_embeddings {cfg.max_position_embeddings} less its block of {b})")
    gen = torch.Generator().manual_seed(seed)
    embed, e_src, head, h_src = _tables(census, ckpt, Path(target_dir) if target_dir else None)
    vocab = _vocab(cfg, embed, head, ckpt)
    if head is not None and vocab is not None and census.markov is not None and MARKOV_W1 in ckpt:
        if ckpt.tensors[MARKOV_W1].shape[0] != head.shape[0]:
            raise ReferenceError(f"{ckpt_path}: markov vocab {ckpt.tensors[MARKOV_W1].shape[0]} != lm_head vocab {head.shape[0]}")
    high = vocab if vocab is not None else cfg.mask_token_id + 1
    if high < 2:
        raise ReferenceError(f"{ckpt_path}: cannot draw an anchor token (vocab {vocab}, mask_token_id {cfg.mask_token_id})")
    anchor = int(torch.randint(0, high - 1, (1,), generator=gen))
    anchor += anchor >= cfg.mask_token_id  # never the mask token itself
    ids = torch.tensor([anchor] + [cfg.mask_token_id] * (b - 1))
    taps = random_taps(cfg, ctx, gen, None if embed is None else embed * ref.embed_scale)
    if embed is not None:
        noise = ref.block_rows(embed, ids)
    else:
        rows = torch.randn(2, cfg.hidden_size, generator=gen)  # an anchor row and a mask row
        noise, e_src = rows[(ids == cfg.mask_token_id).long()], "random rows (no embedding table: no --target, none in the checkpoint)"
    pos = torch.arange(ctx + b)
    omitted: dict[str, str] = {}
    with torch.no_grad():
        stages = ref.forward(taps, noise, pos)
        if head is not None:
            logits = ref.logits(stages["hidden_out"], head)
            stages["draft_logits"] = logits
            if census.markov is not None:
                stages["markov_tokens"] = ref.markov_chain(logits, anchor)
        else:
            omitted["draft_logits"] = "no lm_head (pass --target DIR)"
            if census.markov is not None:
                omitted["markov_tokens"] = "no lm_head to chain over (pass --target DIR)"
        if census.confidence is not None:
            chain = stages.get("markov_tokens")
            if census.confidence.with_markov and chain is None:
                omitted["confidence_raw"] = "previous chain ids need the markov chain (pass --target DIR)"
            else:
                prev = torch.full((b,), anchor) if chain is None else torch.cat([torch.tensor([anchor]), chain[:-1]])
                stages["confidence_raw"] = ref.confidence(stages["hidden_out"], prev)
    arrays = {"target_hidden": taps.numpy(), "noise_embedding": noise.numpy().astype(np.float32),
              "position_ids": pos.numpy().astype(np.int64)}
    for name, t in stages.items():
        arrays[name] = t.numpy().astype(np.int64 if name == "markov_tokens" else np.float32)
    from memra_cli.hf_compat import protect_kernels_name
    protect_kernels_name()  # our kernels/ folder must not shadow HF kernels
    import transformers

    source = GEMMA4_SOURCE if isinstance(ref, Gemma4ReferenceDrafter) else SOURCE
    meta = {
        "source": f"{source}; transformers {transformers.__version__}; noise from {e_src}; lm_head from {h_src}",
        "block_size": b, "ctx": ctx, "anchor_token": anchor, "harvest": census.kind,
        "checkpoint": str(ckpt_path), "seed": seed, "mask_token_id": cfg.mask_token_id, "compute": "float64",
    }
    if omitted:
        meta["omitted"] = omitted
    write_oracle(out_npz, meta, arrays)
    return {"format": FORMAT, **meta, "stages": [k for k in arrays if k not in ("target_hidden", "noise_embedding", "position_ids")]}
