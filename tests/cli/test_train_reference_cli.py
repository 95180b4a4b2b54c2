"""The reference code reads what `memra train` writes: z-lab's `DFlashDraftModel` and DeepSpec's
`Qwen3DSparkModel` loaded the tiny exports of train_reference.py (no missing, unexpected or
mismatched tensor) and their forward outputs are stored in tests/cli/data/train_reference/
(made by make_train_reference_oracle.py from the upstream checkouts; docs/train.md, "Checked
against the reference code"). CI has neither checkout, so it checks the other half: the export
re-created here is byte for byte the one those outputs came from, and memra's forward (the
trainable drafter, and the engine's drafter for the decoding case) gives the same outputs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.cli.train_reference import KINDS, ORACLE_DIR, geometry_args, make_export, memra_outputs, sha256
from tests.engine.fp32_bounds import assert_close_at_scale, layer_reductions, reorder_bound

REMAKE = "the tiny export changed (the recipe or memra's export): re-make the stored outputs (docs/train.md)"


def _oracle(kind: str) -> dict[str, np.ndarray]:
    with np.load(ORACLE_DIR / f"{kind}.npz") as f:
        return dict(f.items())


def _bound(kind: str, keys: int) -> float:
    """float32 reorder bound of the drafter's chain (the two sides sum in different orders:
    transformers' eager attention against SDPA, other GEMM blockings): the fc over the taps,
    each layer's reductions (the tiny target's widths: hidden 64, 4 heads × 16, ffn 128), the
    final norm, then the lm_head over hidden and the markov head over its rank (dspark)."""
    g = geometry_args(kind)
    chain = [len(g["taps"]) * 64]
    for _ in range(g["layers"]):
        chain += layer_reductions(64, 64, 16, keys, 128)
    chain += [64, 64 + g.get("markov_rank", 0)]
    return reorder_bound(*chain)


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
    if kind == "dspark":  # the heads DeepSpec adds: markov-biased logits and the confidence score
        assert {"ref_train_logits", "ref_train_confidence"} <= set(names)
    for name in names:
        want = torch.from_numpy(ref[name])
        keys = ref["train_mask"].shape[-1]
        assert_close_at_scale(ours[name.removeprefix("ref_")].reshape(want.shape), want, _bound(kind, keys), name)
    # the engine's drafter (what `generate` runs) on the decoding case
    want = torch.from_numpy(ref["ref_infer_hidden"][0])
    assert_close_at_scale(ours["infer_engine_hidden"], want, _bound(kind, ref["infer_mask"].shape[-1]), "engine")


def test_the_stored_outputs_name_their_upstream_commits():
    """Anyone with the public repositories can re-make them (docs/train.md names the same commits)."""
    assert str(_oracle("dflash")["upstream_commit"]) == "44947fbf71114e241c96de194f4b382b5dd330d0"  # z-lab/dflash
    assert str(_oracle("dspark")["upstream_commit"]) == "afdfa7c9382a3341a3e6f17756dd816da79f132c"  # DeepSpec
