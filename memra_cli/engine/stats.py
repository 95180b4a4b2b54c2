"""Round counters and per-phase timers for speculative (and plain) decoding."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where used: `memra bench` checks its flags before torch loads
    import torch

PHASES = ("prefill", "draft", "verify", "rollback", "ingest")


@dataclass
class DecodeStats:
    """Counters over a session. `tau` = mean committed tokens per round (accepted + 1)."""

    rounds: int = 0
    drafted: int = 0  # draft slots sent to verify (vt - 1 per round)
    accepted: int = 0  # drafts the target agreed with
    tokens: int = 0
    phase_s: dict[str, float] = field(default_factory=lambda: {p: 0.0 for p in PHASES})
    accept_hist: Counter = field(default_factory=Counter)  # accepted drafts per round -> rounds
    wall_s: float = 0.0
    expert_reads: tuple[int, int] | None = None  # MoE target: (sparse-layer steps, experts they ran)
    window_cost: dict | None = None  # the priced window's cost as this prompt resolved it (routed model)

    @property
    def tau(self) -> float:
        return (self.accepted + self.rounds) / self.rounds if self.rounds else 0.0

    @property
    def acceptance(self) -> float | None:
        """accepted / drafted; None when nothing was drafted (no rate to report, not a rate of 0)."""
        return self.accepted / self.drafted if self.drafted else None

    @property
    def decode_s(self) -> float:
        return self.wall_s - self.phase_s["prefill"]

    def as_json(self) -> dict:
        tok_s = self.tokens / self.wall_s if self.wall_s > 0 else None
        return {
            "rounds": self.rounds, "drafted": self.drafted, "accepted": self.accepted,
            "tokens": self.tokens, "tau": self.tau, "acceptance": self.acceptance,
            "tok_per_s": tok_s, "wall_s": self.wall_s,
            "phase_ms": {k: 1e3 * v for k, v in self.phase_s.items()},
            "tau_hist": {str(k + 1): v for k, v in sorted(self.accept_hist.items())},
        } | ({} if self.window_cost is None else {"window_cost": self.window_cost})


class PhaseClock:
    """Accumulates wall time per phase. Synchronises the device at each boundary only when
    timing was asked for (otherwise it would serialise the GPU pipeline for nothing)."""

    def __init__(self, stats: DecodeStats, device: torch.device, synced: bool):
        self.stats, self.synced = stats, synced and device.type == "cuda"
        self.device = device
        self._t = time.perf_counter()

    def _now(self) -> float:
        if self.synced:
            import torch

            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def start(self) -> None:
        self._t = self._now()

    def lap(self, phase: str) -> None:
        now = self._now()
        self.stats.phase_s[phase] += now - self._t
        self._t = now
