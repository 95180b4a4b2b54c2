"""Qwen3.5 hybrid causal LM (HF `model_type: qwen3_5` / `qwen3_5_text`), text model: math,
weights and state for the `TargetModel` protocol (models/base.py).

The decoder interleaves two token mixers (`layer_types`), each followed by the same SwiGLU MLP:

- `full_attention`: gated GQA attention. `q_proj` emits, per head, the query and an output gate
  side by side (`[q | gate]` of head_dim each); per-head zero-centred RMSNorm on q and k, rope on
  the first `rotary_dim` dims only (partial rotary), attention, then `out * sigmoid(gate)` before
  `o_proj`. K/V live in a static cache as in Qwen3.
- `linear_attention`: Gated DeltaNet. `in_proj_qkv|z|b|a` (fused at load into one matmul), a
  depthwise causal conv (kernel K) with SiLU over the q/k/v channels, L2-normalized q and k (q also
  scaled by 1/sqrt(dk)), `g = -exp(A_log) * softplus(a + dt_bias)`, `beta = sigmoid(b)`, the
  delta-rule recurrence on a float32 state `S [Hv, dk, dv]`, a gated RMSNorm with `z`, `out_proj`.
  The numerics are layers/deltanet.py (the seam a GPU kernel plugs into).

Every RMSNorm of the model is zero-centred (`(1 + w) * x_normed`, in float32, cast after the
multiply) except the DeltaNet's gated norm (`w * x_normed` cast first, then `* silu(z)` in float32).

State per session (`Qwen35State`): the attention layers' static K/V, and for each DeltaNet layer
its conv window (the last K-1 conv inputs, model dtype) and recurrent state (float32).

Steps. The step runner (runtime/steps.py) owns width, padding and chunking, as for Qwen3:
`forward` is the eager step of any width (the prefill; variable-width steps), `static_step` the
fixed-width one. A fixed step runs all W rows (padding included) through the recurrence from the
committed state and leaves them pending; the runner's `state.commit(end)` then keeps the state
after the last real row, so a padding row's state can never become the committed one.

Rollback. A KV cache rolls back by moving its length; a recurrent state cannot be un-applied.
Each step therefore keeps, for its rows, what is needed to produce the state after any of them:

- "stash" (default): the per-row recurrent states (the recurrence computes them anyway; written
  into a per-session buffer reused step after step) and the step's conv inputs (the window after
  row j is a slice of them). Restoring is a copy. Memory: rows x Hv x dk x dv float32 per layer;
- "replay": the state before the step plus the per-row recurrence inputs (q, k, v, g, beta); the
  kept prefix is replayed through the same function, so the state is bit-identical to the
  stash's. A few percent of the stash's memory, one recurrence row per kept row at restore time
  (benchmarks/qwen3_5_rollback.py).

`state.rollback(n)` restores the state after position n-1, which must lie in the LAST runner
step (all of its fixed-width chunks, up to `rollback_rows` recorded rows). Anything else (a
position before that step, a second rollback below the length, a step of more than
`rollback_rows` rows such as a long prompt) is refused with the reason. Restores are lazy: a
commit or rollback only says which row's state is wanted; it is materialized once, before the
next step (or when the state is read).

Exactness across groupings: after the prefill every row runs the recurrence on its own, one row
at a time with the same ops, and the conv is a fixed-order sum of K taps; with a fixed step width
the projections see W rows every step. A token's logits and state are then bit-identical however
the tokens are grouped into steps. A prompt longer than `rollback_rows` is prefilled with the
chunked form (`gated_delta_rule_chunked`, as transformers prefills; equal to float32 rounding),
shorter ones and every later step with the sequential form (`gated_delta_rule`).

Not capturable in a CUDA graph (`supports_cuda_graphs = False`): the recurrence loops over rows
in Python and the committed state is replaced, not written in place. Numerics follow
`transformers.Qwen3_5ForCausalLM` (torch fallback path, no fla kernels).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F

from memra_cli.engine.models.common import TargetBase
from memra_cli.engine.errors import CheckpointError, ConfigError
from memra_cli.engine.formats.checkpoint import Checkpoint, open_checkpoint
from memra_cli.engine.formats.qwen3_5_config import (
    FULL, SKIPPED_PREFIXES, Qwen35Config, load_qwen35_config, text_prefix,
)
from memra_cli.engine.layers.deltanet import (
    causal_conv_silu, gated_delta_rule, gated_delta_rule_chunked, gated_rms_norm, l2norm, rms_norm_1p,
)
from memra_cli.engine.layers.rope import apply_partial_rope, cos_sin, rope_tables

log = logging.getLogger(__name__)

ROLLBACK_MODES = ("stash", "replay")
DEFAULT_ROLLBACK_ROWS = 64  # a step's rows are recorded for a rollback up to this many (a prompt is longer)
GRAPHS_NOTE = ("the Qwen3.5 hybrid target's steps are not capturable yet: the DeltaNet recurrence loops over "
               "rows in Python and its state is replaced, not written in place")


# --------------------------------------------------------------------------- weights


@dataclass
class AttnWeights:
    """A gated attention mixer: wqkv `[(2*nh + 2*nkv)*hd, hidden]` = q_proj (query and gate per
    head) then k_proj and v_proj; q/k norms `[hd]` as float32 `1 + w`."""

    wqkv: torch.Tensor
    bqkv: torch.Tensor | None
    wo: torch.Tensor
    bo: torch.Tensor | None
    q_norm: torch.Tensor
    k_norm: torch.Tensor


@dataclass
class GdnWeights:
    """A Gated DeltaNet mixer: w_in `[conv_dim + value_dim + 2*Hv, hidden]` = in_proj_qkv, _z, _b,
    _a; conv `[conv_dim, K]` float32 (of the model-dtype weights); a_neg = -exp(A_log) and dt_bias
    `[Hv]` float32 (of the model-dtype parameters, as HF computes them); norm `[dv]` model dtype."""

    w_in: torch.Tensor
    conv: torch.Tensor
    a_neg: torch.Tensor
    dt_bias: torch.Tensor
    norm: torch.Tensor
    w_out: torch.Tensor


@dataclass
class LayerWeights:
    kind: str  # "linear_attention" | "full_attention"
    attn_norm: torch.Tensor  # float32 1 + w
    mlp_norm: torch.Tensor
    w_gate_up: torch.Tensor
    w_down: torch.Tensor
    attn: AttnWeights | None = None
    gdn: GdnWeights | None = None


def expected_shapes(cfg: Qwen35Config, prefix: str = "model.") -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape for every tensor the text model needs (lm_head only when untied)."""
    h, hd, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    hv = cfg.linear_num_value_heads
    shapes: dict[str, tuple[int, ...]] = {prefix + "embed_tokens.weight": (cfg.vocab_size, h)}
    for i, kind in enumerate(cfg.layer_types):
        p = f"{prefix}layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
        })
        if kind == FULL:
            a = p + "self_attn."
            shapes.update({
                a + "q_proj.weight": (2 * nh * hd, h),
                a + "k_proj.weight": (nkv * hd, h),
                a + "v_proj.weight": (nkv * hd, h),
                a + "o_proj.weight": (h, nh * hd),
                a + "q_norm.weight": (hd,),
                a + "k_norm.weight": (hd,),
            })
            if cfg.attention_bias:
                shapes.update({
                    a + "q_proj.bias": (2 * nh * hd,),
                    a + "k_proj.bias": (nkv * hd,),
                    a + "v_proj.bias": (nkv * hd,),
                    a + "o_proj.bias": (h,),
                })
        else:
            g = p + "linear_attn."
            shapes.update({
                g + "in_proj_qkv.weight": (cfg.conv_dim, h),
                g + "in_proj_z.weight": (cfg.value_dim, h),
                g + "in_proj_b.weight": (hv, h),
                g + "in_proj_a.weight": (hv, h),
                g + "conv1d.weight": (cfg.conv_dim, 1, cfg.linear_conv_kernel_dim),
                g + "dt_bias": (hv,),
                g + "A_log": (hv,),
                g + "norm.weight": (cfg.linear_value_head_dim,),
                g + "out_proj.weight": (h, cfg.value_dim),
            })
    shapes[prefix + "norm.weight"] = (h,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    return shapes


class _Loader:
    """Checks every expected tensor (name and shape) before anything loads, then reads them."""

    def __init__(self, ckpt: Checkpoint, cfg: Qwen35Config, dtype: torch.dtype, device: torch.device):
        self.ckpt, self.cfg, self.dtype, self.device = ckpt, cfg, dtype, device
        self.prefix = text_prefix(ckpt.tensors, ckpt.root)
        self.shapes = expected_shapes(cfg, self.prefix)

    def check_all(self) -> None:
        for name, shape in self.shapes.items():
            info = self.ckpt.tensors.get(name)
            tail = f"(expected shape {list(shape)} from {self.cfg.source})"
            if info is None:
                hint = ""
                if name == "lm_head.weight":
                    hint = " — lm_head.weight is needed because tie_word_embeddings is false"
                elif ".linear_attn." in name:
                    hint = " — layer_types makes this layer linear_attention (Gated DeltaNet)"
                elif ".self_attn." in name:
                    hint = " — layer_types makes this layer full_attention"
                raise CheckpointError(f"{self.ckpt.root}: tensor '{name}' is missing {tail}{hint}")
            if tuple(info.shape) != shape:
                raise CheckpointError(f"{info.file}: tensor '{name}' has shape {list(info.shape)}, {tail[1:-1]}")

    def get(self, name: str) -> torch.Tensor:
        return self.ckpt.load(name, self.dtype, self.device)

    def norm_1p(self, name: str) -> torch.Tensor:
        return 1.0 + self.get(name).float()  # HF: 1.0 + weight.float(), weight in the model dtype

    def cat(self, *names: str) -> torch.Tensor:
        return torch.cat([self.get(n) for n in names], dim=0)

    def layer(self, i: int) -> LayerWeights:
        p = f"{self.prefix}layers.{i}."
        m = p + "mlp."
        kind = self.cfg.layer_types[i]
        lw = LayerWeights(
            kind=kind,
            attn_norm=self.norm_1p(p + "input_layernorm.weight"),
            mlp_norm=self.norm_1p(p + "post_attention_layernorm.weight"),
            w_gate_up=self.cat(m + "gate_proj.weight", m + "up_proj.weight"),
            w_down=self.get(m + "down_proj.weight"),
        )
        if kind == FULL:
            a = p + "self_attn."
            bias = self.cfg.attention_bias
            lw.attn = AttnWeights(
                wqkv=self.cat(a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"),
                bqkv=self.cat(a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias") if bias else None,
                wo=self.get(a + "o_proj.weight"),
                bo=self.get(a + "o_proj.bias") if bias else None,
                q_norm=self.norm_1p(a + "q_norm.weight"),
                k_norm=self.norm_1p(a + "k_norm.weight"),
            )
        else:
            g = p + "linear_attn."
            lw.gdn = GdnWeights(
                w_in=self.cat(g + "in_proj_qkv.weight", g + "in_proj_z.weight", g + "in_proj_b.weight",
                              g + "in_proj_a.weight"),
                conv=self.get(g + "conv1d.weight")[:, 0, :].float().contiguous(),
                a_neg=-self.get(g + "A_log").float().exp(),
                dt_bias=self.get(g + "dt_bias").float(),
                norm=self.get(g + "norm.weight"),
                w_out=self.get(g + "out_proj.weight"),
            )
        return lw



# --------------------------------------------------------------------------- state


@dataclass
class _GdnRecord:
    """One DeltaNet layer over one step's rows: what it takes to give the state after any of them.

    `xs [K-1+rows, C]`: the conv window before the step, then the step's conv inputs (the window
    after j rows is `xs[j:j+K-1]`). `pre`: the recurrent state before the step; `final`: after its
    last row. Stash mode keeps `states [rows, Hv, dk, dv]`; replay mode keeps `inputs` (q, k, v, g,
    beta of the rows) and re-runs the recurrence on a prefix. A step too long to record keeps
    neither (only its start and its end can be given)."""

    xs: torch.Tensor
    pre: torch.Tensor
    final: torch.Tensor
    rows: int
    states: torch.Tensor | None = None
    inputs: tuple[torch.Tensor, ...] | None = None

    def state_after(self, j: int, conv_k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv window, recurrent state) after the first `j` rows of the step (0 <= j <= rows)."""
        assert 0 <= j <= self.rows, (j, self.rows)
        window = self.xs[j:j + conv_k - 1]
        if j == self.rows:
            return window, self.final
        if j == 0:
            return window, self.pre
        if self.states is not None:
            return window, self.states[j - 1]
        if self.inputs is None:
            raise AssertionError("no per-row record kept for this step")
        q, k, v, g, beta = (x[:j] for x in self.inputs)
        return window, gated_delta_rule(q, k, v, g, beta, self.pre)[1]


@dataclass
class _Chunk:
    """The rows one forward / static_step ran from `start` (`rows` of them; `live` committed), per
    DeltaNet layer. `kept`: whether the per-row record exists (every fixed step; eager steps of at
    most `rollback_rows` rows)."""

    start: int
    rows: int
    layers: list[_GdnRecord]
    kept: bool
    live: int = 0


class Qwen35State:
    """One session's state: attention K/V `kv [n_full, 2, n_kv, max_len, hd]` (static, as Qwen3's
    KVCache), and per DeltaNet layer `conv[i] [K-1, conv_dim]` (model dtype) and `rec[i]
    [Hv, dk, dv]` (float32), committed at `length`.

    `length` is read-only from outside: it moves with the recurrent state (`commit`, `rollback`,
    `reset` and the target's eager `forward`), never alone. `graphs` exists for the runtime's
    interface (the hybrid target is never captured, so it stays empty)."""

    def __init__(self, kv: torch.Tensor, conv: list[torch.Tensor], rec: list[torch.Tensor], max_len: int,
                 conv_k: int):
        self.kv = kv
        self._conv, self._rec = conv, rec
        self.max_len, self.conv_k = max_len, conv_k
        self.graphs: dict = {}
        self._length = 0
        self._stash: list[torch.Tensor | None] = [None] * len(rec)  # per DeltaNet layer, reused step after step
        self._forget()

    def _forget(self) -> None:
        """Drop every record (nothing left to roll back into)."""
        self._pending: _Chunk | None = None  # rows a static_step ran, not committed yet
        self._chunks: list[_Chunk] = []  # the committed chunks of the last runner step (tile [base, length])
        self._continues = False  # the last commit said the runner's step goes on with another fixed step
        self._settle_to: tuple[_Chunk, int] | None = None  # (chunk, j): the committed state, not materialized yet
        self._why_not = ""  # why a rollback below the last step's start is impossible, when it is
        self._stash_used = 0  # stash rows the chunks of the current step hold

    # ----------------------------------------------------------------- the TargetState surface

    @property
    def length(self) -> int:
        return self._length

    @property
    def conv(self) -> list[torch.Tensor]:
        """Committed conv windows (materialized on read)."""
        self._settle()
        return self._conv

    @property
    def rec(self) -> list[torch.Tensor]:
        """Committed recurrent states (materialized on read)."""
        self._settle()
        return self._rec

    @property
    def nbytes(self) -> int:
        tensors = [self.kv, *self._conv, *self._rec, *(s for s in self._stash if s is not None)]
        return sum(t.numel() * t.element_size() for t in tensors)

    def reset(self) -> None:
        """Back to an empty context: length 0, zero conv windows and states."""
        self._length = 0
        self._conv = [torch.zeros_like(c) for c in self._conv]
        self._rec = [torch.zeros_like(r) for r in self._rec]
        self._forget()

    def rollback(self, n_keep: int) -> None:
        """Keep the first `n_keep` positions: K/V by moving the length, the DeltaNet layers to
        their state after position n_keep-1, which must lie in the last runner step (`n_keep` from
        that step's start to its end). `n_keep == length` is always a no-op, 0 a reset; anything
        else the state cannot give raises ValueError with the reason."""
        n = n_keep
        if not 0 <= n <= self._length:
            raise ValueError(f"cannot roll a Qwen3.5 state of length {self._length} back to {n}")
        if n == self._length:
            return
        if n == 0:
            self.reset()
            return
        base = self._chunks[0].start if self._chunks else None
        if base is None or n < base:
            why = self._why_not or (
                f"the recurrent state is kept only back to the start of the last step (position {base}), "
                "and cannot be un-applied further" if base is not None else "no step to roll back into")
            raise ValueError(f"cannot roll the Qwen3.5 state back from length {self._length} to {n}: {why}")
        for chunk in self._chunks:
            if chunk.start <= n <= chunk.start + chunk.live:
                self._settle_to = (chunk, n - chunk.start)
                break
        else:  # unreachable: the chunks tile [base, length]
            raise AssertionError((n, [(c.start, c.live) for c in self._chunks]))
        self._length = n
        self._chunks, self._pending, self._continues = [], None, False
        self._why_not = f"it was already rolled back to {n} since its last step (one rollback per step)"

    def commit(self, end: int, step_continues: bool = False) -> None:
        """The runner keeps positions `[length, end)` of the static_step just run (rows past `end`
        were padding): the state after the last kept row becomes the committed one.
        `step_continues`: the runner's step goes on with another fixed step at `end`, so a
        rollback may still reach back into this one."""
        chunk = self._pending
        if chunk is None or chunk.start != self._length:
            raise ValueError(f"commit to {end}: no pending step at length {self._length}")
        j = end - chunk.start
        if not 0 <= j <= chunk.rows:
            raise ValueError(f"commit to {end}: the pending step ran positions {chunk.start}..{chunk.start + chunk.rows - 1}")
        chunk.live = j
        self._pending = None
        self._settle_to = (chunk, j)
        self._length = end
        self._continues = step_continues
        if chunk.kept:
            self._chunks.append(chunk)
        else:
            self._chunks = []
            self._why_not = (f"the last step ran {chunk.rows} rows, more than the rollback limit "
                             "(rollback_rows), so its per-row states were not kept")

    # ----------------------------------------------------------------- the target's side

    def _settle(self) -> None:
        """Materialize the committed conv windows and states (after a commit or a rollback)."""
        if self._settle_to is None:
            return
        chunk, j = self._settle_to
        self._settle_to = None
        for li, layer in enumerate(chunk.layers):
            conv, rec = layer.state_after(j, self.conv_k)
            # a stashed state is a view into the reused stash buffer: the committed one is a copy
            self._conv[li], self._rec[li] = conv, (rec.clone() if layer.states is not None else rec)

    def _begin(self, rows: int, fixed: bool, limit: int) -> int:
        """A step of `rows` rows starts at `length`: materialize the committed state; keep the
        runner step's earlier chunks when this fixed step continues it (while they and this one
        stay within `limit` recorded rows), else drop the record. Returns the stash row offset
        for this step's per-row states."""
        self._settle()
        self._pending = None
        if fixed and self._continues and self._chunks:
            self._continues = False
            if self._stash_used + rows <= max(limit, rows):
                return self._stash_used
            self._why_not = (f"the last step ran more than rollback_rows ({limit}) rows, so its per-row states "
                             f"are kept only back to position {self._length}")
        else:
            self._why_not = ""
        self._chunks, self._continues, self._stash_used = [], False, 0
        return 0

    def _ran(self, chunk: _Chunk, stash_rows: int) -> None:
        """`chunk` was just run from `length` (pending until committed)."""
        self._pending = chunk
        self._stash_used += stash_rows

    def _stash_rows(self, slot: int, offset: int, rows: int) -> torch.Tensor:
        """`[rows, Hv, dk, dv]` of layer `slot`'s stash buffer from `offset`. The buffer is reused
        step after step (a fresh multi-MiB allocation per step costs more than the stash itself
        on the CPU); it grows when a step needs more (views of earlier chunks stay valid)."""
        need = offset + rows
        buf = self._stash[slot]
        if buf is None or buf.shape[0] < need:
            r = self._rec[slot]
            buf = self._stash[slot] = torch.empty((-(-need // 16) * 16, *r.shape), dtype=r.dtype, device=r.device)
        return buf[offset:need]


# --------------------------------------------------------------------------- the model


class Qwen35Target(TargetBase):
    """Qwen3.5 hybrid target (models/base.py `TargetModel`). Tap `i` = raw output of decoder layer
    `i`, `-1` = the embedding output.

    `rollback_mode`: "stash" (per-row states) or "replay" (pre-step state + per-row inputs);
    `rollback_rows`: eager steps longer than this (a prompt) keep no per-row record, and a
    runner step's fixed-width chunks are recorded back to this many rows."""

    supports_cuda_graphs = False
    graphs_note = GRAPHS_NOTE

    def __init__(self, cfg: Qwen35Config, embed: torch.Tensor, layers: list[LayerWeights],
                 norm: torch.Tensor, lm_head: torch.Tensor, rollback: str = "stash",
                 rollback_rows: int = DEFAULT_ROLLBACK_ROWS, note: str = ""):
        self.cfg = cfg
        self.embed_weight = embed
        self.layers = layers
        self.norm = norm  # float32 1 + w
        self._lm_head = lm_head
        self.dtype, self.device = embed.dtype, embed.device
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.load_note = note
        self.chunked_prefill = True  # a prompt longer than rollback_rows prefills with the chunked form
        self._full_slot = {li: s for s, li in enumerate(cfg.full_layers)}
        self._lin_slot = {li: s for s, li in enumerate(cfg.linear_layers)}
        self._rope = rope_tables(cfg.rope, cfg.rotary_dim)
        self._cos = self._sin = torch.empty(0, cfg.rotary_dim, dtype=self.dtype, device=self.device)
        self.set_rollback(rollback, rollback_rows)

    @classmethod
    def from_dir(cls, path: str | Path, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu", rollback: str = "stash") -> "Qwen35Target":
        """Load a Qwen3.5 directory (either layout; single or sharded safetensors). The vision
        tower (`model.visual.*`) and MTP head (`mtp.*`) are recognized and skipped (counted in
        `load_note`, logged)."""
        path = Path(path)
        cfg = load_qwen35_config(path)
        if rollback not in ROLLBACK_MODES:  # before the weights load
            raise ConfigError(f"rollback mode must be one of {'|'.join(ROLLBACK_MODES)}, got {rollback!r}")
        loader = _Loader(open_checkpoint(path), cfg, dtype, torch.device(device))
        loader.check_all()
        embed = loader.get(loader.prefix + "embed_tokens.weight")
        layers = [loader.layer(i) for i in range(cfg.num_hidden_layers)]
        lm_head = embed if cfg.tie_word_embeddings else loader.get("lm_head.weight")
        names = set(loader.ckpt.tensors)
        skipped = {p: sum(1 for n in names if n.startswith(p)) for p in SKIPPED_PREFIXES}
        extra = sorted(names - set(loader.shapes) - {"lm_head.weight"}
                       - {n for n in names if n.startswith(SKIPPED_PREFIXES)})
        n_lin, n_full = len(cfg.linear_layers), len(cfg.full_layers)
        note = (f"Qwen3.5 hybrid target {path}: {cfg.layout} layout (model_type {cfg.model_type}, text "
                f"weights under {loader.prefix}), {cfg.num_hidden_layers} layers = {n_lin} linear_attention "
                f"+ {n_full} full_attention (from {cfg.layer_types_from}), "
                f"{'tied' if cfg.tie_word_embeddings else 'untied'} lm_head; skipped "
                f"{skipped['model.visual.']} model.visual.* and {skipped['mtp.']} mtp.* tensor(s)")
        log.info("%s", note)
        if extra:
            log.warning("%s: %d tensor(s) not used by the Qwen3.5 target, e.g. %s", path, len(extra), extra[0])
        return cls(cfg, embed, layers, loader.norm_1p(loader.prefix + "norm.weight"), lm_head,
                   rollback=rollback, note=note)

    def set_rollback(self, mode: str, rows: int | None = None) -> None:
        """How steps are recorded for a rollback: "stash" | "replay", and `rollback_rows`. Takes
        effect from the next step."""
        if mode not in ROLLBACK_MODES:
            raise ConfigError(f"rollback mode must be one of {'|'.join(ROLLBACK_MODES)}, got {mode!r}")
        self.rollback_mode = mode
        if rows is not None:
            if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
                raise ConfigError(f"rollback_rows must be a positive integer, got {rows!r}")
            self.rollback_rows = rows

    def ensure_positions(self, rows: int) -> None:
        """cos/sin tables (over the rotary dims) reaching at least `rows` positions."""
        if self._cos.shape[0] < rows:
            self._cos, self._sin = cos_sin(self._rope, torch.arange(rows, device=self.device), self.dtype)

    # ----------------------------------------------------------------------- state

    def new_state(self, rows: int) -> Qwen35State:
        """A session's state of `rows` positions (the runner sizes it): static K/V, zero conv
        windows and recurrent states."""
        cfg = self.cfg
        kv = torch.zeros(len(cfg.full_layers), 2, self.n_kv, rows, self.head_dim, dtype=self.dtype, device=self.device)
        k = cfg.linear_conv_kernel_dim
        conv = [torch.zeros(k - 1, cfg.conv_dim, dtype=self.dtype, device=self.device) for _ in cfg.linear_layers]
        rec = [torch.zeros(cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim,
                           dtype=torch.float32, device=self.device) for _ in cfg.linear_layers]
        return Qwen35State(kv, conv, rec, rows, k)

    # ----------------------------------------------------------------------- forward

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.embed_weight)

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        """The model's final (zero-centred) RMSNorm."""
        return rms_norm_1p(x, self.norm, self.cfg.rms_norm_eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`[t, vocab]` float32 logits (matmul in the model dtype, widened after, as HF)."""
        return F.linear(hidden, self._lm_head).float()

    def forward(self, ids: torch.Tensor, start: int, state: Qwen35State,
                taps: Sequence[int] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run `ids [t]` at positions `start..start+t-1` over the committed context; commit them
        (`state.length = start + t`). `start` below the length is an implicit `rollback(start)`
        (refused unless the state can). Returns the final-normed hidden `[t, hidden]` and, with
        `taps`, `[t, len(taps)*hidden]`. A prompt (from 0) longer than `rollback_rows` runs the
        DeltaNet recurrence in its chunked form when `chunked_prefill` is on."""
        t = ids.shape[0]
        end = start + t
        self.check_span(start, t, state)
        self.ensure_positions(end)
        if taps:
            self.check_taps(taps)
        if start < state.length:
            state.rollback(start)
        keep = t <= self.rollback_rows
        offset = state._begin(t, fixed=False, limit=self.rollback_rows)
        mask = self._mask(start, t)

        def attend(q, k, v, kv):
            kv[0, :, start:end] = k.transpose(0, 1)
            kv[1, :, start:end] = v.transpose(0, 1)
            return self._attend(q, kv[0, :, :end], kv[1, :, :end], mask)

        chunked = not keep and start == 0 and self.chunked_prefill
        hidden, tapped = self._run(ids, self._cos[start:end], self._sin[start:end], attend, state, start, keep,
                                   offset, taps, chunked)
        state.commit(end)
        return hidden, tapped

    def static_step(self, ids: torch.Tensor, positions: torch.Tensor, state: Qwen35State,
                    taps: Sequence[int] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The fixed-width step (as Qwen3Target's): K/V written with `index_copy_`, attention over
        the whole storage under a mask from `positions`, every one of the W rows through the
        DeltaNet layers from the committed state, which `positions` must continue (the runner
        rolls back first when a step starts below the length). Returns float32 logits `[W, vocab]`
        and taps; the rows stay pending until `state.commit(end)` keeps the real ones."""
        width = ids.shape[0]
        offset = state._begin(width, fixed=True, limit=self.rollback_rows)
        cos, sin = self._cos[positions], self._sin[positions]
        keys = torch.arange(state.max_len, device=self.device)
        mask = (keys[None, :] <= positions[:, None]).repeat(self.n_heads // self.n_kv, 1)

        def attend(q, k, v, kv):
            kv[0].index_copy_(1, positions, k.transpose(0, 1))
            kv[1].index_copy_(1, positions, v.transpose(0, 1))
            return self._attend(q, kv[0], kv[1], mask)

        hidden, tapped = self._run(ids, cos, sin, attend, state, state.length, True, offset, taps, False)
        return self.logits(hidden), tapped

    def _mask(self, start: int, t: int) -> torch.Tensor | None:
        if t == 1:
            return None
        keys = torch.arange(start + t, device=self.device)
        queries = torch.arange(start, start + t, device=self.device)
        mask = keys[None, :] <= queries[:, None]
        return mask.repeat(self.n_heads // self.n_kv, 1)

    def _run(self, ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend, state: Qwen35State,
             start: int, keep: bool, offset: int, taps: Sequence[int] | None, chunked: bool
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The decoder over `ids [t]`: attention layers through `attend(q, k, v, kv)`, DeltaNet
        layers from the committed state over all t rows. Leaves the rows pending on `state`."""
        eps = self.cfg.rms_norm_eps
        t = ids.shape[0]
        x = self.embed(ids)
        wanted = set(taps or ())
        tapped: dict[int, torch.Tensor] = {-1: x} if -1 in wanted else {}
        stash = keep and self.rollback_mode == "stash" and not chunked
        records: list[_GdnRecord] = []
        for li, w in enumerate(self.layers):
            h = rms_norm_1p(x, w.attn_norm, eps)
            if w.attn is not None:
                q, gate, k, v = self._qkv(h, w.attn, cos, sin)
                out = attend(q, k, v, state.kv[self._full_slot[li]])
                x = x + F.linear(out * torch.sigmoid(gate), w.attn.wo, w.attn.bo)
            else:
                slot = self._lin_slot[li]
                buf = state._stash_rows(slot, offset, t) if stash else None
                out, record = self._gdn(h, w.gdn, state._conv[slot], state._rec[slot], keep, chunked, buf)
                records.append(record)
                x = x + out
            x = self._mlp(x, w)
            if li in wanted:
                tapped[li] = x
        state._ran(_Chunk(start, t, records, keep), t if stash else 0)
        hidden = self.final_norm(x)
        taps_out = torch.cat([tapped[i] for i in taps], dim=-1) if taps else None
        return hidden, taps_out

    def _qkv(self, h: torch.Tensor, w: AttnWeights, cos: torch.Tensor, sin: torch.Tensor):
        """Fused projection of `h [t, hidden]`: q `[t, nh, hd]` (normed, rope'd), the output gate
        `[t, nh*hd]`, k `[t, nkv, hd]` (normed, rope'd), v `[t, nkv, hd]`."""
        t, nh, nkv, hd = h.shape[0], self.n_heads, self.n_kv, self.head_dim
        qg, k, v = F.linear(h, w.wqkv, w.bqkv).split([2 * nh * hd, nkv * hd, nkv * hd], dim=-1)
        qg = qg.view(t, nh, 2 * hd)
        q, gate = qg[..., :hd], qg[..., hd:].reshape(t, nh * hd)
        eps = self.cfg.rms_norm_eps
        q = apply_partial_rope(rms_norm_1p(q, w.q_norm, eps), cos, sin)
        k = apply_partial_rope(rms_norm_1p(k.view(t, nkv, hd), w.k_norm, eps), cos, sin)
        return q, gate, k, v.view(t, nkv, hd)

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                mask: torch.Tensor | None) -> torch.Tensor:
        """GQA attention of `q [t, nh, hd]` over `keys/values [nkv, n, hd]` -> `[t, nh*hd]`."""
        t, nh, nkv, hd = q.shape[0], self.n_heads, self.n_kv, self.head_dim
        g = nh // nkv
        qf = q.view(t, nkv, g, hd).permute(1, 2, 0, 3).reshape(nkv, g * t, hd)
        out = F.scaled_dot_product_attention(qf, keys, values, attn_mask=mask)
        return out.view(nkv, g, t, hd).permute(2, 0, 1, 3).reshape(t, nh * hd)

    def _gdn(self, h: torch.Tensor, w: GdnWeights, conv_win: torch.Tensor, rec: torch.Tensor, keep: bool,
             chunked: bool, stash_out: torch.Tensor | None) -> tuple[torch.Tensor, _GdnRecord]:
        """A Gated DeltaNet mixer over `h [t, hidden]` from (conv window, state). Returns `[t,
        hidden]` and the layer's record of the step (per-row states into `stash_out` in stash
        mode, the recurrence inputs in replay mode, neither when `keep` is off)."""
        cfg = self.cfg
        t = h.shape[0]
        hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        mixed, z, b, a = F.linear(h, w.w_in).split([cfg.conv_dim, cfg.value_dim, hv, hv], dim=-1)
        xs = torch.cat([conv_win, mixed], dim=0)  # [K-1+t, conv_dim]
        conv = causal_conv_silu(xs, w.conv)
        q, k, v = conv.split([cfg.key_dim, cfg.key_dim, cfg.value_dim], dim=-1)
        beta = torch.sigmoid(b).float()
        g = w.a_neg * F.softplus(a.float() + w.dt_bias)
        qf = l2norm(q.reshape(t, hk, dk).float())
        kf = l2norm(k.reshape(t, hk, dk).float())
        if hv != hk:
            qf = qf.repeat_interleave(hv // hk, dim=1)
            kf = kf.repeat_interleave(hv // hk, dim=1)
        qf = qf / (dk ** 0.5)
        vf = v.reshape(t, hv, dv).float()
        stash = stash_out is not None
        if chunked:  # a long prefill: no per-row record is kept, so nothing needs the row states
            core, final = gated_delta_rule_chunked(qf, kf, vf, g, beta, rec)
            states = None
        else:
            core, final, states = gated_delta_rule(qf, kf, vf, g, beta, rec, keep_states=stash, states_out=stash_out)
        record = _GdnRecord(xs=xs, pre=rec, final=final, rows=t, states=states,
                            inputs=(qf, kf, vf, g, beta) if keep and not stash else None)
        normed = gated_rms_norm(core.to(h.dtype), z.reshape(t, hv, dv), w.norm, cfg.rms_norm_eps)
        return F.linear(normed.reshape(t, cfg.value_dim), w.w_out), record

    def _mlp(self, x: torch.Tensor, w: LayerWeights) -> torch.Tensor:
        gate, up = F.linear(rms_norm_1p(x, w.mlp_norm, self.cfg.rms_norm_eps), w.w_gate_up).chunk(2, dim=-1)
        return x + F.linear(F.silu(gate) * up, w.w_down)
