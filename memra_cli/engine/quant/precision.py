"""Drafter weight precision policies (the reference engine's `MEMRA_DFLASH_PREC` seam, `DflashDraft::load`).

A policy maps every checkpoint tensor to a storage decision, by name (the reference engine's `upw`):

    policy   attention q/k/v/o   MLP gate/up/down   fc      markov w2
    f32      f32                 f32                f32     f32
    bf16     bf16                bf16               bf16    bf16
    q8       q8_0                q8_0               q8_0    q8_0
    mixed    bf16                q8_0               bf16    q8_0
    fc       q8_0                q8_0               bf16    q8_0
    q4       q4_0                q4_0               q4_0    q4_0

Norm weights are f32 (the reference engine widens them at load); the markov `w1` (a gathered table, never a
matmul) and anything else the census knows (own embed / lm_head tables) stay as stored; the
confidence head stays f32. Markov `w2` follows the policy except under `bf16`, where it is bf16
(the reference engine: q8_0 would put quantization error inside the markov-logits parity gate); under
`mixed` and `fc` it is q8_0 as in the reference engine, under `q4` it is q4_0. A tensor whose rows are not a
whole number of 32-value blocks is kept unquantized (as stored) and the decision says why.

`decide` is pure (names and shapes only): `memra quantize` (quant/gguf_write.py) writes what it
says, and `weight_fn_for(policy)` applies it at load time (Drafter.load's `weight_fn`) with the
same encoder (quant/blocks.py), so a GGUF written under a policy and a safetensors drafter
quantized at load under it hold the same bytes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from memra_cli.engine.errors import MemraError, SettingError
from memra_cli.engine.formats.names import CONF_B, CONF_W, MARKOV_W1, MARKOV_W2

POLICIES = ("f32", "bf16", "q8", "mixed", "fc", "q4")  # MEMRA_DFLASH_PREC / --prec values
FILE_POLICIES = ("q8", "mixed", "fc", "q4")  # what `memra quantize` writes
QUANT_TYPES = ("q8_0", "q4_0")

_ATTN = re.compile(r"^layers\.\d+\.self_attn\.[qkvo]_proj\.weight$")
_MLP = re.compile(r"^layers\.\d+\.mlp\.(gate|up|down)_proj\.weight$")
_NORM = re.compile(r"^(layers\.\d+\.(input_layernorm|post_attention_layernorm|self_attn\.[qk]_norm)|hidden_norm|norm)\.weight$")


class PrecisionError(MemraError):
    """An unknown precision policy name."""


def check_policy(policy: str | None, allowed: tuple[str, ...] = POLICIES, flag: str = "MEMRA_DFLASH_PREC / --prec") -> str:
    """Return `policy` if known, else refuse in one line naming the setting and the allowed values."""
    if policy not in allowed:
        raise PrecisionError(f"{flag}: unknown precision policy {policy!r} (expected {'|'.join(allowed)})")
    return policy  # type: ignore[return-value]


def check_prec(prec: str | None) -> None:
    """The `prec` setting (a drafter's weight precision at load): unset, or one of POLICIES."""
    if prec is not None and prec not in POLICIES:
        raise SettingError("prec", prec, f"unknown precision policy (expected {'|'.join(POLICIES)})")


def role_of(name: str) -> str:
    """attention | mlp | fc | markov_w2 | markov_w1 | norm | confidence | other."""
    if _ATTN.match(name):
        return "attention"
    if _MLP.match(name):
        return "mlp"
    if name == "fc.weight":
        return "fc"
    if name == MARKOV_W2:
        return "markov_w2"
    if name == MARKOV_W1:
        return "markov_w1"
    if name in (CONF_W, CONF_B):
        return "confidence"
    if _NORM.match(name):
        return "norm"
    return "other"


MATMUL_ROLES = ("attention", "mlp", "fc", "markov_w2")


@dataclass(frozen=True)
class Decision:
    """How one tensor is stored under a policy.

    storage: "q8_0" | "q4_0" (ggml blocks), "bf16" | "f32" (floats), or "stored" (as in the
    source checkpoint). `kept` is True when the policy asked for a quantized type but the rows
    are not whole blocks; `why` says which rule decided (and, when kept, why not quantized)."""

    name: str
    role: str
    storage: str
    why: str
    kept: bool = False

    @property
    def quantized(self) -> bool:
        return self.storage in QUANT_TYPES


def _matmul_storage(role: str, policy: str) -> tuple[str, str]:
    if policy == "f32":
        return "f32", "f32 policy: every weight f32"
    if policy == "bf16":
        return "bf16", "bf16 policy: every matmul weight bf16"
    if role == "markov_w2":
        q = "q4_0" if policy == "q4" else "q8_0"
        return q, f"markov w2 follows the {policy} policy ({q})"
    if policy == "q8":
        return "q8_0", "q8 policy: every matmul weight q8_0"
    if policy == "q4":
        return "q4_0", "q4 policy: every matmul weight q4_0"
    if policy == "mixed":
        if role == "mlp":
            return "q8_0", "mixed policy: MLP q8_0"
        return "bf16", "mixed policy: attention and fc bf16"
    # fc
    if role == "fc":
        return "bf16", "fc policy: fc bf16"
    return "q8_0", "fc policy: all but fc q8_0"


def decide(name: str, shape: tuple[int, ...] | list[int], policy: str) -> Decision:
    """The storage of tensor `name` (torch-order `shape`) under `policy` (checked)."""
    check_policy(policy)
    role = role_of(name)
    if role == "norm":
        return Decision(name, role, "f32", "norm weights f32")
    if role == "confidence":
        return Decision(name, role, "f32", "confidence head f32")
    if role in ("markov_w1", "other"):
        what = "markov w1 (a gathered table)" if role == "markov_w1" else "not a drafter matmul weight"
        return Decision(name, role, "stored", f"{what}: as stored")
    storage, why = _matmul_storage(role, policy)
    from memra_cli.engine.quant.blocks import QK, quantizable  # torch: imported where used (the CLI checks flags without it)

    if storage in QUANT_TYPES and not (len(shape) == 2 and quantizable(tuple(shape))):
        row = shape[-1] if len(shape) else 0
        return Decision(name, role, "stored",
                        f"rows of {row} values are not a multiple of {QK}: kept unquantized (as stored), "
                        f"not {storage}", kept=True)
    return Decision(name, role, storage, why)


def plan(tensors: dict[str, Any], policy: str) -> dict[str, Decision]:
    """Decisions for a checkpoint's `tensors` ({name: TensorInfo}), in its order."""
    check_policy(policy)
    return {name: decide(name, info.shape, policy) for name, info in tensors.items()}


class PolicyWeightFn:
    """Drafter.load's `weight_fn` for one policy: quantize (or round to bf16) at load time.

    Called as `fn(name, ckpt, dtype, device)` for every matmul weight (attention, MLP, fc,
    markov w2). Returns a `QuantLinearRef` (same encoder and bytes as `memra quantize`) or a
    plain tensor in the compute `dtype` (bf16-rounded where the policy says bf16). Tensors kept
    unquantized (rows not whole blocks) are collected in `kept`, for the caller to report.
    """

    def __init__(self, policy: str):
        self.policy = check_policy(policy)
        self.kept: list[Decision] = []

    def __repr__(self) -> str:
        return f"PolicyWeightFn({self.policy!r})"

    def __call__(self, name: str, ckpt: Any, dtype: Any, device: Any) -> Any:
        import torch

        from memra_cli.engine.quant.blocks import QuantLinearRef

        d = decide(name, ckpt.tensors[name].shape, self.policy)
        if d.kept:
            self.kept.append(d)
        if d.quantized:
            w = ckpt.load(name, torch.float32)  # on the CPU: the encoder is numpy
            return QuantLinearRef.from_float(w, d.storage, name).to(device)
        if d.storage == "bf16":
            return ckpt.load(name, torch.bfloat16, device).to(dtype)
        return ckpt.load(name, dtype, device)


def weight_fn_for(policy: str) -> PolicyWeightFn | None:
    """Drafter.load `weight_fn` for `policy`; None for `f32` (weights as stored, in the compute
    dtype). Unknown names are refused (one line naming MEMRA_DFLASH_PREC / --prec)."""
    check_policy(policy)
    if policy == "f32":
        return None
    return PolicyWeightFn(policy)
