"""Gated DeltaNet pieces (Qwen3.5's linear-attention mixer) and its zero-centred norms: the
plain-torch reference, any device.

Numerics follow transformers' `Qwen3_5GatedDeltaNet` torch fallback (`torch_causal_conv1d_update`,
`torch_recurrent_gated_delta_rule`, `torch_chunk_gated_delta_rule`) and `Qwen3_5RMSNorm` /
`Qwen3_5RMSNormGated`. These are the functions a GPU path swaps for kernels (fla's
`fused_recurrent_gated_delta_rule` / `chunk_gated_delta_rule`, causal-conv1d): model files call
only these, never a kernel.

Exactness across groupings: `causal_conv_silu` is a fixed-order sum over the K taps, elementwise,
and `gated_delta_rule` runs one row at a time with the same ops whatever the row count, so a
row's value never depends on how many rows share the call.

`conv_silu_update` and `gated_delta_step` are the fixed-width step's two operations in the form
the step-ops seam (layers/step_ops.py) exposes, the torch side of `memra_kernels.deltanet`'s
kernels (same signatures): the step passes the kept conv window and the conv output rows, and
the recurrence writes its final state / per-row stash into buffers it is given, so a CUDA graph
can bind them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from memra_kernels.deltanet_ref import causal_conv_silu_body as causal_conv_silu  # noqa: F401  the op's one body
from memra_kernels.deltanet_ref import delta_rule_row
from memra_kernels.norm_ref import rms_norm_1p_ref as rms_norm_1p  # noqa: F401  HF Qwen3_5RMSNorm: the op's one body
from memra_kernels.norm_ref import gated_rms_norm_body as gated_rms_norm  # noqa: F401  HF Qwen3_5RMSNormGated: the op's one body


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """HF/fla l2norm over the last axis: `x * rsqrt(sum(x^2) + eps)`."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                     beta: torch.Tensor, state: torch.Tensor, keep_states: bool = False,
                     states_out: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The delta-rule recurrence, one row at a time (HF `torch_recurrent_gated_delta_rule`).

    q, k `[t, Hv, dk]` (float32, L2-normalized, q scaled by 1/sqrt(dk), already repeated to the
    value heads), v `[t, Hv, dv]`, g (log decay) and beta `[t, Hv]`, all float32; `state
    [Hv, dk, dv]` float32 (not modified). Per row:

        S = S * exp(g);  delta = (v - k.S) * beta;  S = S + k (x) delta;  o = q.S

    Returns out `[t, Hv, dv]` float32, the state after the last row and, with `keep_states`, the
    state after every row `[t, Hv, dk, dv]` (row i's state is exactly what a run stopped at row i
    returns); `states_out [t, Hv, dk, dv]` is where to write them (else they are allocated).
    """
    t = q.shape[0]
    out = torch.empty_like(v)
    states = states_out
    if keep_states and states is None:
        states = torch.empty((t, *state.shape), dtype=state.dtype, device=state.device)
    s = state
    for i in range(t):
        # per row, as HF: a row's ops never depend on t; with a stash the add writes straight into it
        s, out[i] = delta_rule_row(s, q[i], k[i], v[i], g[i], beta[i], None if states is None else states[i])
    return out, s, states


def gated_delta_rule_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                             beta: torch.Tensor, state: torch.Tensor, chunk: int = 64
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """The same recurrence in chunked (WY / UT-transform) form, as HF `torch_chunk_gated_delta_rule`
    (what transformers runs for a prefill): the same arguments, out `[t, Hv, dv]` and the final
    state, equal to `gated_delta_rule`'s to float32 rounding. For long prefills only (no per-row
    states: nothing can roll back into them); every later row runs the sequential form."""
    t, hv, _ = k.shape
    dv = v.shape[-1]
    q, k, v = (x.transpose(0, 1) for x in (q, k, v))  # [Hv, t, d]
    g, beta = g.transpose(0, 1), beta.transpose(0, 1)  # [Hv, t]
    pad = (chunk - t % chunk) % chunk
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    n = (t + pad) // chunk
    v_beta, k_beta = v * beta.unsqueeze(-1), k * beta.unsqueeze(-1)
    q, k, k_beta, v_beta = (x.reshape(hv, n, chunk, x.shape[-1]) for x in (q, k, k_beta, v_beta))
    cum = g.reshape(hv, n, chunk).cumsum(dim=-1)
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    pair = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()
    ut = (k_beta @ k.transpose(-1, -2)) * pair
    intra = (q @ k.transpose(-1, -2)) * pair
    new_v = torch.linalg.solve_triangular(ut, v_beta, upper=False, unitriangular=True)
    k_cum = torch.linalg.solve_triangular(ut, k_beta * cum.exp().unsqueeze(-1), upper=False, unitriangular=True)
    q = q * cum.exp().unsqueeze(-1)
    k = k * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    chunk_decay = cum[..., -1].exp()[..., None, None]
    out = torch.zeros_like(new_v)
    s = state
    for i in range(n):
        v_new = new_v[:, i] - k_cum[:, i] @ s
        out[:, i] = q[:, i] @ s + intra[:, i] @ v_new
        s = s * chunk_decay[:, i] + k[:, i].transpose(-1, -2) @ v_new
    return out.reshape(hv, n * chunk, dv)[:, :t].transpose(0, 1), s


def prep_qkv(qkv: torch.Tensor, n_k_heads: int, n_v_heads: int, dk: int, dv: int
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The conv output `qkv [t, 2*Hk*dk + Hv*dv]` -> the recurrence's float32 q, k `[t, Hv, dk]`
    (L2-normalized, q divided by sqrt(dk), key heads repeated to the value heads) and v `[t, Hv, dv]`."""
    t, key_dim = qkv.shape[0], n_k_heads * dk
    q, k, v = qkv.split([key_dim, key_dim, n_v_heads * dv], dim=-1)
    qf = l2norm(q.reshape(t, n_k_heads, dk).float())
    kf = l2norm(k.reshape(t, n_k_heads, dk).float())
    if n_v_heads != n_k_heads:
        qf = qf.repeat_interleave(n_v_heads // n_k_heads, dim=1)
        kf = kf.repeat_interleave(n_v_heads // n_k_heads, dim=1)
    return qf / (dk ** 0.5), kf, v.reshape(t, n_v_heads, dv).float()


def conv_silu_update(window: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """`causal_conv_silu` of rows `x [t, C]` after the kept window `[K-1, C]` -> `[t, C]`."""
    return causal_conv_silu(torch.cat([window, x], dim=0), w)


def _delta_row(s: torch.Tensor, g: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """One row of the delta rule: `s [Hv, dk, dv]` after decay `exp(g) [Hv]` and the update with
    the (normalized) key `k [Hv, dk]`, value `v [Hv, dv]` and `beta [Hv]` (every float32)."""
    s = s * g.exp()[:, None, None]
    k_i = k.unsqueeze(-1)
    kv_mem = (s * k_i).sum(dim=-2)
    delta = (v - kv_mem) * beta.unsqueeze(-1)
    return s + k_i * delta.unsqueeze(-2)


def gated_delta_step(qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor,
                     n_k_heads: int, final: torch.Tensor | None = None, stash: torch.Tensor | None = None,
                     stash_idx: torch.Tensor | None = None, live: torch.Tensor | None = None) -> torch.Tensor:
    """The recurrence over a step's conv output rows `qkv [t, C]`, `g`, `beta` `[t, Hv]` float32,
    from `state [Hv, dk, dv]` (read; may also be `final`). Returns out `[t, Hv, dv]` float32;
    writes the state after the last row into `final` and the state after row r into
    `stash[stash_idx[r]]` when given. `prep_qkv` then `gated_delta_rule`'s per-row ops, so its
    numbers are `gated_delta_rule`'s bit for bit.

    `live` (int32 `[1]`): rows from `min(t, live)` on are a fixed step's padding, as in
    `memra_kernels.deltanet.gated_delta_rule`: zero outputs, no state update (`final` gets the
    last live row's state). Read on the device, not the host (a CUDA graph captures this form
    too): every row runs and a select keeps the padding ones out, the same bits for the live rows."""
    hv, dk, dv = state.shape
    q, k, v = prep_qkv(qkv, n_k_heads, hv, dk, dv)
    out = torch.empty_like(v)
    s = state
    for i in range(qkv.shape[0]):
        new = _delta_row(s, g[i], k[i], v[i], beta[i])
        if live is None:
            s = new
            out[i] = (s * q[i].unsqueeze(-1)).sum(dim=-2)
        else:
            keep = live[0] > i
            s = torch.where(keep, new, s)
            out[i] = torch.where(keep, (s * q[i].unsqueeze(-1)).sum(dim=-2), 0.0)
        if stash is not None:
            stash.index_copy_(0, stash_idx[i:i + 1], s.unsqueeze(0))  # device index: capturable
    if final is not None:
        final.copy_(s)
    return out


def gated_delta_replay(qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor,
                       n_k_heads: int, row0: int, rows: int, final: torch.Tensor) -> None:
    """Every layer's recurrence over recorded ring rows, the form a rollback's replay takes (the
    torch side of `memra_kernels.deltanet.gated_delta_rule_layers`, same signature): layer l runs
    rows `(row0 + r) % ring`, r < rows, of `qkv [L, ring, C]`, `g`, `beta [L, ring, Hv]` from
    `state [L, Hv, dk, dv]` and writes the state after the last row into `final [L, Hv, dk, dv]`.
    Layer by layer through `gated_delta_step`, so the states are the step's bits."""
    ring = qkv.shape[1]
    idx = (torch.arange(rows, device=qkv.device) + row0) % ring
    for i in range(state.shape[0]):
        gated_delta_step(qkv[i].index_select(0, idx), g[i].index_select(0, idx), beta[i].index_select(0, idx),
                         state[i], n_k_heads, final=final[i])


def gated_delta_replay_dev(qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor,
                           n_k_heads: int, params: torch.Tensor, final: torch.Tensor) -> None:
    """`gated_delta_replay` with `(row0, rows)` = `params` (int32 `[2]`) read on the device, the form
    a graphed rollback takes (`memra_kernels.deltanet.gated_delta_replay_dev`); `rows` -1 writes
    nothing (`final` already holds the state). No host read, so a graph body (or the tests'
    eager stand-in of one) may run it: every ring row goes through `_delta_row`, and a row past
    `rows` leaves the state as it was (`torch.where` picks, so the kept rows' bits are the step's).
    A CPU cost of `ring` rows per layer, not `rows`: the eager rollback (`gated_delta_replay`)
    is the CPU's path; this one serves graphed rounds."""
    n, hv, dk, dv = state.shape
    ring = qkv.shape[1]
    row0, rows = params[0].long(), params[1].long()
    idx = (torch.arange(ring, device=qkv.device) + row0) % ring
    for i in range(n):
        _, k, v = prep_qkv(qkv[i].index_select(0, idx), n_k_heads, hv, dk, dv)
        g_i, beta_i = g[i].index_select(0, idx), beta[i].index_select(0, idx)
        s = state[i]
        for r in range(ring):
            s = torch.where(r < rows, _delta_row(s, g_i[r], k[r], v[r], beta_i[r]), s)
        final[i].copy_(torch.where(rows >= 0, s, final[i]))


def gated_delta_restore(qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor,
                        n_k_heads: int, params: torch.Tensor, final: torch.Tensor, window: torch.Tensor,
                        xs: torch.Tensor, final_window: torch.Tensor, live: torch.Tensor | None = None) -> None:
    """A graphed rollback's restore (`memra_kernels.deltanet.gated_delta_restore`, one launch
    there): `ring_window(window, xs, params, final_window)` and `gated_delta_replay_dev(qkv, g,
    beta, state, n_k_heads, params, final)`, with a row count equal to `live` (int32 `[1]`: the
    live rows the recorded step ran, which wrote the state and window after them) read as -1.
    On the device, no host read; `params` is left as it is."""
    if live is not None:
        params = torch.cat([params[:1], torch.where(params[1:] == live, -1, params[1:])])
    ring_window(window, xs, params, final_window)
    gated_delta_replay_dev(qkv, g, beta, state, n_k_heads, params, final)


def stash_restore(stash: torch.Tensor, params: torch.Tensor, width: int, final: torch.Tensor,
                  window: torch.Tensor, xs: torch.Tensor, final_window: torch.Tensor) -> None:
    """A stash-mode round's restore (`memra_kernels.deltanet.stash_restore`, one launch there):
    `ring_window(window, xs, params, final_window)` and every layer's stashed state of the last
    kept row, `final[l] = stash[l, (row0 + rows - 1) % ring]` (rows -1: all `width` rows), read on
    the device."""
    ring_window(window, xs, params, final_window)
    rows = torch.where(params[1] < 0, width, params[1]).long()
    last = (params[0].long() + rows - 1) % stash.shape[1]
    final.copy_(stash.index_select(1, last.reshape(1)).squeeze(1))


def ring_window(base: torch.Tensor, xs: torch.Tensor, params: torch.Tensor, out: torch.Tensor) -> None:
    """Every layer's conv window after recorded ring rows: `out` `[L, K-1, C]` = the last K-1 rows
    of `[base; xs[:, (row0 + r) % ring] for r < rows]`, `(row0, rows)` = `params` (int32 `[2]`),
    read on the device (`rows` -1 writes nothing: `out` already holds the window)."""
    k1, ring = base.shape[1], xs.shape[1]
    row0, rows = params[0].long(), params[1].long()
    i = rows.clamp(min=0) + torch.arange(k1, device=xs.device)  # rows of [base; ring rows]
    from_base = (i < k1)[None, :, None]
    a = base.index_select(1, i.clamp(max=k1 - 1))
    b = xs.index_select(1, (row0 + (i - k1).clamp(min=0)) % ring)
    out.copy_(torch.where(rows >= 0, torch.where(from_base, a, b), out))
