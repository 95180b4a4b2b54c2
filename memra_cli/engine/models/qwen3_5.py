"""Qwen3.5 hybrid causal LM (HF `model_type: qwen3_5` / `qwen3_5_text`), text model: math,
weights and state for the `TargetModel` protocol (models/base.py).

The decoder interleaves two token mixers (`layer_types`), each followed by the same SwiGLU MLP
(`_feed_forward`; the mixture-of-experts hybrid overrides it: models/qwen3_5_moe.py):

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
committed state (which it only reads) and leaves them pending; the runner's `state.commit(end)` then keeps the state
after the last real row, so a padding row's state can never become the committed one.

Rollback. A KV cache rolls back by moving its length; a recurrent state cannot be un-applied.
Each step therefore records, in the state's ring (`Qwen35State`), what is needed to produce the
state after any of its rows, on top of the state at the start of the runner step (the base):

- "stash" (the default off CUDA; "replay" on CUDA, see `default_rollback`): the per-row recurrent states (the recurrence writes them) and the rows'
  conv inputs (the window after row j is a slice of them). Restoring is a copy. Memory:
  rollback_rows x Hv x dk x dv float32 per layer;
- "replay": the rows' conv inputs and outputs, g and beta; the kept prefix is
  re-run from the base through the same recurrence, so the state is bit-identical to the stash's.
  A few percent of the stash's memory and of its per-step writes.

`state.rollback(n)` restores the state after position n-1, which must lie in the LAST runner
step (all of its fixed-width chunks, up to `rollback_rows` recorded rows). Anything else (a
position before that step, a second rollback below the length, a step of more than
`rollback_rows` rows such as a long prompt) is refused with the reason. `commit` and `rollback`
restore at once, with host-known ints and device copies (no device value read back).

Exactness across groupings: after the prefill every row runs the recurrence on its own, one row
at a time with the same ops, and the conv is a fixed-order sum of K taps; with a fixed step width
the projections see W rows every step. A token's logits and state are then bit-identical however
the tokens are grouped into steps. A prompt longer than `rollback_rows` is prefilled with the
chunked form (`gated_delta_rule_chunked`, as transformers prefills; equal to float32 rounding),
shorter ones and every later step with the sequential form (`step_ops.gated_delta_rule`).

Capturable in a CUDA graph (`supports_cuda_graphs`): every state tensor is allocated once and
written in place, and `static_step` only reads the committed state and writes its rows into the
ring by position, so a replay needs nothing from Python; `commit` runs outside the graph. The
step's every op but the weight matmuls goes through `step_ops` (torch, or `memra_kernels` on
CUDA: fused norms with the residual adds, attention prep and output gate, DeltaNet gates + ring
record, conv, recurrence, gated norm, attention, SiLU-mul). Numerics of the torch path follow
`transformers.Qwen3_5ForCausalLM` (torch fallback path).
"""

from __future__ import annotations

import logging
import math
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F

from memra_cli.engine.models.state import LiveRows, StateBase
from memra_cli.engine.models.common import TargetBase, batch_taps
from memra_cli.engine.models.loading import WeightLoader
from memra_cli.engine.errors import ConfigError, UnsupportedError
from memra_cli.engine.formats.checkpoint import Checkpoint, open_checkpoint
from memra_cli.engine.formats.qwen3_5_config import (
    FULL, SKIPPED_PREFIXES, Qwen35Config, load_qwen35_config, text_prefix,
)
from memra_cli.engine.layers.deltanet import gated_delta_rule_chunked, prep_qkv, rms_norm_1p
from memra_cli.engine.layers.rope import cos_sin, rope_tables
from memra_cli.engine.layers.torch_step_ops import TorchStepOps

log = logging.getLogger(__name__)

ROLLBACK_MODES = ("stash", "replay")
DEFAULT_ROLLBACK_ROWS = 64  # a step's rows are recorded for a rollback up to this many (a prompt is longer)


def default_rollback(device: torch.device) -> str:
    """The rollback mode a target gets unless told, as measured per device. CUDA: "replay" (faster
    and a fraction of the stash's memory: docs/tuning.md#hybrid-rollback). Elsewhere: "stash" (on
    the CPU the recurrence computes the per-row states anyway and a restore is a copy, where a
    replay recomputes; docs/hybrid.md)."""
    return "replay" if device.type == "cuda" else "stash"


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


def ffn_prefix(cfg: Qwen35Config) -> str:
    """Where a layer's SwiGLU MLP lives under `layers.{i}.`: the dense MLP, or on the MoE model
    the shared expert (its routed experts, router and shared gate are models/qwen3_5_moe.py's)."""
    return "mlp." if cfg.moe is None else "mlp.shared_expert."


def ffn_shapes(cfg: Qwen35Config, p: str) -> dict[str, tuple[int, ...]]:
    """The feed-forward tensors of the layer under `p` but the routed experts (whose layout the
    MoE loader reads): the dense MLP, or the shared expert, its gate `[1, hidden]` and the router
    `[E, hidden]`."""
    h, m = cfg.hidden_size, p + ffn_prefix(cfg)
    inter = cfg.intermediate_size if cfg.moe is None else cfg.moe.shared_expert_intermediate_size
    shapes = {m + "gate_proj.weight": (inter, h), m + "up_proj.weight": (inter, h), m + "down_proj.weight": (h, inter)}
    if cfg.moe is not None:
        shapes.update({p + "mlp.shared_expert_gate.weight": (1, h), p + "mlp.gate.weight": (cfg.moe.num_experts, h)})
    return shapes


def expected_shapes(cfg: Qwen35Config, prefix: str = "model.") -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape for every tensor the text model needs (lm_head only when untied)."""
    h, hd = cfg.hidden_size, cfg.head_dim
    nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    hv = cfg.linear_num_value_heads
    shapes: dict[str, tuple[int, ...]] = {prefix + "embed_tokens.weight": (cfg.vocab_size, h)}
    for i, kind in enumerate(cfg.layer_types):
        p = f"{prefix}layers.{i}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)})
        shapes.update(ffn_shapes(cfg, p))
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


class _Loader(WeightLoader):
    """Qwen3.5's weights, under the text model's prefix of either layout."""

    def __init__(self, ckpt: Checkpoint, cfg: Qwen35Config, dtype: torch.dtype, device: torch.device):
        self.prefix = text_prefix(ckpt.tensors, ckpt.root)
        super().__init__(ckpt, cfg, dtype, device, expected_shapes(cfg, self.prefix))

    def missing_hint(self, name: str) -> str:
        if ".linear_attn." in name:
            return " — layer_types makes this layer linear_attention (Gated DeltaNet)"
        if ".self_attn." in name:
            return " — layer_types makes this layer full_attention"
        return super().missing_hint(name)

    def describe(self) -> str:
        """What this reader adds to the load note (the MoE reader: the experts' layout)."""
        return ""

    def norm_1p(self, name: str) -> torch.Tensor:
        return 1.0 + self.get(name).float()  # HF: 1.0 + weight.float(), weight in the model dtype

    def layer(self, i: int) -> LayerWeights:
        p = f"{self.prefix}layers.{i}."
        m = p + ffn_prefix(self.cfg)
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


def restores_as_graphs(device: torch.device, mode: str, ops) -> bool:
    """Whether a state's replay restores run as CUDA graphs: on CUDA, in replay mode, with step
    ops whose replay and window restore read their rows on the device (`restores_on_device`: the
    Triton kernels; the torch ops read them on the host, which a graph capture refuses)."""
    return device.type == "cuda" and mode == "replay" and ops.restores_on_device


class Qwen35State(LiveRows, StateBase):
    """One session's state, every tensor allocated once and written in place (a CUDA graph binds
    their addresses):

    - `kv [n_full, 2, n_kv, max_len, hd]`: the attention layers' static K/V (as Qwen3's KVCache);
    - per DeltaNet layer i, the committed `conv[i] [K-1, conv_dim]` (model dtype: the last K-1
      conv inputs) and `rec[i] [Hv, dk, dv]` (float32), at position `length`;
    - the record that lets a rollback reach back into the last runner step: the state at its
      start (the base, at position `_base`) and, in a ring of `ring` rows indexed by position %
      ring, the conv inputs of its rows (`_xs[i] [ring, conv_dim]`) plus either the per-row states
      (`_stash[i] [ring, Hv, dk, dv]`, "stash") or the recurrence inputs (`_qkv[i] [ring,
      conv_dim]` conv outputs, `_g[i]`, `_beta[i] [ring, Hv]`, "replay").

    Two buffers, no copies. The conv windows and recurrent states live in two stacked buffers
    (`_conv2`, `_rec2`, `[2, n_linear, ...]`); `_cur` says which holds the committed state. A
    fixed step reads buffer `_cur` and (replay mode) writes the state after its last row into the
    other one. The base of a runner step is then simply the buffer the step read, and a commit
    that keeps every row only flips `_cur`; any other commit or rollback writes the kept row's
    state (a stash row, or the base advanced through the kept rows) into the buffer that is not
    the base. Before, each commit copied the committed state into a base buffer and the step's
    last-row state back (two 48 MiB copies per token at Qwen3.5-4B's shapes). A CUDA graph binds
    one arrangement, so a state has two (`graph_variants`): the step graph is captured once per
    arrangement and the replay picks `graph_variant`. A third buffer (`_spare_*`) keeps the base
    only when a runner step of several fixed steps would otherwise overwrite it.

    A step (eager `forward` or `static_step`) reads only the committed `conv` / `rec` and writes
    its rows into the ring by position, so a graph replay needs nothing from Python. The host side
    is `commit` and `rollback` (the runner and the round loop call them after each step): they
    pick the kept row's state with host-known ints and device work (a flip, a stash row copy, or
    the base advanced through the kept rows by the same recurrence), never reading a device value back.

    `length` is read-only from outside: it moves with the recurrent state (`commit`, `rollback`,
    `reset` and the target's eager `forward`), never alone. `graphs` holds the CUDA graphs
    captured over this storage (runtime/graphs.py); its own restore graphs live in the runtime's
    `GraphCache` (`attach_graph_cache`)."""

    graph_variants = 2  # buffer arrangements a fixed step can run over (see the class docstring)
    # A commit or rollback queues its device work (a flip, a copy, a replay launch) behind the
    # step on the same stream with host-known ints: a round graph may run over this state.
    round_graphs_ok = True
    # a fixed step also writes the conv window after its last row into the other buffer
    # (`_final_window`, by the conv op), so a commit keeping every row assembles no window
    step_writes_window = True
    SPARE = 2  # `_base_at` when the base lives in the spare buffer

    def __init__(self, kv: torch.Tensor, conv_shape: tuple[int, int], rec_shape: tuple[int, int, int],
                 n_linear: int, dtype: torch.dtype, device: torch.device, max_len: int, ring: int, mode: str,
                 n_k_heads: int, ops):
        self.kv = kv
        self.max_len, self.conv_k, self.ring, self.mode = max_len, conv_shape[0] + 1, ring, mode
        self.n_k_heads, self._ops = n_k_heads, ops  # the recurrence a replay restore runs (the target's)
        self.graphs: dict = {}

        # Each kind of tensor is one stacked allocation `[n_linear, ...]` (`[2, n_linear, ...]`
        # for the two committed-state buffers), and the per-layer tensors the model reads and
        # writes (`conv[i]`, `rec[i]`, ...) are views of it: a commit or rollback then moves every
        # layer's state with one op per kind of tensor, not one per layer.
        self._all: list[torch.Tensor] = []

        def stacked(shape, dt, lead=()):
            t = torch.zeros((*lead, n_linear, *shape), dtype=dt, device=device)
            self._all.append(t)
            return t

        f32, (c, hv) = torch.float32, (conv_shape[1], rec_shape[0])
        self._conv2, self._rec2 = stacked(conv_shape, dtype, (2,)), stacked(rec_shape, f32, (2,))
        self._spare_conv, self._spare_rec = stacked(conv_shape, dtype), stacked(rec_shape, f32)
        self._conv_views = [list(self._conv2[i].unbind(0)) for i in range(2)]
        self._rec_views = [list(self._rec2[i].unbind(0)) for i in range(2)]
        self._xs_all = stacked((ring, c), dtype)
        self._xs = list(self._xs_all.unbind(0))
        if mode == "stash":
            self._stash_all = stacked((ring, *rec_shape), f32)
            self._stash = list(self._stash_all.unbind(0))
        else:
            self._qkv_all, self._g_all = stacked((ring, c), dtype), stacked((ring, hv), f32)
            self._beta_all = stacked((ring, hv), f32)
            self._qkv, self._g, self._beta = (list(t.unbind(0)) for t in (self._qkv_all, self._g_all, self._beta_all))
        self._cur = 0  # the buffer holding the committed state
        # Replay restores as CUDA graphs (`_graphed_replay`), once the runtime attached the cache
        # that captures them (`attach_graph_cache`). Their inputs: `(row0, rows)` int32, via pinned memory.
        self.graph_restores = False
        self._params = torch.zeros(2, dtype=torch.int32, device=device)
        self._params_host = torch.zeros(2, dtype=torch.int32, pin_memory=device.type == "cuda")
        self._params_host_np = self._params_host.numpy()
        self._params_copied = None  # the event after the last params copy (CUDA)
        self._restore_graphs = None  # the runtime's GraphCache: (base buffer, destination buffer) -> graph
        # A round settled on the device (`restore_round`): `(row0, rows)` int32, written by the
        # round's settlement (rows -1: every row kept, the step wrote that state).
        self.round_params = torch.zeros(2, dtype=torch.int32, device=device)
        # The fixed steps' live rows (`set_live_rows`), read by the DeltaNet ops on the device:
        # the rows after them are padding, which the recurrence skips.
        self._init_live_rows(device)
        self._length = 0
        self._width: int | None = None  # rows of the fixed step graphs were captured with
        self._forget()

    # ----------------------------------------------------------------- the buffers

    @property
    def conv(self) -> list[torch.Tensor]:
        """The committed conv windows, per DeltaNet layer `[K-1, conv_dim]` (views of `_conv2[_cur]`)."""
        return self._conv_views[self._cur]

    @property
    def rec(self) -> list[torch.Tensor]:
        """The committed recurrent states, per DeltaNet layer `[Hv, dk, dv]` float32."""
        return self._rec_views[self._cur]

    @property
    def _final(self) -> list[torch.Tensor]:
        """Where a replay-mode fixed step writes its last row's state: the other buffer."""
        return self._rec_views[1 - self._cur]

    @property
    def _final_window(self) -> list[torch.Tensor]:
        """Where a fixed step writes the conv window after its last row: the other buffer."""
        return self._conv_views[1 - self._cur]

    @property
    def graph_variant(self) -> int:
        """The buffer arrangement the next fixed step runs over (the graph a replay must use)."""
        return self._cur

    def _conv_buf(self, i: int) -> torch.Tensor:
        return self._spare_conv if i == self.SPARE else self._conv2[i]

    def _rec_buf(self, i: int) -> torch.Tensor:
        return self._spare_rec if i == self.SPARE else self._rec2[i]

    @contextmanager
    def arranged_for_capture(self, variant: int):
        """Arrange the state as `variant` for a graph capture, and put every committed and base
        state back afterwards: the capture's warm-up runs the step for real, and in the other
        arrangement it would write its last row's state over the committed one. (Ring rows and
        K/V it writes lie at the storage's slack positions or belong to steps no rollback can
        reach any more: a capture happens before a runner step, after its rollback.)"""
        saved = [t.clone() for t in (self._conv2, self._rec2, self._spare_conv, self._spare_rec)]
        cur = self._cur
        self._cur = variant
        try:
            yield
        finally:
            self._cur = cur
            for dst, src in zip((self._conv2, self._rec2, self._spare_conv, self._spare_rec), saved):
                dst.copy_(src)

    def _forget(self) -> None:
        """Drop the record (nothing left to roll back into)."""
        self._pending: tuple[int, int] | None = None  # (start, rows) of a step run eagerly, not committed yet
        self._base: int | None = None  # where the record starts (None: no record)
        self._base_at = self._cur  # the buffer holding the base (0, 1 or SPARE), when `_base` is set
        self._reach = 0  # the lowest position a rollback may go back to (>= _base)
        self._recorded = 0  # the ring holds rows up to this position (padding rows included)
        self._continues = False  # the last commit said the runner's step goes on with another fixed step
        self._final_at: int | None = None  # buffer `_final_buf` holds what the last step wrote at this position
        self._final_buf = 0
        self._why_not = ""  # why a rollback below `_reach` is impossible, when it is

    # ----------------------------------------------------------------- the TargetState surface

    @property
    def length(self) -> int:
        return self._length

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.kv, *self._all))

    def reset(self) -> None:
        """Back to an empty context: length 0, zero conv windows and states, every row live."""
        self._length = 0
        self._conv2[self._cur].zero_()
        self._rec2[self._cur].zero_()
        self._forget()
        self.set_live_rows(None)

    def set_live_rows(self, n: int | None) -> None:
        """The next fixed steps run their first `n` rows through the DeltaNet recurrence (None:
        all): the rest are padding, whose recurrence would be work for nothing, and the state a
        step writes into the other buffer is then the one after its last live row, so a commit
        that keeps the live rows is a flip (no replay). Set it before launching a step (a graph
        replay reads it), and commit after, with the value the step ran with (`LiveRows`)."""
        LiveRows.set_live_rows(self, n)

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
        if self._base is None or n < self._reach:
            why = self._why_not or (
                f"the recurrent state is kept only back to the start of the last step (position {self._base}), "
                "and cannot be un-applied further" if self._base is not None else "no step to roll back into")
            raise ValueError(f"cannot roll the Qwen3.5 state back from length {self._length} to {n}: {why}")
        self._restore(n)
        self._length, self._reach = n, n
        self._pending, self._continues = None, False
        self._why_not = f"it was already rolled back to {n} since its last step (one rollback per step)"

    def commit(self, end: int, step_continues: bool = False) -> None:
        """The runner keeps positions `[length, end)` of the static_step just run (rows past `end`
        were padding): the state after the last kept row becomes the committed one.
        `step_continues`: the runner's step goes on with another fixed step at `end`, so a
        rollback may still reach back into this one.

        A graph replay runs no Python, so with graphs captured over this storage a commit with no
        eagerly recorded step trusts the runner: a step of the captured width ran at `length`."""
        start = self._length
        if self._pending is not None and self._pending[0] == start:
            rows = self._pending[1]
        elif self.graphs and self._width is not None:
            rows = self._width
        else:
            raise ValueError(f"commit to {end}: no pending step at length {start}")
        if not 0 <= end - start <= rows:
            raise ValueError(f"commit to {end}: the pending step ran positions {start}..{start + rows - 1}")
        if self._live_host is not None and self._live_host < rows:  # padding rows ran no recurrence
            rows = self._live_host
            if end - start > rows:
                raise ValueError(f"commit to {end}: the pending step's recurrence ran only its {rows} live rows "
                                 f"(positions {start}..{start + rows - 1}; set_live_rows)")
        self._pending = None
        if not self._continues or self._base is None:
            self._base, self._base_at = start, self._cur  # a new runner step: the buffer it read is its base
            self._reach, self._why_not = start, ""
        self._recorded = start + rows
        if self.mode == "replay" or self.step_writes_window:  # the step wrote its last row's state
            self._final_at, self._final_buf = start + rows, 1 - self._cur  # into the other buffer
        self._restore(end)
        self._length, self._reach, self._continues = end, self._base, step_continues
        if step_continues and end - self._base + rows > self.ring:
            # the next chunk would overwrite ring rows still reachable: keep only from here on
            self._base, self._base_at, self._reach = end, self._cur, end
            self._why_not = (f"the last step ran more than rollback_rows ({self.ring}) rows, so its per-row states "
                             f"are kept only back to position {end}")
        elif step_continues and self._base_at == 1 - self._cur:
            # the next fixed step writes its last row's state into the other buffer: move the base
            self._spare_conv.copy_(self._conv2[self._base_at])
            self._spare_rec.copy_(self._rec2[self._base_at])
            self._base_at = self.SPARE

    # ----------------------------------------------------------------- the target's side

    def _new_base(self, start: int) -> None:
        """Before an eager forward that updates the committed state in place: a copy of it (at
        `start`) in the other buffer becomes the record's base."""
        other = 1 - self._cur
        self._conv2[other].copy_(self._conv2[self._cur])
        self._rec2[other].copy_(self._rec2[self._cur])
        self._base, self._base_at, self._reach = start, other, start

    def _ring_rows(self, buf: torch.Tensor, lo: int, hi: int, dim: int = 0) -> torch.Tensor:
        """Rows of positions `[lo, hi)` (at most `ring` of them) from a ring buffer whose ring
        axis is `dim` (1 for the stacked `[n_linear, ring, ...]` ones), in order."""
        a, b = lo % self.ring, hi - lo
        if a + b <= self.ring:
            return buf.narrow(dim, a, b)
        return torch.cat([buf.narrow(dim, a, self.ring - a), buf.narrow(dim, 0, a + b - self.ring)], dim=dim)

    def _restore(self, n: int) -> None:
        """Committed conv windows and states := those after position n-1 (`_base <= n <=
        _recorded`), in a buffer that is not the base's, which becomes `_cur`: a flip when a
        step already wrote that state (the base itself, or a replay step's last row), else a
        stash row copy or the kept rows run from the base through the recurrence (one launch
        over every layer with the kernels)."""
        base, base_at, k1 = self._base, self._base_at, self.conv_k - 1
        assert base is not None and base <= n <= self._recorded, (base, n, self._recorded)
        if n == base and base_at != self.SPARE:
            self._cur = base_at
            return
        # the last fixed step's every row kept: what it wrote into the other buffer is that state
        stepped = n == self._final_at and self._final_buf != base_at
        rec_done = stepped and self.mode == "replay"
        conv_done = stepped and self.step_writes_window
        if stepped:
            dst = self._final_buf
        else:
            dst = 1 - base_at if base_at != self.SPARE else self._cur
        base_conv, base_rec = self._conv_buf(base_at), self._rec_buf(base_at)
        conv_dst, rec_dst = self._conv2[dst], self._rec2[dst]
        if self.graph_restores and self.mode == "replay" and n > base and not rec_done:
            self._graphed_replay(base_at, dst, base % self.ring, n - base)  # the window and the state
        else:
            if conv_done:
                pass
            elif n > base:
                rows = self._ring_rows(self._xs_all, max(base, n - k1), n, dim=1)
                conv_dst.copy_(torch.cat([base_conv, rows], dim=1)[:, -k1:])
            else:
                conv_dst.copy_(base_conv)
            if rec_done:
                pass
            elif n == base:
                rec_dst.copy_(base_rec)
            elif self.mode == "stash":
                rec_dst.copy_(self._stash_all[:, (n - 1) % self.ring])
            else:  # replay: the same recurrence, so the same bits as the step computed in its registers
                self._ops.gated_delta_replay(self._qkv_all, self._g_all, self._beta_all, base_rec,
                                             self.n_k_heads, base % self.ring, n - base, rec_dst)
        if dst == self._final_buf and not stepped:
            self._final_at = None  # that buffer no longer holds the step's last row
        self._cur = dst

    # The replay restore runs as a CUDA graph where it can; the runtime captures it.
    graphed_restores = True

    def attach_graph_cache(self, cache) -> None:
        """Run replay restores as graphs captured by `cache` (runtime/cuda_graphs.py
        `GraphCache`) where a capture can: on CUDA, in replay mode, with ops that read the
        replay's rows on the device (`restores_as_graphs`)."""
        self._restore_graphs = cache
        self.graph_restores = restores_as_graphs(self.kv.device, self.mode, self._ops)

    def _graphed_replay(self, base_at: int, dst: int, row0: int, rows: int) -> None:
        """The replay restore (conv windows and states after `rows` ring rows from `row0`, from
        the base in buffer `base_at` into buffer `dst`) as a CUDA graph, one per (base, dst)
        pair, captured on first use: its two launches read `(row0, rows)` on the device, so the
        host's part is one small copy and a replay (eagerly, the Triton launchers' host time would
        leave the GPU waiting every rollback). The capture's warm-up computes the restore itself:
        it only reads the base and the ring, so running it again changes nothing."""
        if self._params_copied is not None:
            self._params_copied.synchronize()  # the last copy read the pinned buffer: done?
        self._params_host_np[:] = (row0, rows)
        self._params.copy_(self._params_host, non_blocking=True)
        if self._params.device.type == "cuda":
            self._params_copied = torch.cuda.Event()
            self._params_copied.record()
        self._restore_graphs.run((base_at, dst), self._restore_body, base_at, dst)

    def _restore_body(self, base_at: int, dst: int):
        """What `_graphed_replay` captures for the pair: the window and the state restored from
        buffer `base_at` into `dst`, `(row0, rows)` read from `_params` on the device."""
        ops, params = self._ops, self._params
        base_conv, base_rec = self._conv_buf(base_at), self._rec_buf(base_at)
        conv_dst, rec_dst = self._conv2[dst], self._rec2[dst]

        def body():  # the windows and the states: one launch with the kernels
            ops.gated_delta_restore(self._qkv_all, self._g_all, self._beta_all, base_rec, self.n_k_heads, params,
                                    rec_dst, base_conv, self._xs_all, conv_dst)

        return body

    # ----------------------------------------------------------------- rounds settled on the device

    # A round graph may restore this state itself (`restore_round`), so rounds can be queued
    # before the host reads the previous one (spec/chained.py).
    settles_on_device = True

    def restore_round(self, live: torch.Tensor | None = None) -> None:
        """Inside a round graph, after its fixed step and the settlement that wrote
        `round_params` = `(row0, rows)` (`settle_round(restore=state.round_params, ring=state.ring)`):
        the conv windows and recurrent states after the round's kept rows, into the buffer that
        is not the step's base. Rows -1: every row kept, and the step already wrote the window
        there (and, in replay mode, the state). The base is the committed buffer of the
        arrangement being captured (`_cur`), like the step's own reads; the next round runs over
        the other arrangement whatever the round kept, so queued rounds alternate without a host
        value (`settled_on_device`). Replay mode re-runs the kept rows from the base, windows and
        states in one launch (`gated_delta_restore`); stash mode copies the windows and the last
        kept row's stashed states, also one launch (`stash_restore`).

        `live` (int32 `[1]`): the live rows the round's step ran with (its ladder window,
        `live_rows_from`). In replay mode a round that kept exactly those rows needs no restore
        either: the step wrote the state and window after its last live row, so the restore reads
        that row count as -1 (in the same launch; `round_params` is left as the settlement wrote it)."""
        base, dst, params = self._cur, 1 - self._cur, self.round_params
        if self.mode == "replay":  # the windows and the states in one op (one launch with the kernels)
            self._ops.gated_delta_restore(self._qkv_all, self._g_all, self._beta_all, self._rec2[base],
                                          self.n_k_heads, params, self._rec2[dst], self._conv2[base], self._xs_all,
                                          self._conv2[dst], live)
            return
        if self._width is None:
            raise ValueError("restore_round runs after a fixed step (in a round graph)")
        # the stash holds every row's state (rows -1: the step's last); the windows and the states in one op
        self._ops.stash_restore(self._stash_all, params, self._width, self._rec2[dst], self._conv2[base],
                                self._xs_all, self._conv2[dst])

    def settled_on_device(self, end: int) -> None:
        """The host's side of a round whose graph ran `restore_round`: its fixed step ran at
        `length` and kept positions up to `end`; the state after them is in the other buffer,
        which becomes the committed one. The round's record is spent (its base buffer is the
        next round's destination): no rollback reaches back into it."""
        start = self._length
        if self._width is None or not 0 < end - start <= self._width:
            raise ValueError(f"settled to {end}: a round at {start} keeps 1..{self._width} rows")
        self._cur = 1 - self._cur
        self._length = end
        self._forget()
        self._why_not = "its last round was settled on the device (nothing kept to roll back into)"

    def _ran_eager(self, start: int, rows: int) -> None:
        """An eager `forward` ran `rows` rows from `start` (after `_new_base(start)` when it kept
        them in the ring, i.e. `rows <= ring`) and committed them all at once, in place."""
        self._final_at = None
        if rows <= self.ring:
            self._recorded = start + rows
            self._why_not = ""
        else:
            self._forget()
            self._why_not = (f"the last step ran {rows} rows, more than the rollback limit "
                             "(rollback_rows), so its per-row states were not kept")
        self._length, self._pending, self._continues = start + rows, None, False


# --------------------------------------------------------------------------- the model


class Qwen35Target(TargetBase):
    """Qwen3.5 hybrid target (models/base.py `TargetModel`). Tap `i` = raw output of decoder layer
    `i`, `-1` = the embedding output.

    `rollback_mode`: "stash" (per-row states) or "replay" (step-start state + per-row inputs);
    `rollback_rows`: eager steps longer than this (a prompt) keep no per-row record, and a
    runner step's fixed-width chunks are recorded back to this many rows (the size of a state's
    ring; a fixed step may not be wider). `step_ops` (layers/step_ops.py; `Engine.load` picks the
    Triton kernels on CUDA) runs every op of a step but the weight matmuls (`_run`)."""

    supports_cuda_graphs = True
    state_class = Qwen35State
    loader_class = _Loader  # the weights' reader (the MoE hybrid's adds its experts)
    routes_experts = False  # the config this class loads: dense (cfg.moe None) or mixture-of-experts

    def __init__(self, cfg: Qwen35Config, embed: torch.Tensor, layers: list[LayerWeights],
                 norm: torch.Tensor, lm_head: torch.Tensor, rollback: str | None = None,
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
        self.scale = 1.0 / math.sqrt(cfg.head_dim)  # what SDPA uses by default
        self.step_ops = TorchStepOps()  # the fixed-width step's ops (Engine.load may pick the kernels)
        self.set_rollback(default_rollback(self.device) if rollback is None else rollback, rollback_rows)

    @classmethod
    def from_dir(cls, path: str | Path, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu", rollback: str | None = None,
                 checkpoint: Checkpoint | None = None) -> "Qwen35Target":
        """Load a Qwen3.5 directory (either layout; single or sharded safetensors). The vision
        tower (`model.visual.*`) and MTP head (`mtp.*`) are recognized and skipped (counted in
        `load_note`, logged). `rollback` None: `default_rollback(device)`. `checkpoint`: its headers
        when the caller opened them already (`Engine.load`)."""
        path = Path(path)
        cfg = load_qwen35_config(path)
        if rollback is not None and rollback not in ROLLBACK_MODES:  # before the weights load
            raise ConfigError(f"rollback mode must be one of {'|'.join(ROLLBACK_MODES)}, got {rollback!r}")
        if (cfg.moe is not None) != cls.routes_experts:
            raise UnsupportedError(f"{cfg.source}: model_type {cfg.model_type!r} is not a {cls.__name__} target "
                                   f"({'a mixture-of-experts' if cfg.moe is not None else 'a dense'} Qwen3.5 hybrid)")
        ckpt = open_checkpoint(path) if checkpoint is None else checkpoint
        loader = cls.loader_class(ckpt, cfg, dtype, torch.device(device))
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
                f"{skipped['model.visual.']} model.visual.* and {skipped['mtp.']} mtp.* tensor(s)"
                + loader.describe())
        mode = default_rollback(torch.device(device)) if rollback is None else rollback
        note += (f"; rollback record {mode} (" + ("as asked" if rollback is not None else
                 f"the default on {torch.device(device).type}, the faster one measured there") + ")")
        log.info("%s", note)
        if extra:
            log.warning("%s: %d tensor(s) not used by the Qwen3.5 target, e.g. %s", path, len(extra), extra[0])
        return cls(cfg, embed, layers, loader.norm_1p(loader.prefix + "norm.weight"), lm_head,
                   rollback=mode, note=note)

    def set_rollback(self, mode: str, rows: int | None = None) -> None:
        """How steps are recorded for a rollback: "stash" | "replay", and `rollback_rows`. Takes
        effect for states made after the call (a state's buffers are allocated once)."""
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
        windows and recurrent states, and the rollback record's buffers (`rollback_rows` ring
        rows in this target's rollback mode), all allocated here, once."""
        cfg = self.cfg
        kv = torch.zeros(len(cfg.full_layers), 2, self.n_kv, rows, self.head_dim, dtype=self.dtype, device=self.device)
        rec_shape = (cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim)
        return Qwen35State(kv, (cfg.linear_conv_kernel_dim - 1, cfg.conv_dim), rec_shape, len(cfg.linear_layers),
                           self.dtype, self.device, rows, self.rollback_rows, self.rollback_mode,
                           cfg.linear_num_key_heads, self.step_ops)

    # ----------------------------------------------------------------------- forward

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Embedding rows `[t, hidden]` (the step ops' gather: a copy of the rows either way)."""
        return self.step_ops.embed(ids, self.embed_weight)

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        """The model's final (zero-centred) RMSNorm."""
        return rms_norm_1p(x, self.norm, self.cfg.rms_norm_eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`[t, vocab]` float32 logits (matmul in the model dtype, widened after, as HF)."""
        return self.lm_head(hidden).float()

    def lm_head(self, hidden: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        """`logits` before the widening: `[t, vocab]` in the model dtype (`weight`: rows of the
        lm_head instead, a draft vocabulary's: `[t, rows]`)."""
        return self.step_ops.linear(hidden, self._lm_head if weight is None else weight)

    def forward(self, ids: torch.Tensor, start: int, state: Qwen35State,
                taps: Sequence[int] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run `ids [t]` at positions `start..start+t-1` over the committed context; commit them
        (`state.length = start + t`). `start` below the length is an implicit `rollback(start)`
        (refused unless the state can). Returns the final-normed hidden `[t, hidden]` and, with
        `taps`, `[t, len(taps)*hidden]`. Rows of a step of at most `rollback_rows` are recorded
        for a rollback; a longer prompt (from 0) runs the DeltaNet recurrence in its chunked form
        when `chunked_prefill` is on."""
        t = ids.shape[0]
        end = start + t
        self.check_span(start, t, state)
        self.ensure_positions(end)
        if taps:
            self.check_taps(taps)
        if start < state.length:
            state.rollback(start)
        keep = t <= state.ring
        if keep:
            state._new_base(start)
        mask = self._mask(start, t)

        def attend(q, kv, qgkv):  # the prep wrote K/V at positions start..end-1; then the output gate
            return self.step_ops.output_gate(self._attend(q, kv[0, :, :end], kv[1, :, :end], mask), qgkv, self.n_heads)

        positions = torch.arange(start, end, device=self.device)
        ring_idx = positions % state.ring if keep else None
        chunked = not keep and start == 0 and self.chunked_prefill
        hidden, tapped = self._run(ids, positions, attend, state, ring_idx, chunked, True, taps)
        state._ran_eager(start, t)
        return hidden, tapped

    batched_taps = True

    @torch.no_grad()
    def forward_taps(self, ids: torch.Tensor, taps: Sequence[int],
                     lengths: Sequence[int] | None = None) -> torch.Tensor:
        """`TargetBase.forward_taps` with the batch's `B*L` rows in every matmul but the mixers':
        the embedding, norms, feed-forward (a MoE hybrid's experts read once for the batch) at
        once; each sequence's mixer (gated attention, or the DeltaNet conv and recurrence, with
        their projections) on a fresh state of its own, as `forward` runs it from position 0
        (the chunked recurrence past `rollback_rows`); stops after the deepest tap. Padding rows
        past a sequence's length run too and are zeroed after: both mixers are causal. The rows
        agree with `forward`'s to rounding."""
        self.check_tap_batch(ids, taps)
        B, L = ids.shape
        self.ensure_positions(L)
        ops, eps = self.step_ops, self.cfg.rms_norm_eps
        states = [self.new_state(L) for _ in range(B)]
        positions = torch.arange(L, device=self.device)
        chunked = L > self.rollback_rows and self.chunked_prefill  # forward's choice for a prompt from 0
        mask = self._mask(0, L)

        def attend(q, kv, qgkv):
            return ops.output_gate(self._attend(q, kv[0, :, :L], kv[1, :, :L], mask), qgkv, self.n_heads)

        h, x = ops.embed_rms_norm_1p(ids.reshape(-1).to(self.device), self.embed_weight, self.layers[0].attn_norm, eps)
        wanted = set(taps)
        tapped: dict[int, torch.Tensor] = {-1: x} if -1 in wanted else {}
        for li in range(max(taps) + 1):
            w = self.layers[li]
            rows = [h[b * L:(b + 1) * L] for b in range(B)]
            if w.attn is not None:
                parts = [self._attention(r, w.attn, positions, attend, st.kv[self._full_slot[li]])
                         for r, st in zip(rows, states)]
            else:
                parts = [self._gdn(r, w.gdn, st, self._lin_slot[li], None, chunked, True)
                         for r, st in zip(rows, states)]
            h, x = ops.add_rms_norm_1p(torch.cat(parts), x, w.mlp_norm, eps)
            next_norm = self.layers[li + 1].attn_norm if li + 1 < len(self.layers) else self.norm
            h, x = self._ffn_add_norm(h, x, w, next_norm)
            if li in wanted:
                tapped[li] = x
        return batch_taps(tapped, taps, B, L, ids.device, lengths)

    def static_step(self, ids: torch.Tensor, positions: torch.Tensor, state: Qwen35State,
                    taps: Sequence[int] | None = None, widen: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The fixed-width step (as Qwen3Target's), capturable: `ids [W]` at device `positions
        [W]` continuing the committed state (`_run`: every op but the weight matmuls is a step
        op). Attention layers: `step_ops.attention` over the cache by position. DeltaNet layers:
        the conv over all W rows and the recurrence over the state's live rows (`state.live`:
        the rows after them are padding) from the committed conv window and state, which this
        step only reads; the rows go into the state's ring by position % ring (conv inputs, plus
        the per-row states or the recurrence inputs). Nothing reads a host value that changes
        from step to step, so a CUDA graph replays it; `state.commit(end)` then keeps the real
        rows (runs no kernel of the step). Returns float32 logits `[W, vocab]` (`widen=False`:
        the lm_head's model-dtype output) and taps."""
        hidden, tapped = self._static_hidden(ids, positions, state, taps)
        return (self.logits(hidden) if widen else self.lm_head(hidden)), tapped

    def static_step_picks(self, ids: torch.Tensor, positions: torch.Tensor, state: Qwen35State,
                          taps: Sequence[int] | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """A greedy round's step (spec/round_bodies.py `greedy_step`): `static_step(widen=False)`
        and the argmax of its logits -> (picks int64 `[W]`, model-dtype logits `[W, vocab]`, taps),
        the lm_head and its argmax one step op (`lm_head_argmax`: one launch with the kernels where
        the lm_head runs the dense kernel, as at the 4B's vocabulary; the same picks either way)."""
        hidden, tapped = self._static_hidden(ids, positions, state, taps)
        logits, picks = self.step_ops.lm_head_argmax(hidden, self._lm_head)
        return picks, logits, tapped

    def _static_hidden(self, ids: torch.Tensor, positions: torch.Tensor, state: Qwen35State,
                       taps: Sequence[int] | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`static_step` up to the final norm: (normed hidden `[W, hidden]`, taps)."""
        width = ids.shape[0]
        if width > state.ring:
            raise ConfigError(f"a fixed step of {width} rows is wider than rollback_rows ({state.ring}): "
                              "its rows could not all be recorded for a rollback")
        self.ensure_positions(state.max_len)
        state._pending, state._width = (state.length, width), width  # Python: runs eagerly or at capture only
        ops = self.step_ops

        def attend(q, kv, qgkv):  # the prep wrote K/V at positions; the output gate in the same op
            return ops.gated_attention(q, kv[0], kv[1], positions, self.scale, qgkv, self.n_heads)

        return self._run(ids, positions, attend, state, positions % state.ring, False, False, taps)

    def _mask(self, start: int, t: int) -> torch.Tensor | None:
        if t == 1:
            return None
        keys = torch.arange(start + t, device=self.device)
        queries = torch.arange(start, start + t, device=self.device)
        mask = keys[None, :] <= queries[:, None]
        return mask.repeat(self.n_heads // self.n_kv, 1)

    def _run(self, ids: torch.Tensor, positions: torch.Tensor, attend, state: Qwen35State,
             ring_idx: torch.Tensor | None, chunked: bool, commit_now: bool, taps: Sequence[int] | None
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The decoder over `ids [t]` at device `positions [t]` -> (final-normed hidden, taps):
        attention layers through `attend(q, kv, qgkv)` (K/V already written; gated), DeltaNet layers from the
        committed state over all t rows (recorded at `ring_idx` when given; committed at once when
        `commit_now`, the eager forward).

        Every op but the weight matmuls goes through `step_ops`, and each residual add is fused
        into the norm after it (the last into the final norm), as Qwen3's static_step: a layer is
        norm, mixer (projection, fused prep, conv / recurrence or attention, fused epilogue, out
        projection), add + norm, MLP (gate_up, SiLU·mul, down), add + the next layer's norm. The
        torch ops compute each value with the same ops as the unfused layer, so the bits do not
        change."""
        ops, eps = self.step_ops, self.cfg.rms_norm_eps
        h, x = ops.embed_rms_norm_1p(ids, self.embed_weight, self.layers[0].attn_norm, eps)  # one launch
        wanted = set(taps or ())
        tapped: dict[int, torch.Tensor] = {-1: x} if -1 in wanted else {}
        for li, w in enumerate(self.layers):
            if w.attn is not None:
                mixer_out = self._attention(h, w.attn, positions, attend, state.kv[self._full_slot[li]])
            else:
                mixer_out = self._gdn(h, w.gdn, state, self._lin_slot[li], ring_idx, chunked, commit_now)
            h, x = ops.add_rms_norm_1p(mixer_out, x, w.mlp_norm, eps)
            next_norm = self.layers[li + 1].attn_norm if li + 1 < len(self.layers) else self.norm
            h, x = self._ffn_add_norm(h, x, w, next_norm)
            if li in wanted:
                tapped[li] = x
        taps_out = torch.cat([tapped[i] for i in taps], dim=-1) if taps else None
        return h, taps_out

    def _ffn_add_norm(self, h: torch.Tensor, x: torch.Tensor, w: LayerWeights, next_norm: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """A layer's end: the feed-forward on the normed `h [t, hidden]`, the residual add to `x`
        and the next zero-centred norm (`next_norm`: float32 1 + w) -> (normed, new residual); the
        MoE hybrid runs its experts and shared expert into the add + norm (models/qwen3_5_moe.py)."""
        return self.step_ops.add_rms_norm_1p(self._feed_forward(h, w), x, next_norm, self.cfg.rms_norm_eps)

    def _feed_forward(self, h: torch.Tensor, w: LayerWeights) -> torch.Tensor:
        """A layer's feed-forward on the normed `h [t, hidden]`, before the residual add: the
        SwiGLU MLP here (a family with a routed one overrides it, models/qwen3_5_moe.py)."""
        ops = self.step_ops
        return ops.linear(ops.swiglu(h, w.w_gate_up), w.w_down)

    def _attention(self, h: torch.Tensor, w: AttnWeights, positions: torch.Tensor, attend,
                   kv: torch.Tensor) -> torch.Tensor:
        """A gated attention mixer over `h [t, hidden]` -> `[t, hidden]`: the fused projection
        (per query head `[q | gate]`, then k, v), q/k zero-centred norms + partial rope + the K/V
        write at `positions` (one step op), `attend(q, kv, qgkv)`: attention then `out *
        sigmoid(gate)`, the gate read from the projection (one step op in a fixed step, whose
        kernels gate in the attention's combine launch), o_proj. `kv [2, nkv, S, hd]`."""
        ops = self.step_ops
        qgkv = ops.linear(h, w.wqkv, w.bqkv)
        q = ops.gated_qk_norm_rope_kv_write(qgkv, w.q_norm, w.k_norm, self._cos, self._sin, positions, kv[0], kv[1],
                                            self.n_heads, self.n_kv, self.cfg.rms_norm_eps)
        return ops.linear(attend(q, kv, qgkv), w.wo, w.bo)

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                mask: torch.Tensor | None) -> torch.Tensor:
        """GQA attention of `q [t, nh, hd]` over `keys/values [nkv, n, hd]` -> `[t, nh*hd]`."""
        t, nh, nkv, hd = q.shape[0], self.n_heads, self.n_kv, self.head_dim
        g = nh // nkv
        qf = q.view(t, nkv, g, hd).permute(1, 2, 0, 3).reshape(nkv, g * t, hd)
        out = F.scaled_dot_product_attention(qf, keys, values, attn_mask=mask)
        return out.view(nkv, g, t, hd).permute(2, 0, 1, 3).reshape(t, nh * hd)

    def _gdn(self, h: torch.Tensor, w: GdnWeights, state: Qwen35State, slot: int, ring_idx: torch.Tensor | None,
             chunked: bool, commit_now: bool) -> torch.Tensor:
        """A Gated DeltaNet mixer over `h [t, hidden]` from layer `slot`'s committed conv window
        and state -> `[t, hidden]`. With `ring_idx [t]` the rows are recorded into the state's
        ring (conv inputs; per-row states in stash mode, conv outputs, g and beta in replay mode);
        with `commit_now` the window and state after the last row replace the committed ones (in
        place). `chunked`: a long prefill's WY form (nothing recorded, committed at once)."""
        cfg, ops = self.cfg, self.step_ops
        hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        mixed, z, ba = ops.linear(h, w.w_in).split([cfg.conv_dim, cfg.value_dim, 2 * hv], dim=-1)
        window, rec = state.conv[slot], state.rec[slot]
        stash, final, xs_ring, replay = None, (rec if commit_now else None), None, None
        final_window, live = None, None
        if ring_idx is not None:  # the step's rollback record, written by the conv + gates op
            xs_ring = state._xs[slot]
            if not commit_now:  # a fixed step: its last live row's window (and state) into the other buffer
                final_window, live = state._final_window[slot], state.live
            if state.mode == "stash":
                stash = state._stash[slot]
            else:
                replay = (state._qkv[slot], state._g[slot], state._beta[slot])
                if not commit_now:
                    final = state._final[slot]
        # the conv, the gates, the record and the window after the last row: one op (one launch
        # with the kernels), so a commit that keeps every row moves nothing (Qwen35State)
        conv, g, beta = ops.gdn_conv_gates(window, mixed, w.conv, ba, w.a_neg, w.dt_bias, ring_idx, xs_ring, replay,
                                           final_window=final_window, live=live)
        if chunked:
            q, k, v = prep_qkv(conv, hk, hv, dk, dv)
            core, final = gated_delta_rule_chunked(q, k, v, g, beta, rec)
            rec.copy_(final)
        else:
            core = ops.gated_delta_rule(conv, g, beta, rec, hk, final=final, stash=stash,
                                        stash_idx=None if stash is None else ring_idx, live=live)
        if commit_now:
            window.copy_(torch.cat([window, mixed], dim=0)[-window.shape[0]:])
        return ops.linear(ops.gated_rms_norm(core, z, w.norm, cfg.rms_norm_eps), w.w_out)
