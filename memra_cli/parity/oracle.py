"""`memra-oracle/1` files: read, validate, write; run the engine on one; compare stage by stage.

An oracle is an .npz made by some implementation of the drafter (ours in `reference.py`, or
z-lab's / DeepSpec's own code run beside the project). It holds the forward's inputs (raw target
taps, the block's embedding rows, positions) and what that implementation computed at each stage.
The schema is a contract (docs/oracle-format.md): keys, dtypes, shapes and meaning are fixed,
because other code than ours writes these files. `np.load` never unpickles (allow_pickle=False).

`run_engine` feeds the inputs through both engine paths: `full` (`forward_full`, everything from
raw taps) and `cached` (`ingest` of the ctx rows in two appends, then `forward_round` over the
cache). `compare_stage` measures max-abs, relative L2 and argmax / token agreement against the
thresholds of a precision policy (`THRESHOLDS`, reasoning in the docs).
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from memra_cli.engine.errors import MemraError
from memra_cli.engine.files import publish, signals_held

FORMAT = "memra-oracle/1"
REQUIRED = ("meta", "target_hidden", "noise_embedding", "position_ids", "hidden_out")
OPTIONAL = ("ctx_features", "layer_out", "draft_logits", "markov_tokens", "confidence_raw")
STAGES = ("ctx_features", "layer_out", "hidden_out", "draft_logits", "markov_tokens", "confidence_raw")
FLOAT_KEYS = ("target_hidden", "noise_embedding", "hidden_out", "ctx_features", "layer_out", "draft_logits", "confidence_raw")
INT_KEYS = ("position_ids", "markov_tokens")
PATHS = ("full", "cached")
QUANTIZED = ("q8", "mixed", "fc", "q4")


class OracleError(MemraError):
    """An oracle file is unreadable, off-schema, or does not fit the drafter it is checked on."""


# --------------------------------------------------------------------------- schema


@dataclass(frozen=True)
class Oracle:
    """A validated oracle: `meta` (parsed JSON) and the arrays, as stored."""

    path: Path
    meta: dict[str, Any]
    arrays: dict[str, np.ndarray]

    @property
    def ctx(self) -> int:
        return int(self.arrays["target_hidden"].shape[0])

    @property
    def block(self) -> int:
        return int(self.arrays["noise_embedding"].shape[0])

    @property
    def anchor(self) -> int:
        return int(self.meta["anchor_token"])

    @property
    def stages(self) -> tuple[str, ...]:
        return tuple(s for s in STAGES if s in self.arrays)


def _dims(shape: tuple[int, ...]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def _parse_meta(raw: np.ndarray, source: str) -> dict[str, Any]:
    if raw.shape != () or raw.dtype.kind not in "US":
        raise OracleError(
            f"{source}: key 'meta' has dtype {raw.dtype} shape {_dims(raw.shape)}, expected a 0-d "
            "string holding JSON"
        )
    text = raw.item()
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError:
            raise OracleError(f"{source}: key 'meta' is not UTF-8 text") from None
    try:
        meta = json.loads(text)
    except json.JSONDecodeError as exc:
        raise OracleError(f"{source}: key 'meta' is not JSON ({exc.msg} at char {exc.pos})") from None
    if not isinstance(meta, dict):
        raise OracleError(f"{source}: key 'meta' must hold a JSON object, got {type(meta).__name__}")
    fmt = meta.get("format")
    if fmt != FORMAT:
        got = "missing" if fmt is None else repr(fmt)
        raise OracleError(f"{source}: meta 'format' is {got}, expected '{FORMAT}'")
    for key in ("block_size", "ctx", "anchor_token"):
        value = meta.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise OracleError(f"{source}: meta '{key}' must be a non-negative integer, got {json.dumps(value)}")
    if not isinstance(meta.get("source"), str):
        raise OracleError(f"{source}: meta 'source' must be a string naming the implementation that made the oracle")
    harvest = meta.get("harvest")
    if harvest is not None and harvest not in ("dflash", "dspark"):
        raise OracleError(f"{source}: meta 'harvest' is {json.dumps(harvest)}, expected dflash|dspark")
    return meta


def _check_dtype(name: str, arr: np.ndarray, source: str) -> None:
    if name in FLOAT_KEYS and arr.dtype != np.float32:
        raise OracleError(f"{source}: key '{name}' has dtype {arr.dtype}, expected float32")
    if name in INT_KEYS and arr.dtype.kind not in "iu":
        raise OracleError(f"{source}: key '{name}' has dtype {arr.dtype}, expected an integer dtype")


def _expected_shapes(ctx: int, block: int, hidden: int, width: int, n_layer: int | None, vocab: int | None) -> dict[str, tuple]:
    """Shape per key; None marks a dim taken from the file (checked against a drafter later)."""
    return {
        "target_hidden": (ctx, width), "noise_embedding": (block, hidden), "position_ids": (ctx + block,),
        "hidden_out": (block, hidden), "ctx_features": (ctx, hidden), "layer_out": (n_layer, block, hidden),
        "draft_logits": (block, vocab), "markov_tokens": (block,), "confidence_raw": (block,),
    }


def _check_shape(name: str, arr: np.ndarray, want: tuple, source: str) -> None:
    ok = arr.ndim == len(want) and all(w is None or d == w for d, w in zip(arr.shape, want))
    if not ok:
        want_s = "[" + ", ".join("*" if w is None else str(w) for w in want) + "]"
        raise OracleError(f"{source}: key '{name}' has shape {_dims(arr.shape)}, expected {want_s}")


def validate(meta_raw: np.ndarray, arrays: dict[str, np.ndarray], source: str) -> dict[str, Any]:
    """Check an oracle's internal consistency (schema, dtypes, shapes, meta); returns meta."""
    missing = [k for k in REQUIRED if k not in arrays and not (k == "meta" and meta_raw is not None)]
    if missing:
        raise OracleError(f"{source}: required key '{missing[0]}' is missing (memra-oracle/1 needs {', '.join(REQUIRED)})")
    meta = _parse_meta(meta_raw, source)
    for name, arr in arrays.items():
        _check_dtype(name, arr, source)
    th, noise = arrays["target_hidden"], arrays["noise_embedding"]
    if th.ndim != 2 or th.shape[0] < 1:
        raise OracleError(f"{source}: key 'target_hidden' has shape {_dims(th.shape)}, expected [ctx >= 1, n_taps*hidden]")
    if noise.ndim != 2 or noise.shape[0] < 1:
        raise OracleError(f"{source}: key 'noise_embedding' has shape {_dims(noise.shape)}, expected [block, hidden]")
    ctx, (block, hidden) = th.shape[0], noise.shape
    shapes = _expected_shapes(ctx, block, hidden, th.shape[1], None, None)
    for name, arr in arrays.items():
        if name in shapes:
            _check_shape(name, arr, shapes[name], source)
    if meta["block_size"] != block:
        raise OracleError(f"{source}: meta block_size {meta['block_size']} but noise_embedding has {block} rows")
    if meta["ctx"] != ctx:
        raise OracleError(f"{source}: meta ctx {meta['ctx']} but target_hidden has {ctx} rows")
    for name in ("draft_logits",):
        if name in arrays and meta["anchor_token"] >= arrays[name].shape[1]:
            raise OracleError(f"{source}: meta anchor_token {meta['anchor_token']} is outside the vocab {arrays[name].shape[1]} of '{name}'")
    if (arrays["position_ids"] < 0).any():
        raise OracleError(f"{source}: key 'position_ids' holds negative positions")
    for name in FLOAT_KEYS:
        if name in arrays and not np.isfinite(arrays[name]).all():
            raise OracleError(f"{source}: key '{name}' holds NaN or Inf")
    return meta


def read_oracle(path: Path | str) -> Oracle:
    """Load and validate a `memra-oracle/1` npz (never unpickles)."""
    path = Path(path)
    source = str(path)
    if not path.is_file():
        raise OracleError(f"{source}: no such oracle file")
    with path.open("rb") as fh:
        if fh.read(4) != b"PK\x03\x04":  # np.load would try anything else as a pickle
            raise OracleError(f"{source}: not a readable .npz (no zip header; expected a memra-oracle/1 npz)")
    try:
        with np.load(path, allow_pickle=False) as npz:
            arrays = {k: npz[k] for k in npz.files}
    except ValueError as exc:
        if "pickle" in str(exc).lower():
            raise OracleError(f"{source}: holds an object (pickled) array; memra never unpickles — store meta as a 0-d string") from None
        raise OracleError(f"{source}: not a readable .npz ({exc})") from None
    except (OSError, zipfile.BadZipFile, EOFError) as exc:
        raise OracleError(f"{source}: not a readable .npz ({exc})") from None
    if "meta" not in arrays:
        raise OracleError(f"{source}: required key 'meta' is missing (memra-oracle/1 needs {', '.join(REQUIRED)})")
    meta_raw = arrays.pop("meta")
    unknown = sorted(set(arrays) - set(REQUIRED) - set(OPTIONAL))
    if unknown:
        raise OracleError(f"{source}: unknown key '{unknown[0]}' (memra-oracle/1 keys: {', '.join(REQUIRED + OPTIONAL)})")
    meta = validate(meta_raw, arrays, source)
    return Oracle(path, meta, arrays)


def write_oracle(path: Path | str, meta: dict[str, Any], arrays: dict[str, np.ndarray]) -> Path:
    """Validate, then write atomically (temp file in the same directory, fsync, rename)."""
    path = Path(path)
    meta = {"format": FORMAT, **meta}
    meta_raw = np.array(json.dumps(meta, sort_keys=True))
    arrays = {k: np.ascontiguousarray(v) for k, v in arrays.items()}
    validate(meta_raw, arrays, str(path))
    if not path.parent.is_dir():  # memra creates no directories for its outputs
        raise OracleError(f"{path}: directory {path.parent} does not exist")
    tmp = None
    try:
        with signals_held():  # a signal lands once `tmp` is known, so the cleanup below removes the file
            fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "wb") as fh:
            np.savez(fh, meta=meta_raw, **arrays)
            fh.flush()
            os.fsync(fh.fileno())
        publish(tmp, path)  # the user's file: the usual permissions, not mkstemp's 0600
    except BaseException:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        raise
    return path


# --------------------------------------------------------------------------- fit to a drafter


@dataclass(frozen=True)
class DrafterFacts:
    """What an oracle must agree with: the drafter's geometry and heads."""

    n_taps: int
    hidden: int
    block_size: int
    n_layers: int
    vocab: int | None  # lm_head rows when one is available, else the config's vocab_size
    has_lm_head: bool
    has_markov: bool
    has_confidence: bool
    confidence_with_markov: bool
    source: str

    @classmethod
    def of(cls, drafter: Any, lm_head: Any) -> "DrafterFacts":
        cfg, census = drafter.cfg, drafter.census
        vocab = int(lm_head.shape[0]) if lm_head is not None else cfg.vocab_size
        conf = census.confidence
        return cls(cfg.n_taps, cfg.hidden_size, cfg.block_size, cfg.num_hidden_layers, vocab,
                   lm_head is not None, drafter.has_markov, drafter.has_confidence,
                   bool(conf and conf.with_markov), str(census.path))


def check_fits(oracle: Oracle, facts: DrafterFacts) -> None:
    """Refuse an oracle whose shapes or stages the drafter cannot reproduce."""
    src = f"{oracle.path} vs {facts.source}"
    shapes = _expected_shapes(oracle.ctx, facts.block_size, facts.hidden, facts.n_taps * facts.hidden,
                              facts.n_layers, facts.vocab)
    for name, arr in oracle.arrays.items():
        if name in shapes:
            try:
                _check_shape(name, arr, shapes[name], src)
            except OracleError as exc:
                raise OracleError(f"{exc} from the drafter (n_taps={facts.n_taps}, hidden={facts.hidden}, "
                                  f"block_size={facts.block_size}, n_layers={facts.n_layers}, vocab={facts.vocab})") from None
    if facts.vocab is not None and oracle.anchor >= facts.vocab:
        raise OracleError(f"{src}: meta anchor_token {oracle.anchor} is outside the drafter's vocab {facts.vocab}")
    tokens = oracle.arrays.get("markov_tokens")
    if tokens is not None and facts.vocab is not None and ((tokens < 0) | (tokens >= facts.vocab)).any():
        raise OracleError(f"{src}: key 'markov_tokens' holds ids outside the vocab [0, {facts.vocab})")
    needs_logits = [s for s in ("draft_logits", "markov_tokens") if s in oracle.arrays]
    if needs_logits and not facts.has_lm_head:
        raise OracleError(f"{src}: the oracle holds {', '.join(needs_logits)} but there is no lm_head "
                          "(pass --target DIR, or use a checkpoint that ships lm_head.weight)")
    if "confidence_raw" in oracle.arrays:
        if not facts.has_confidence:
            raise OracleError(f"{src}: the oracle holds confidence_raw but the drafter has no confidence head")
        if facts.confidence_with_markov and "markov_tokens" not in oracle.arrays and not facts.has_lm_head:
            raise OracleError(f"{src}: confidence_raw needs previous chain ids: the oracle has no markov_tokens "
                              "and there is no lm_head to compute the chain (pass --target DIR)")


# --------------------------------------------------------------------------- thresholds


@dataclass(frozen=True)
class Thresholds:
    """One precision policy's pass rule. `rel_l2` bounds every float stage; `argmax_required`
    makes draft_logits' per-row argmax (rows that are not near-ties) a requirement;
    `tokens_exact` makes markov_tokens an exact-match requirement (else reported only)."""

    name: str
    rel_l2: float
    argmax_required: bool
    tokens_exact: bool
    why: str


# Reasoning (docs/oracle-format.md § Thresholds): u = unit roundoff of the compute format.
# f32 (u = 6e-8): two correct f32 implementations of a few-layer drafter differ by ~1e-7..1e-6
# relative; 1e-5 leaves room for reduction-order noise yet catches any semantic slip (a missed
# norm, a wrong rope dim, a mask off by one row all show up at >= 1e-3).
# bf16 (u = 2^-8 = 3.9e-3): each matmul input/output is rounded (RMS ~u/sqrt(3) each); through
# ~8 roundings per layer and a few layers the expected stage error is ~0.5-1.5e-2; bound 2^-5.
# q8_0 adds a per-weight error of RMS amax/(127*sqrt(12)) ~ 5e-3 relative (Gaussian rows: amax
# ~ 2.2 sigma over 32) per matmul, about one more bf16 rounding: bound 2^-4. mixed / fc quantize a
# subset of what q8 quantizes: same bound. q4_0: RMS amax/(8*sqrt(12)) ~ 8e-2 per matmul, 16x
# q8's: bound 2^-1 (q4 parity is a gross-error check: a wrong block layout or scale gives ~1.4).
# confidence_raw alone floors its denominator at the head's scale (`confidence_scale`): its b scores
# are near one random projection, whose norm can cancel; the bounds themselves are the same.
THRESHOLDS: dict[str, Thresholds] = {
    "f32": Thresholds("f32", 1e-5, True, True, "float32: two exact implementations differ by rounding order only"),
    "bf16": Thresholds("bf16", 2.0 ** -5, False, False, "bfloat16 activations/weights: ~8 u_bf16 over a few layers"),
    "q8": Thresholds("q8", 2.0 ** -4, False, False, "q8_0 weights: + ~5e-3 per matmul over bf16"),
    "mixed": Thresholds("mixed", 2.0 ** -4, False, False, "MLP q8_0, attention+fc bf16: bounded by q8"),
    "fc": Thresholds("fc", 2.0 ** -4, False, False, "all but fc q8_0: bounded by q8"),
    "q4": Thresholds("q4", 2.0 ** -1, False, False, "q4_0 weights: ~8e-2 per matmul, gross-error check only"),
}
TIE_FRACTION = 1e-4  # an oracle row whose top-2 logit margin is below this x max|row| is a near-tie


@dataclass
class StageResult:
    stage: str
    path: str
    max_abs: float | None
    rel_l2: float | None
    argmax_agree: float | None
    threshold: float | str | None
    passed: bool
    note: str = ""

    def as_json(self) -> dict[str, Any]:
        return {"stage": self.stage, "path": self.path, "max_abs": self.max_abs, "rel_l2": self.rel_l2,
                "argmax_agree": self.argmax_agree, "threshold": self.threshold, "pass": self.passed,
                "note": self.note}


def _rel_l2(got: np.ndarray, want: np.ndarray) -> float:
    diff = float(np.linalg.norm((got.astype(np.float64) - want.astype(np.float64)).ravel()))
    ref = float(np.linalg.norm(want.astype(np.float64).ravel()))
    if ref == 0.0:
        return 0.0 if diff == 0.0 else math.inf
    return diff / ref


def _argmax_rows(got: np.ndarray, want: np.ndarray) -> tuple[float, int, int]:
    """(agreement fraction, disagreeing rows that are not near-ties, near-tie rows)."""
    agree = got.argmax(-1) == want.argmax(-1)
    top2 = np.sort(want.astype(np.float64), axis=-1)[:, -2:]
    margin = top2[:, 1] - top2[:, 0]
    tie = margin <= TIE_FRACTION * np.abs(want).max(-1)
    return float(agree.mean()), int((~agree & ~tie).sum()), int(tie.sum())


def compare_stage(stage: str, path: str, got: np.ndarray, want: np.ndarray, th: Thresholds,
                  scale_floor: float | None = None) -> StageResult:
    """Compare one engine stage with the oracle's under the policy `th`.

    `scale_floor` (confidence_raw only, see `confidence_scale`) floors the relative error's
    denominator: `‖got − want‖ / max(‖want‖, scale_floor)`."""
    if got.shape != want.shape:
        return StageResult(stage, path, None, None, None, th.rel_l2, False,
                           f"engine shape {_dims(got.shape)} vs oracle {_dims(want.shape)}")
    if stage == "markov_tokens":
        same = got.astype(np.int64) == want.astype(np.int64)
        n_bad = int((~same).sum())
        note = "" if n_bad == 0 else f"{n_bad} token(s) differ, first at slot {int(np.argmin(same))}"
        ok = n_bad == 0 or not th.tokens_exact
        return StageResult(stage, path, float(n_bad), None, float(same.mean()),
                           "exact" if th.tokens_exact else "reported", ok, note)
    diff = np.abs(got.astype(np.float64) - want.astype(np.float64))
    max_abs = float(diff.max()) if diff.size else 0.0
    rel = _rel_l2(got, want)
    note, agree = "", None
    ref = float(np.linalg.norm(want.astype(np.float64).ravel()))
    if scale_floor is not None and scale_floor > ref:
        plain = rel
        rel = float(np.linalg.norm((got.astype(np.float64) - want.astype(np.float64)).ravel())) / scale_floor
        note = f"‖oracle‖ {ref:.3g} < head scale {scale_floor:.3g}: error / head scale (plain rel_l2 {plain:.2e})"
    passed = bool(np.isfinite(got).all()) and rel <= th.rel_l2
    if not np.isfinite(got).all():
        note = "engine output holds NaN/Inf"
    if stage == "layer_out" and got.ndim == 3:
        per = [_rel_l2(got[i], want[i]) for i in range(got.shape[0])]
        worst = int(np.argmax(per))
        note = note or f"worst layer {worst}: rel_l2 {per[worst]:.2e}"
    if stage == "draft_logits":
        agree, bad, ties = _argmax_rows(got, want)
        if th.argmax_required and bad:
            passed = False
            note = f"argmax differs on {bad} row(s) that are not near-ties"
        elif ties:
            note = f"{ties} near-tie row(s) excluded from the argmax requirement"
    return StageResult(stage, path, max_abs, rel, agree, th.rel_l2, passed, note)


# --------------------------------------------------------------------------- running the engine


@dataclass
class ParityReport:
    results: list[StageResult]
    engine: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.results)

    @property
    def failed_stages(self) -> list[str]:
        out: list[str] = []
        for r in self.results:
            if not r.passed and r.stage not in out:
                out.append(r.stage)
        return out


def _np(t: Any) -> np.ndarray:
    return t.detach().float().cpu().numpy() if t.is_floating_point() else t.detach().cpu().numpy()


def _confidence_prev(oracle: Oracle, chain: Any, anchor: Any) -> Any:
    """The confidence head's previous ids `[b]`: `[anchor, chain[:-1]]`, with the oracle's own
    chain when it holds one (a chain mismatch stays its own stage), else `chain`, else the anchor
    on every row (no lm_head: no chain)."""
    import torch

    b = oracle.block
    if "markov_tokens" in oracle.arrays:
        chain = torch.as_tensor(oracle.arrays["markov_tokens"].astype(np.int64), device=anchor.device)
    if chain is None:
        return torch.full((b,), int(anchor), dtype=torch.long, device=anchor.device)
    return torch.cat([anchor.reshape(1), chain[:-1]])


def confidence_scale(drafter: Any, oracle: Oracle, chain: np.ndarray | None = None) -> float:
    """The confidence head's output scale on the oracle's inputs: `‖s‖₂` over the `b` rows, with
    `s_k = ‖w‖·‖x_k‖/√d`, `x_k = [hidden_out_k ; W1[prev_k]]` (`d` = in_dim); `chain [b]` is the
    engine's chain, used for `prev` only when the oracle holds none.

    `s_k` is the RMS of `w·x_k` over directions of `x_k`, the size the head's score has when
    nothing cancels. Why it floors the denominator: the head is one dot product over `b` rows that
    are nearly one vector (the block rows share the mask embedding), so `‖w·X‖` is a single draw
    that can land near zero and inflate the relative error with no extra error in the engine
    (docs/oracle-format.md § confidence_raw). A correct head passes its input's error through at
    about `‖δx‖/‖x‖` of `s`; a wrong bias, previous id or feature order is off by about `s`."""
    import torch

    w = drafter.conf_w[0].double().cpu()
    x = torch.from_numpy(oracle.arrays["hidden_out"].astype(np.float64))
    if drafter.census.confidence is not None and drafter.census.confidence.with_markov:
        dev = drafter.markov_w1.device
        anchor = torch.tensor(oracle.anchor, dtype=torch.long, device=dev)
        prev = _confidence_prev(oracle, None if chain is None else torch.as_tensor(chain.astype(np.int64), device=dev), anchor)
        x = torch.cat([x, drafter.markov_w1[prev].double().cpu()], dim=-1)
    s = w.norm() * x.norm(dim=-1) / math.sqrt(w.numel())
    return float(s.norm())


def _heads(drafter: Any, oracle: Oracle, hidden: Any, lm_head: Any) -> dict[str, np.ndarray]:
    """draft_logits, markov_tokens, confidence_raw from one path's final hidden, as asked."""
    import torch

    out: dict[str, np.ndarray] = {}
    want = oracle.arrays
    anchor = torch.tensor(oracle.anchor, dtype=torch.long, device=hidden.device)
    chain = None
    if lm_head is not None:
        # the target's lm_head runs in the model dtype, widened after (Qwen3Target.logits)
        logits = torch.nn.functional.linear(hidden, lm_head.to(hidden.dtype))
        cap = drafter.logit_softcap  # a Gemma 4 drafter's: in the model dtype, as its target's lm_head
        logits = (logits if cap is None else torch.tanh(logits / cap) * cap).float()
        out["draft_logits"] = _np(logits)
        if drafter.has_markov:
            chain = drafter.markov_chain(logits, anchor)  # all b rows, first prev = anchor
        else:
            chain = torch.argmax(logits, dim=-1)  # greedy chain with no bias (markov rank 0)
        out["markov_tokens"] = _np(chain)
    if "confidence_raw" in want and drafter.has_confidence:
        out["confidence_raw"] = _np(drafter.confidence_raw(hidden, _confidence_prev(oracle, chain, anchor)))
    return out


def run_engine(drafter: Any, oracle: Oracle, lm_head: Any = None) -> dict[str, dict[str, np.ndarray]]:
    """Both engine paths on the oracle's inputs -> {path: {stage: float32/int array}}."""
    import torch

    dev = drafter.device
    a = oracle.arrays
    taps = torch.from_numpy(a["target_hidden"]).to(dev)
    noise = torch.from_numpy(a["noise_embedding"]).to(dev)
    pos = torch.from_numpy(a["position_ids"].astype(np.int64)).to(dev)
    n = oracle.ctx
    out: dict[str, dict[str, np.ndarray]] = {}
    with torch.inference_mode():
        full = drafter.forward_full(taps, noise, pos)
        out["full"] = {"ctx_features": _np(full.ctx_features), "layer_out": _np(full.layer_out),
                       "hidden_out": _np(full.hidden_out), **_heads(drafter, oracle, full.hidden_out, lm_head)}
        kv = drafter.new_cache(n)
        cut = (n + 1) // 2  # two appends: the cache's append path, not only its first write
        feats = [drafter.ingest(kv, taps[lo:hi], pos[lo:hi]) for lo, hi in ((0, cut), (cut, n)) if hi > lo]
        rnd = drafter.forward_round(kv, noise, pos[n:], keep_layers=True)
        out["cached"] = {"ctx_features": _np(torch.cat(feats)), "layer_out": _np(rnd.layer_out),
                         "hidden_out": _np(rnd.hidden_out), **_heads(drafter, oracle, rnd.hidden_out, lm_head)}
    return out


def parity(drafter: Any, oracle: Oracle, lm_head: Any, policy: str) -> ParityReport:
    """Check `oracle` against the drafter on both paths under precision `policy`."""
    th = THRESHOLDS[policy]
    check_fits(oracle, DrafterFacts.of(drafter, lm_head))
    engine = run_engine(drafter, oracle, lm_head)
    results = []
    for stage in oracle.stages:
        floor = None
        if stage == "confidence_raw":
            chain = engine["full"].get("markov_tokens")
            floor = confidence_scale(drafter, oracle, chain)
        for path in PATHS:
            results.append(compare_stage(stage, path, engine[path][stage], oracle.arrays[stage], th, floor))
    return ParityReport(results, engine)


# --------------------------------------------------------------------------- precision


# --------------------------------------------------------------------------- target tables


def target_tables(target_dir: Path, dtype: Any, device: Any, hidden: int, embed: bool = True) -> tuple[Any, Any]:
    """(embed [V, hidden] or None, lm_head [V, hidden]) of an HF target, without loading its
    layers: Qwen3 (`model.embed_tokens.weight`), Qwen3.5 or Gemma 4 in either layout (the
    multimodal ones keep the text model under `model.language_model.`). lm_head is the embedding
    when tie_word_embeddings is set, as HF ties it; a Gemma embedding is the raw table (unscaled)."""
    from memra_cli.engine.formats.checkpoint import open_checkpoint
    from memra_cli.engine.formats.config import load_target_config, read_json_object
    from memra_cli.engine.formats.gemma4_config import MODEL_TYPES as GEMMA4_TYPES
    from memra_cli.engine.formats.gemma4_config import load_gemma4_config
    from memra_cli.engine.formats.qwen3_5_config import MODEL_TYPES as QWEN35_TYPES
    from memra_cli.engine.formats.qwen3_5_config import load_qwen35_config, text_prefix

    target_dir = Path(target_dir)
    model_type = read_json_object(target_dir / "config.json").get("model_type") if target_dir.is_dir() else None
    hybrid, gemma = model_type in QWEN35_TYPES, model_type in GEMMA4_TYPES
    cfg = (load_qwen35_config(target_dir) if hybrid else load_gemma4_config(target_dir) if gemma
           else load_target_config(target_dir))
    if cfg.hidden_size != hidden:
        raise OracleError(f"{cfg.source}: target hidden_size {cfg.hidden_size} does not match the drafter's {hidden}")
    ckpt = open_checkpoint(target_dir)
    prefix = text_prefix(ckpt.tensors, ckpt.root) if hybrid or gemma else "model."
    table = ckpt.load(prefix + "embed_tokens.weight", dtype, device) if embed or cfg.tie_word_embeddings else None
    head = table if cfg.tie_word_embeddings else ckpt.load("lm_head.weight", dtype, device)
    return table, head
