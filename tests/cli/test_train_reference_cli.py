"""The reference code reads what `memra train` writes: z-lab's `DFlashDraftModel` and DeepSpec's
`Qwen3DSparkModel` and `Gemma4DSparkModel` (over a tiny Gemma 4 target, with k_eq_v and with a
v_proj) loaded the tiny exports of train_reference.py (no missing, unexpected or
mismatched tensor) and their forward outputs are stored in tests/cli/data/train_reference/
(made by make_train_reference_oracle.py from the upstream checkouts; docs/train.md, "Checked
against the reference code"). CI has neither checkout, so it checks the other half: the export
re-created here is byte for byte the one those outputs came from, and memra's forward (the
trainable drafter, and the engine's drafter for the decoding case) gives the same outputs. For
Gemma 4 the trainable side is the training step's own forward (losses.py `draft_logits`: the
block rows scaled as `memra train` resolves it, the target's softcap), and a planted unscaled
block embedding or a rope over the whole head dim must fail the same comparison."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.cli.train_reference import (GEMMA4_LAYOUTS, KINDS, ORACLE_DIR, gemma4_block_scale, gemma4_train_outputs,
                                      geometry_args, is_gemma4, load_train_drafter, make_export, memra_outputs,
                                      sha256)
from tests.engine.fp32_bounds import U, assert_close_at_scale, layer_reductions, reorder_bound

GEMMA4_KINDS = [k for k in KINDS if is_gemma4(k)]

REMAKE = "the tiny export changed (the recipe or memra's export): re-make the stored outputs (docs/train.md)"


def _oracle(kind: str) -> dict[str, np.ndarray]:
    with np.load(ORACLE_DIR / f"{kind}.npz") as f:
        return dict(f.items())


def _bound(kind: str, keys: int, export=None, target=None) -> float:
    """float32 reorder bound of the drafter's chain (the two sides sum in different orders:
    transformers' eager attention against SDPA, other GEMM blockings): the fc over the taps,
    each layer's reductions (the tiny target's widths: hidden 64, 4 heads × 16, ffn 128), the
    final norm, then the lm_head over hidden and the markov head over its rank (dspark)."""
    g = geometry_args(kind)
    if is_gemma4(kind):
        return _gemma4_bound(kind, keys, export, target)
    chain = [len(g["taps"]) * 64]
    for _ in range(g["layers"]):
        chain += layer_reductions(64, 64, 16, keys, 128)
    chain += [64, 64 + g.get("markov_rank", 0)]
    return reorder_bound(*chain)


def _gemma4_bound(kind: str, keys: int, export, target) -> float:
    """The same chain over the Gemma 4 drafter's widths (hidden 64, 4 heads × the full layers'
    head dim 32, ffn 96), plus each layer's score error amplified by its largest score: q and k
    are RMS-normed (norm ~√hd) times their norm weights, attention scaling 1.0, so |q·k| ≤
    hd·max|w_q|·max|w_k|, and a score's absolute error is what the softmax passes on as its
    probabilities' relative error (tests/engine/test_gemma4_dspark.py `_twin_bound`). The
    softcap's slope is at most 1: it does not grow an error."""
    g, (drafter, _) = geometry_args(kind), load_train_drafter(export, target, kind)
    hd, total = drafter.hd, 0.0
    for layer in drafter.layers:
        a = layer.self_attn
        total += 2 * U * hd * a.q_norm.weight.abs().max().item() * a.k_norm.weight.abs().max().item() * hd ** 0.5
    chain = [len(g["taps"]) * 64]
    for _ in range(g["layers"]):
        chain += layer_reductions(64, drafter.heads * hd, hd, keys, 96)
    return total + reorder_bound(*chain, 64, 64 + g["markov_rank"])


@pytest.mark.parametrize("kind", KINDS)
def test_memra_forward_equals_the_reference_codes_on_the_export_it_was_made_from(kind, tmp_path):
    ref = _oracle(kind)
    target, export = make_export(tmp_path, kind)
    assert sha256(export / "config.json") == str(ref["config_sha256"]), REMAKE
    assert sha256(export / "model.safetensors") == str(ref["model_sha256"]), REMAKE

    inputs = {k: v for k, v in ref.items() if k.startswith(("train_", "infer_"))}
    ours = memra_outputs(export, target, kind, inputs)
    names = [k for k in ref if k.startswith("ref_")]
    assert {"ref_train_hidden", "ref_infer_hidden"} <= set(names)
    if kind != "dflash":  # the heads DeepSpec adds: markov-biased logits and the confidence score
        assert {"ref_train_logits", "ref_train_confidence"} <= set(names)
    bound = _bound(kind, ref["train_mask"].shape[-1], export, target)  # the train case's keys: the most
    for name in names:
        want = torch.from_numpy(ref[name])
        assert_close_at_scale(ours[name.removeprefix("ref_")].reshape(want.shape), want, bound, name)
    # the engine's drafter (what `generate` runs) on the decoding case
    want = torch.from_numpy(ref["ref_infer_hidden"][0])
    assert_close_at_scale(ours["infer_engine_hidden"], want, _bound(kind, ref["infer_mask"].shape[-1], export, target),
                          "engine")


@pytest.mark.parametrize("layout", GEMMA4_LAYOUTS[1:], ids="-".join)
def test_every_gemma4_target_layout_exports_the_drafter_deepspec_checked(layout, tmp_path):
    """The multimodal checkpoint and the `per_layer_config` form give the export the stored outputs
    came from: the same tensors, the same config (JSON key order aside), so DeepSpec's load and
    forward on it stand for them too."""
    import json

    ref = _oracle("dspark_gemma4")
    _, export = make_export(tmp_path / "layout", "dspark_gemma4", layout)
    _, stored = make_export(tmp_path / "stored", "dspark_gemma4")
    assert sha256(stored / "config.json") == str(ref["config_sha256"]), REMAKE
    assert sha256(export / "model.safetensors") == str(ref["model_sha256"])
    assert json.loads((export / "config.json").read_text()) == json.loads((stored / "config.json").read_text())


def _full_head_rope(drafter: torch.nn.Module) -> None:
    """Plant the full layers' rope over every dim pair of the head (the default rope at the same
    theta) where Gemma 4's proportional rope rotates only its first quarter."""
    hd, theta = drafter.hd, 1_000_000.0  # the tiny target's full_attention rope_theta
    drafter.inv_freq = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)


@pytest.mark.parametrize("plant", ["unscaled block embedding", "rope over the whole head dim"])
def test_a_gemma4_forward_planted_wrong_fails_the_comparison(plant, tmp_path):
    """The comparison sees the two things a Gemma4DSparkModel adds to a Qwen3 one's inputs: the
    √hidden scale of its block rows (here the raw rows, what `--no-emb-scale` would train) and
    the proportional rope of the target's full layers."""
    kind = "dspark_gemma4"
    ref = _oracle(kind)
    target, export = make_export(tmp_path, kind)
    x = {k: torch.from_numpy(v) for k, v in ref.items() if k.startswith("train_")}
    drafter, _ = load_train_drafter(export, target, kind)
    scale = gemma4_block_scale(target)  # √64
    if plant == "rope over the whole head dim":
        _full_head_rope(drafter)
    else:
        scale = 1.0
    got = gemma4_train_outputs(drafter, target, x, scale)["train_hidden"]
    with pytest.raises(AssertionError, match="max \\|diff\\|"):
        assert_close_at_scale(got, torch.from_numpy(ref["ref_train_hidden"]),
                              _bound(kind, ref["train_mask"].shape[-1], export, target), plant)


def test_the_stored_outputs_name_their_upstream_commits():
    """Anyone with the public repositories can re-make them (docs/train.md names the same commits)."""
    assert str(_oracle("dflash")["upstream_commit"]) == "44947fbf71114e241c96de194f4b382b5dd330d0"  # z-lab/dflash
    for kind in ("dspark", *GEMMA4_KINDS):
        assert str(_oracle(kind)["upstream_commit"]) == "afdfa7c9382a3341a3e6f17756dd816da79f132c"  # DeepSpec
    for kind in GEMMA4_KINDS:  # DeepSpec's Gemma 4 model runs under the transformers it pins
        assert str(_oracle(kind)["transformers_version"]) == "5.10.2"
