"""Sampling at temperature > 0: `SamplingParams`, the one logit processor, and the position-keyed
sampler that keeps speculative decoding lossless and seeded streams reproducible.

The rule. The token a target row at absolute position j selects is

    argmax_v ( process(logits_j)[v] + G(seed, j, v) )

where `process` is temperature, then top-k, top-p, min-p (`process_logits`, the same function
wherever logits are turned into a token), and G is Gumbel noise drawn from a counter-based hash
of (seed, j, v) (`keyed_gumbel`). By the Gumbel-max identity that is one sample from
softmax(process(logits_j)). The selection is a deterministic function of the row's logits, the
seed and the position only, so:

- the speculative round's `accept_prefix` (a draft is kept while it equals the target's own
  selection at its position) commits exactly the token plain decoding would have sampled at that
  position: with the same seed the speculative stream is the plain sampled stream, token for
  token (fixed-width steps make the logits bit-identical, `runtime/steps.py`);
- it is lossless in distribution: each committed token is the target's own sample, with noise
  that is independent across positions (distinct (j, v) keys hash to independent-looking words).

The hash runs on the device as int64 tensor arithmetic kept inside 32-bit lanes: every value
stays in [0, 2^32) and every multiplier is below 2^31, so no product reaches 2^63 (no signed
overflow, no arithmetic-shift surprise), and the result is the same on any device. No Python
RNG, no host sync: only tensor ops (a CUDA graph can capture them). The float work is done in
float64 so that a row's token does not depend on how many rows share its tensor (vectorized and
scalar transcendental paths may differ in their last bit; that bit is 2^-52 here and never
decides an argmax in practice).

Drafts at temperature > 0 are the drafter's own sample with the target's noise at the position
that judges them (`PositionKeyed.drafting`): exactness does not depend on drafts, acceptance
does. `RejectionSampling` is the opt-in alternative (lossless in distribution only).
Temperature 0 is greedy: `make_sampler` returns `GREEDY`, the plain argmax, untouched.
See docs/sampling.md.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

from memra_cli.engine.errors import SettingError
from memra_cli.engine.spec.sampling import ACCEPTANCE_RULES, GREEDY, Sampler, SamplerBase

DEFAULT_SEED = 0  # the seed a sampled run uses when none is given (said in its note / --json)

_MASK32 = 0xFFFFFFFF


# --------------------------------------------------------------------------- settings


@dataclass(frozen=True)
class SamplingParams:
    """How a target row's logits become a token. `temperature` 0 = greedy (argmax; the other
    settings have no effect). `top_k` 0 = off; `top_p` 1 = off; `min_p` 0 = off; `seed` None =
    `DEFAULT_SEED` when sampling. `acceptance`: "keyed" (position-keyed: the stream equals plain
    sampling) or "rejection" (rejection sampling: lossless in distribution only). Refused values
    raise a one-line `SettingError` naming the setting."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    acceptance: str = "keyed"

    def __post_init__(self) -> None:
        t, k, p, mp, s = self.temperature, self.top_k, self.top_p, self.min_p, self.seed
        if self.acceptance not in ACCEPTANCE_RULES:
            raise SettingError("acceptance", self.acceptance, f"expected {'|'.join(ACCEPTANCE_RULES)}", quote=False)
        if not _real(t) or not math.isfinite(t) or t < 0:
            raise SettingError("temperature", t, "expected a finite number >= 0 (0 = greedy)", quote=False)
        if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 0:
            raise SettingError("top_k", k, "expected an integer >= 0 (0 = off)", quote=False)
        if not _real(p) or not 0.0 < p <= 1.0:
            raise SettingError("top_p", p, "expected a number in (0, 1] (1 = off)", quote=False)
        if not _real(mp) or not 0.0 <= mp < 1.0:
            raise SettingError("min_p", mp, "expected a number in [0, 1) (0 = off)", quote=False)
        if s is not None and (isinstance(s, bool) or not isinstance(s, numbers.Integral)):
            raise SettingError("seed", s, "expected an integer", quote=False)
        object.__setattr__(self, "temperature", float(t))
        object.__setattr__(self, "top_k", int(k))
        object.__setattr__(self, "top_p", float(p))
        object.__setattr__(self, "min_p", float(mp))

    @classmethod
    def parse(cls, temperature: str | None = None, top_k: str | None = None, top_p: str | None = None,
              min_p: str | None = None, seed: str | None = None, acceptance: str | None = None) -> "SamplingParams":
        """Settings as text (flags, environment) -> params; unset (None) keeps the default.
        A value that is not a number refuses in one line naming the setting."""
        kw: dict = {} if acceptance is None else {"acceptance": acceptance.strip()}
        for name, text, conv, want in (
            ("temperature", temperature, float, "expected a finite number >= 0 (0 = greedy)"),
            ("top_k", top_k, int, "expected an integer >= 0 (0 = off)"),
            ("top_p", top_p, float, "expected a number in (0, 1] (1 = off)"),
            ("min_p", min_p, float, "expected a number in [0, 1) (0 = off)"),
            ("seed", seed, int, "expected an integer"),
        ):
            if text is None:
                continue
            try:
                kw[name] = conv(str(text).strip())
            except ValueError:
                raise SettingError(name, text, want, quote=False) from None
        try:
            return cls(**kw)
        except SettingError as exc:  # out of range: say the value as it was given
            given = {"temperature": temperature, "top_k": top_k, "top_p": top_p, "min_p": min_p, "seed": seed,
                     "acceptance": acceptance}
            raise SettingError(exc.setting, given[exc.setting], exc.detail, quote=False) from None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def applied_seed(self) -> int | None:
        """The seed a sampled run uses (the default when none was given); None when greedy."""
        if self.greedy:
            return None
        return DEFAULT_SEED if self.seed is None else self.seed

    def as_json(self) -> dict:
        return {
            "temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p, "min_p": self.min_p,
            "seed": self.applied_seed,
            "seed_source": None if self.greedy else ("default" if self.seed is None else "set"),
            "sampler": make_sampler(self).name,
            "acceptance": make_sampler(self).acceptance,
            "identical_to_plain": self.greedy or self.acceptance == "keyed",
        }

    def describe(self) -> str:
        """One line for a note: what ran, the seed (and whether it was the default)."""
        if self.greedy:
            return "sampling: greedy (temperature 0; --temperature samples)"
        parts = [f"temperature {self.temperature:g}"]
        if self.top_k:
            parts.append(f"top-k {self.top_k}")
        if self.top_p < 1.0:
            parts.append(f"top-p {self.top_p:g}")
        if self.min_p > 0.0:
            parts.append(f"min-p {self.min_p:g}")
        seed = f"seed {self.applied_seed}" + (" (default; --seed)" if self.seed is None else " (--seed)")
        rule = ", rejection sampling (--acceptance)" if self.acceptance == "rejection" else ""
        return f"sampling: {', '.join(parts)}, {seed}{rule}"


def _real(x: object) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


# --------------------------------------------------------------------------- processing


def process_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """float logits `[t, V]` -> float64 scores `[t, V]`: divided by the temperature, then -inf
    outside top-k (ties with the k-th value kept), outside top-p (a token is kept while the
    probability mass ranked strictly before it is < top_p; ties ranked by id) and below min-p
    (probability < min_p * the row's largest). softmax(scores) is the distribution a token is
    sampled from. The same function on every path (plain, verify, drafter); row-wise only, so a
    row's scores do not depend on the other rows."""
    assert not params.greedy, "temperature 0 is greedy: no processing"
    z = logits.double() / params.temperature
    V = z.shape[-1]
    if 0 < params.top_k < V:
        kth = torch.topk(z, params.top_k, dim=-1).values[..., -1:]
        z = z.masked_fill(z < kth, -math.inf)
    if params.top_p < 1.0:
        sz, order = torch.sort(z, dim=-1, descending=True, stable=True)
        probs = torch.softmax(sz, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs  # mass ranked strictly before each token
        drop = torch.zeros_like(before, dtype=torch.bool).scatter_(-1, order, before >= params.top_p)
        z = z.masked_fill(drop, -math.inf)
    if params.min_p > 0.0:
        top = z.max(dim=-1, keepdim=True).values  # p_v >= min_p * p_max  <=>  z_v >= z_max + log(min_p)
        z = z.masked_fill(z < top + math.log(params.min_p), -math.inf)
    return z


def processed_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a row samples from, float64 `[t, V]` (greedy: one-hot at the argmax)."""
    if params.greedy:
        return torch.nn.functional.one_hot(torch.argmax(logits, dim=-1), logits.shape[-1]).double()
    return torch.softmax(process_logits(logits, params), dim=-1)


# --------------------------------------------------------------------------- the keyed noise


# lowbias32 with the hash prospector's best published constants (C. Wellons, "exact bias"
# 0.1076): both multipliers are below 2^31, so for x in [0, 2^32) a product stays below 2^63
# and `(x * c) & MASK` is the exact product mod 2^32 in int64 (no signed overflow ever).
_C1, _C2 = 0x21F0AAAD, 0x735A2D97
assert _C1 < 1 << 31 and _C2 < 1 << 31


def mix32(x):
    """lowbias32: a bijection of [0, 2^32) with low bias. Works on Python ints and int64
    tensors alike (every value stays in [0, 2^32), so `>>` is a logical shift)."""
    x = x ^ (x >> 16)
    x = (x * _C1) & _MASK32
    x = x ^ (x >> 15)
    x = (x * _C2) & _MASK32
    x = x ^ (x >> 15)
    return x


# Independent keyed streams of one seed: the target's own samples, and, for rejection sampling,
# the drafts, the acceptance uniforms and the residual samples.
TARGET_STREAM, DRAFT_STREAM, ACCEPT_STREAM, RESIDUAL_STREAM = 0, 1, 2, 3


def seed_keys(seed: int, stream: int = TARGET_STREAM) -> tuple[int, int, int, int]:
    """Four 32-bit keys of one stream of a seed (any integer; taken mod 2^64): distinct within
    a seed and across its streams (each is a bijective chain of a distinct 4*stream + i)."""
    s = int(seed) % (1 << 64)
    lo, hi = s & _MASK32, s >> 32
    return tuple(mix32(mix32(mix32((4 * stream + i) ^ 0x9E3779B9) ^ lo) ^ hi)  # type: ignore[return-value]
                 for i in range(4))


def keyed_bits(keys, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """32-bit words `[t, vocab]` (int64) hashed from (seed keys, position j, vocab index v):

        a_j = mix(j ^ k0),  b_j = mix(j ^ k1),  h = mix(mix(v ^ a_j) ^ b_j)

    mix is a bijection, so for one seed distinct positions get distinct a_j (and b_j), and two
    seeds' rows coincide only where both key differences agree; the two rounds over v leave no
    xor-shift relation between rows. `keys` are the four ints of `seed_keys` (k2, k3 unused),
    or int64 tensors broadcastable to `[t, 1]` (a batch of seeds, one per row)."""
    k0, k1 = keys[0], keys[1]
    j = (positions.to(torch.int64) & _MASK32).reshape(-1, 1)
    a = mix32(j ^ k0)
    b = mix32(j ^ k1)
    v = torch.arange(vocab, dtype=torch.int64, device=positions.device).reshape(1, -1)
    return mix32(mix32(v ^ a) ^ b)


def keyed_gumbel(keys, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """Standard Gumbel noise, float64 `[t, vocab]`, from `keyed_bits`: u = (h + 1/2) / 2^32 in
    (0, 1) exactly, g = -log(-log(u)) (g at most ~22.9: no infinities)."""
    u = (keyed_bits(keys, positions, vocab).double() + 0.5) * (2.0 ** -32)
    return -torch.log(-torch.log(u))


def keyed_uniform(keys, positions: torch.Tensor) -> torch.Tensor:
    """One uniform in (0, 1) per position, float64 `[t]` (the word at vocab index 0)."""
    return (keyed_bits(keys, positions, 1)[:, 0].double() + 0.5) * (2.0 ** -32)


class Drafting:
    """How one proposal's drafter scores become drafts under a sampler: the draft of slot k is
    argmax(process(scores_k) + noise_k), one sample of the drafter's processed distribution q_k,
    keyed by the position of the target row that judges it. `probs` keeps q (rejection sampling
    needs it). The markov chain feeds each slot's scores (its bias added) through `pick`."""

    def __init__(self, params: SamplingParams, noise: torch.Tensor, want_probs: bool):
        self.params, self.noise, self.want_probs = params, noise, want_probs
        self._q: list[torch.Tensor] = []

    def pick(self, k: int, scores: torch.Tensor) -> torch.Tensor:
        """Slot k's scores `[1, V]` -> its draft `[1]`."""
        z = process_logits(scores, self.params)
        if self.want_probs:
            self._q.append(torch.softmax(z, dim=-1))
        return torch.argmax(z + self.noise[k : k + 1], dim=-1)

    def pick_rows(self, scores: torch.Tensor) -> torch.Tensor:
        """Every slot at once (parallel drafting): `[n, V]` -> drafts `[n]`."""
        z = process_logits(scores, self.params)
        if self.want_probs:
            self._q = [torch.softmax(z, dim=-1)]
        return torch.argmax(z + self.noise[: z.shape[0]], dim=-1)

    @property
    def probs(self) -> torch.Tensor | None:
        return torch.cat(self._q) if self.want_probs else None


# --------------------------------------------------------------------------- the sampler


class PositionKeyed(SamplerBase):
    """Samples row j as argmax(process(logits_j) + keyed_gumbel(seed, j)): one sample from the
    processed distribution, a deterministic function of (logits_j, seed, j)."""

    name = "position-keyed"

    def __init__(self, params: SamplingParams):
        if params.greedy:
            raise ValueError("temperature 0 is greedy: use GREEDY (make_sampler does)")
        self.params = params
        self.seed = params.applied_seed
        self.keys = seed_keys(self.seed)
        self.acceptance = (
            f"position-keyed sampling (seed {self.seed}): a draft is kept while it equals the target's own "
            "sample at its position; lossless, stream identical to plain sampling with the same seed")

    def scores(self, logits: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """float64 `[t, V]`: processed logits + this seed's noise at `positions`."""
        return process_logits(logits, self.params) + keyed_gumbel(self.keys, positions, logits.shape[-1])

    def select(self, logits: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return torch.argmax(self.scores(logits, positions), dim=-1)

    def drafting(self, positions: torch.Tensor, vocab: int) -> Drafting:
        """Drafts coupled to the target: each is the drafter's own sample at the position with the
        very noise the target will use there, so a draft is the target's sample whenever the two
        distributions agree on it (the rule keeps a draft only when it equals the target's
        sample: exactness does not depend on how drafts are made)."""
        return Drafting(self.params, keyed_gumbel(self.keys, positions, vocab), want_probs=False)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.params})"


class RejectionSampling(PositionKeyed):
    """Standard speculative sampling: drafts sampled from the drafter's processed distribution q
    (their own keyed stream), a draft at slot k kept with probability min(1, p_k(d)/q_k(d)), and
    at the first rejection the residual max(0, p_k - q_k) sampled; after a fully kept window the
    target's own sample. Lossless in distribution (Leviathan et al. 2023; Chen et al. 2023) but
    not identical to plain sampling with the same seed. Plain decoding (and the prefill's token)
    is position-keyed sampling, as `PositionKeyed`.

    Expressed in the round's terms, `verify` returns one selection per verify row: the draft
    where kept, the residual sample at the first rejection (a token with q > p there, so never
    the draft), the target's sample after the last row; `accept_prefix` then stops at the first
    rejection and the next anchor is that row's selection, as for any sampler.

    The verify window must not depend on the draft it judges: memra's windows (the ladder from
    earlier rounds; confidence windows whose slot-k decision reads raws up to slot k, which see
    drafts only up to slot k-1) do not."""

    name = "rejection"
    rejection = True  # Session verifies with `verify`, the proposer keeps q

    def __init__(self, params: SamplingParams):
        super().__init__(params)
        self.draft_keys = seed_keys(self.seed, DRAFT_STREAM)
        self.accept_keys = seed_keys(self.seed, ACCEPT_STREAM)
        self.residual_keys = seed_keys(self.seed, RESIDUAL_STREAM)
        self.acceptance = (
            f"rejection sampling (seed {self.seed}): drafts sampled from the drafter's distribution q, a draft kept "
            "with probability min(1, p/q), the residual max(0, p-q) resampled at the first rejection; lossless in "
            "distribution, NOT identical to plain sampling with the same seed")

    def drafting(self, positions: torch.Tensor, vocab: int) -> Drafting:
        return Drafting(self.params, keyed_gumbel(self.draft_keys, positions, vocab), want_probs=True)

    def verify(self, logits: torch.Tensor, cand: torch.Tensor, q: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Verify rows `logits [vt, V]` of `cand [vt]` (anchor + drafts) at `positions [vt]`, the
        drafts' q `[>= vt-1, V]` -> selections `[vt]` (on the device, no host sync)."""
        n = logits.shape[0] - 1
        bonus = self.select(logits[n:], positions[n:])
        if n == 0:
            return bonus
        d = cand[1:].reshape(-1, 1)
        p = torch.softmax(process_logits(logits[:n], self.params), dim=-1)
        qn = q[:n]
        keep = keyed_uniform(self.accept_keys, positions[:n]) * qn.gather(1, d)[:, 0] < p.gather(1, d)[:, 0]
        residual = torch.argmax(torch.log((p - qn).clamp_min(0.0)) + keyed_gumbel(self.residual_keys, positions[:n],
                                                                                  logits.shape[-1]), dim=-1)
        return torch.cat([torch.where(keep, d[:, 0], residual), bonus])


def make_sampler(params: SamplingParams | None) -> Sampler:
    """Temperature 0 (or no params) -> `GREEDY`, exactly the plain argmax; else `PositionKeyed`
    (acceptance "keyed", the default) or `RejectionSampling` (acceptance "rejection")."""
    if params is None or params.greedy:
        return GREEDY
    return RejectionSampling(params) if params.acceptance == "rejection" else PositionKeyed(params)
