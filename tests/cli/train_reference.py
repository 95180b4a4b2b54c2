"""The tiny drafters behind the reference-code check (tests/cli/test_train_reference_cli.py).

`make_export(root, kind)` writes a tiny target (Qwen3; Gemma 4 for the `dspark_gemma4` kinds,
whose drafter is a `Gemma4DSparkModel`) and a drafter exported by `memra train`'s own steps: the
geometry from `resolve_geometry` and the files from `write_drafter`, the two calls `memra train`
makes. Its weights are drawn from a seeded generator instead of trained, because
training sums in an order the CPU's BLAS picks: a trained export would differ in its last bits
from one machine to the next, and the reference outputs were made from one exact file. A draw
and a scale are the same bits everywhere, so every machine re-creates the bytes the stored
outputs were computed from (the test checks their sha256).

`make_inputs(export, target)` builds the two forward cases, each a dict of numpy arrays:

- `train`: two blocks over one sequence, as a training step lays them out (`losses.block_batch`):
  every block sees the context rows before its anchor and its own rows;
- `infer`: one block over the context rows before its anchor, as decoding runs it.

The context taps are the target's own (the engine's `forward(..., taps=...)`) and are stored with
the outputs, so both sides read identical inputs. For Gemma 4 the block rows are stored as
ids (`noise_ids`), not embedded: each side embeds them its own way (DeepSpec with its own
√hidden-scaled embedding, memra with the target's rows times the scale `memra train` resolves), so
the block embedding's scale is part of what is compared.

The reference outputs are made by `make_train_reference_oracle.py` beside this file, with the
upstream checkouts (docs/train.md, "Checked against the reference code").
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from memra_cli.tiny.gemma4 import make_tiny_gemma4
from memra_cli.tiny.target import make_tiny_qwen3

# dspark_gemma4*: a Gemma4DSparkModel over a tiny Gemma 4 target, with k_eq_v (the default tiny target's
# full layers, as the 31B's) and with a v_proj (k_eq_v off)
KINDS = ("dflash", "dspark", "dspark_gemma4", "dspark_gemma4_v_proj")
SEQ = 16  # context rows
ANCHORS = (5, 10)  # the train case's blocks
INFER_ANCHOR = 11
ORACLE_DIR = Path(__file__).resolve().parent / "data" / "train_reference"


def geometry_args(kind: str) -> dict:
    """`resolve_geometry`'s options (what `memra train --layers 2 --block 4 --taps ...` passes)."""
    args = {"layers": 2, "block": 4, "taps": (-1, 1, 3), "mask_token": 511}
    return {**args, "markov_rank": 16, "confidence": True} if kind.startswith("dspark") else args


def is_gemma4(kind: str) -> bool:
    return kind.startswith("dspark_gemma4")


def train_kind(kind: str) -> str:
    """`memra train --kind` of a case (the Gemma 4 format follows from the target)."""
    return "dflash" if kind == "dflash" else "dspark"


# Gemma 4's target layouts (make_tiny_gemma4's `layout`, `heads_layout`): the same text weights in each
GEMMA4_LAYOUTS = (("text", "global"), ("multimodal", "global"), ("text", "per_layer"), ("multimodal", "per_layer"))


def _make_target(directory: Path, kind: str, layout: tuple[str, str]) -> Path:
    if is_gemma4(kind):
        return make_tiny_gemma4(directory, seed=0, k_eq_v=not kind.endswith("_v_proj"), layout=layout[0],
                                heads_layout=layout[1])
    return make_tiny_qwen3(directory, seed=0)


def _target_class(kind: str):
    from memra_cli.engine.models.gemma4 import Gemma4Target
    from memra_cli.engine.models.qwen3 import Qwen3Target

    return Gemma4Target if is_gemma4(kind) else Qwen3Target


def _seeded_weights(drafter: torch.nn.Module, seed: int) -> None:
    """Every tensor drawn anew, non-degenerate (what training leaves, where the initialiser leaves
    zeros or ones): matrices at 1/sqrt(fan_in), norms and Gemma's `layer_scalar` at 1 ± 0.2, the
    markov table at unit scale so its bias moves the logits, biases at 0.5."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in drafter.named_parameters():  # module order: the same draw sequence everywhere
            draw = torch.randn(p.shape, generator=gen)
            if "norm" in name or name.endswith("layer_scalar"):
                p.copy_(1.0 + 0.2 * draw)
            elif name.endswith("markov_w1.weight") or p.ndim == 1:
                p.copy_(draw if p.ndim == 2 else 0.5 * draw)
            else:
                p.copy_(draw * (1.0 / math.sqrt(p.shape[1])))


def make_export(root: Path, kind: str, layout: tuple[str, str] = GEMMA4_LAYOUTS[0]) -> tuple[Path, Path]:
    """(target dir, exported drafter dir) under `root`, the same bytes on every machine.
    `layout`: a Gemma 4 target's layout (the stored outputs were made over the first)."""
    from memra_cli.train.export import write_drafter
    from memra_cli.train.geometry import resolve_geometry, text_config
    from memra_cli.train.job import new_drafter
    from memra_cli.train.taps import EngineTaps

    target = _make_target(root / "target", kind, layout)
    geo, _ = resolve_geometry(target, train_kind(kind), **geometry_args(kind))
    assert geo.backbone == ("gemma4" if is_gemma4(kind) else "qwen3"), geo
    drafter = new_drafter(geo, seed=0)
    _seeded_weights(drafter, seed=KINDS.index(kind) + 1)  # every kind: different weights
    out = write_drafter(root / kind, drafter, geo, EngineTaps(_target_class(kind).from_dir(target)), dtype="float32",
                        num_anchors=len(ANCHORS), target_config=text_config(target))  # as `memra train` calls it
    return target, out


def _as_np(**tensors) -> dict[str, np.ndarray]:
    return {k: v.detach().cpu().numpy() for k, v in tensors.items()}


@torch.no_grad()
def make_inputs(export: Path, target: Path) -> dict[str, np.ndarray]:
    """The forward cases' inputs (names prefixed `train_` / `infer_`):
    `taps [1, L, n_taps*h]`, `noise [1, Q, h]` (the target's embedding of the block ids; for Gemma 4
    `noise_ids [1, Q]` instead),
    `ctx_pos [1, L]`, `blk_pos [1, Q]`, `mask [1, 1, Q, L+Q]` bool (True = attend),
    `prev [1, A, b]` (each row's previous token: the markov head's and confidence head's input)."""
    import json

    from memra_cli.train.losses import DraftSpec, block_batch

    cfg = json.loads((export / "config.json").read_text())
    taps = tuple(cfg.get("target_layer_ids") or cfg["dflash_config"]["target_layer_ids"])
    mask_id = cfg.get("mask_token_id", cfg.get("dflash_config", {}).get("mask_token_id"))
    gemma = cfg["architectures"] == ["Gemma4DSparkModel"]
    tgt = _target_class("dspark_gemma4" if gemma else "dspark").from_dir(target)
    ids = torch.randint(0, tgt.embed_weight.shape[0] - 4, (1, SEQ), generator=torch.Generator().manual_seed(2))
    _, all_taps = tgt.forward(ids[0], 0, tgt.new_state(SEQ), taps=list(taps))
    all_taps = all_taps[None].float()
    spec = DraftSpec("dspark", cfg["block_size"], taps, mask_id)  # prev/labels: every row (dspark's convention)
    out = {}
    for case, anchors in (("train", ANCHORS), ("infer", (INFER_ANCHOR,))):
        noise_ids, blk_pos, _, prev, mask = block_batch(ids, torch.tensor([anchors]), spec)
        L = SEQ if case == "train" else INFER_ANCHOR  # decoding: the context is the rows before the anchor
        embedded = {"noise": torch.nn.functional.embedding(noise_ids, tgt.embed_weight)}
        rows = {"noise_ids": noise_ids} if gemma else embedded
        out.update({f"{case}_{k}": v for k, v in _as_np(
            ids=ids, taps=all_taps[:, :L], **rows, ctx_pos=torch.arange(L)[None], blk_pos=blk_pos,
            mask=mask[..., list(range(L)) + list(range(SEQ, mask.shape[-1]))], prev=prev).items()})
    return out


def load_train_drafter(export: Path, target: Path, kind: str):
    """memra's trainable drafter (train/drafter.py) holding the export's tensors (strict: every
    name of the file but the DeepSpec copies of the target's tables)."""
    from safetensors.torch import load_file

    from memra_cli.train.geometry import resolve_geometry
    from memra_cli.train.job import new_drafter

    geo, _ = resolve_geometry(target, train_kind(kind), **geometry_args(kind))
    drafter = new_drafter(geo, seed=0).eval()
    tensors = load_file(str(export / "model.safetensors"))
    tables = {k: tensors.pop(k) for k in ("embed_tokens.weight", "lm_head.weight") if k in tensors}
    drafter.load_state_dict(tensors, strict=True)
    return drafter, tables


@torch.no_grad()
def memra_outputs(export: Path, target: Path, kind: str, inputs: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """memra's side of every stored output: `train_hidden` / `infer_hidden` (the trainable
    drafter, final-normed `[1, Q, h]`), `infer_engine_hidden` (the engine's drafter, `[Q, h]`),
    and for dspark `train_logits [1, A, b, V]` (lm_head + markov bias; Gemma 4: softcapped first)
    and `train_confidence [1, A, b]` (raw scores)."""
    from memra_cli.engine.models.drafter import Drafter
    from memra_cli.train.losses import markov_bias

    if is_gemma4(kind):
        return gemma4_outputs(export, target, kind, inputs)
    x = {k: torch.from_numpy(v) for k, v in inputs.items()}
    drafter, tables = load_train_drafter(export, target, kind)
    out = {}
    for case in ("train", "infer"):
        out[f"{case}_hidden"] = drafter(x[f"{case}_taps"], x[f"{case}_noise"], x[f"{case}_ctx_pos"],
                                        x[f"{case}_blk_pos"], x[f"{case}_mask"])
    engine = Drafter.load(export, dtype=torch.float32)
    out["infer_engine_hidden"] = engine.forward_full(
        x["infer_taps"][0], x["infer_noise"][0], torch.cat([x["infer_ctx_pos"], x["infer_blk_pos"]], 1)[0]).hidden_out
    if kind == "dspark":
        prev = x["train_prev"]
        rows = out["train_hidden"].view(*prev.shape, -1)
        out["train_logits"] = rows @ tables["lm_head.weight"].T + markov_bias(drafter, prev)
        feats = torch.cat([rows, drafter.markov_head.markov_w1(prev)], -1)
        out["train_confidence"] = drafter.confidence_head.proj(feats).squeeze(-1)
    return out


def gemma4_block_scale(target: Path) -> float:
    """The block embedding's multiplier `memra train` resolves for a Gemma4DSparkModel (run.py
    `_block_embedding`): the target's embed_scale (√hidden) rounded to its dtype."""
    tgt = _target_class("dspark_gemma4").from_dir(target)
    return float(torch.tensor(tgt.embed_scale, dtype=tgt.dtype))


@torch.no_grad()
def gemma4_train_outputs(drafter: torch.nn.Module, target: Path, x: dict[str, torch.Tensor],
                         emb_scale: float) -> dict[str, torch.Tensor]:
    """The training step's forward (losses.py `draft_logits`, what `memra train` optimises) on the
    train case: `train_hidden [1, A*b, h]`, `train_logits [1, A, b, V]` (softcapped by the
    target's cap, plus the markov bias, as `drafter_loss` adds it), `train_confidence [1, A, b]`.
    The anchors are the blocks' first positions; the taps are the stored ones."""
    from memra_cli.train.losses import DraftSpec, draft_logits, markov_bias
    from memra_cli.train.taps import EngineTaps

    geo = geometry_args("dspark_gemma4")
    b = geo["block"]
    anchors = x["train_blk_pos"][:, ::b]
    spec = DraftSpec("dspark", b, geo["taps"], geo["mask_token"], emb_scale)
    source = EngineTaps(_target_class("dspark_gemma4").from_dir(target))
    logits, rows, _, prev = draft_logits(drafter, source, x["train_ids"], anchors, spec, taps=x["train_taps"])
    assert torch.equal(prev, x["train_prev"])
    feats = torch.cat([rows, drafter.markov_head.markov_w1(prev)], -1)
    return {"train_hidden": rows.reshape(1, -1, rows.shape[-1]), "train_logits": logits + markov_bias(drafter, prev),
            "train_confidence": drafter.confidence_head.proj(feats).squeeze(-1)}


@torch.no_grad()
def gemma4_outputs(export: Path, target: Path, kind: str, inputs: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """`memra_outputs` for `dspark_gemma4`: the training forward on the train case, the trainable
    and the engine's drafter on the decoding case, each block row embedded as `memra train` does."""
    from memra_cli.engine.models.drafter_gemma4 import Gemma4Drafter

    x = {k: torch.from_numpy(v) for k, v in inputs.items()}
    drafter, tables = load_train_drafter(export, target, kind)
    scale = gemma4_block_scale(target)
    out = gemma4_train_outputs(drafter, target, x, scale)
    noise = torch.nn.functional.embedding(x["infer_noise_ids"], tables["embed_tokens.weight"]) * scale
    out["infer_hidden"] = drafter(x["infer_taps"], noise, x["infer_ctx_pos"], x["infer_blk_pos"], x["infer_mask"])
    engine = Gemma4Drafter.load(export, dtype=torch.float32)
    out["infer_engine_hidden"] = engine.forward_full(
        x["infer_taps"][0], noise[0], torch.cat([x["infer_ctx_pos"], x["infer_blk_pos"]], 1)[0]).hidden_out
    return out


def sha256(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()
