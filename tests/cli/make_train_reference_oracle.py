"""Make the stored reference outputs of tests/cli/test_train_reference_cli.py (not a test: it needs
the upstream checkouts, which CI does not have).

    python tests/cli/make_train_reference_oracle.py --zlab DIR --deepspec DIR [--kinds K,...] [--out DIR]

`--zlab` is a checkout of github.com/z-lab/dflash, `--deepspec` one of
github.com/deepseek-ai/DeepSpec (the commits are recorded). For each kind it re-creates the
tiny export (train_reference.py), loads it with the upstream class through `from_pretrained`
(z-lab's `DFlashDraftModel`, DeepSpec's `Qwen3DSparkModel` or `Gemma4DSparkModel`; f32, eager
attention; DeepSpec's Gemma 4 model needs the transformers it pins, 5.10.2), refuses any
missing, unexpected or mismatched tensor, runs the upstream forward on the stored inputs and
writes `KIND.npz`: the inputs, the upstream outputs (`ref_*`), the export's sha256, the
upstream commit and the transformers version it ran under. It prints memra's largest difference
from each output.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_reference import KINDS, ORACLE_DIR, is_gemma4, make_export, make_inputs, memra_outputs, sha256  # noqa: E402


def _commit(checkout: Path, given: str | None) -> str:
    """The checkout's commit: `given` (a checkout made with `git archive` has no .git), else git's."""
    if given:
        return given
    return subprocess.run(["git", "-C", str(checkout), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()


def _additive(mask: torch.Tensor) -> torch.Tensor:
    """Bool mask (True = attend) -> the additive float mask eager attention adds to its scores."""
    return torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)


def _load(cls, export: Path):
    model, info = cls.from_pretrained(export, dtype=torch.float32, attn_implementation="eager",
                                      output_loading_info=True)
    bad = {k: v for k, v in info.items() if v}
    if bad:
        raise SystemExit(f"error: {cls.__name__} does not load {export} cleanly: {bad}")
    return model.eval()


@torch.no_grad()
def zlab_outputs(checkout: Path, export: Path, x: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    sys.path.insert(0, str(checkout))
    from dflash.model import DFlashDraftModel

    model, out = _load(DFlashDraftModel, export), {}
    for case in ("train", "infer"):
        pos = torch.cat([x[f"{case}_ctx_pos"], x[f"{case}_blk_pos"]], 1)
        mask = _additive(x[f"{case}_mask"]) if case == "train" else None  # decoding: every context row is visible
        out[f"ref_{case}_hidden"] = model(position_ids=pos, attention_mask=mask, noise_embedding=x[f"{case}_noise"],
                                          target_hidden=x[f"{case}_taps"])
    return out


@torch.no_grad()
def _dspark_outputs(model, x: dict[str, torch.Tensor], noise) -> dict[str, torch.Tensor]:
    """A DeepSpec DSpark model's backbone hidden states (train and infer cases), then the train
    case's block logits with the markov bias and its confidence. `noise(case)`: the block rows."""
    out = {}
    for case in ("train", "infer"):
        pos = torch.cat([x[f"{case}_ctx_pos"], x[f"{case}_blk_pos"]], 1)
        mask = _additive(x[f"{case}_mask"]) if case == "train" else None
        out[f"ref_{case}_hidden"] = model._forward_backbone(position_ids=pos, attention_mask=mask,
                                                            noise_embedding=noise(case),
                                                            target_hidden_states=x[f"{case}_taps"])
    prev = x["train_prev"]
    rows = out["ref_train_hidden"].view(*prev.shape, -1)
    out["ref_train_logits"] = model.markov_head.apply_block_logits(model.compute_logits(rows), token_ids=prev,
                                                                   hidden_states=rows)
    out["ref_train_confidence"] = model.predict_confidence_step(rows, prev)
    return out


def deepspec_outputs(checkout: Path, export: Path, x: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """DeepSpec's Qwen3DSparkModel: the block rows are the given noise embedding."""
    sys.path.insert(0, str(checkout))
    from deepspec.modeling.dspark.qwen3.modeling import Qwen3DSparkModel

    return _dspark_outputs(_load(Qwen3DSparkModel, export), x, lambda case: x[f"{case}_noise"])


def deepspec_gemma4_outputs(checkout: Path, export: Path, x: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """DeepSpec's Gemma4DSparkModel: the block rows are its own scaled embedding of the block ids,
    the logits its `compute_logits` (softcapped) with the markov bias."""
    sys.path.insert(0, str(checkout))
    from deepspec.modeling.dspark.gemma4.modeling import Gemma4DSparkModel

    model = _load(Gemma4DSparkModel, export)
    return _dspark_outputs(model, x, lambda case: model.embed_tokens(x[f"{case}_noise_ids"]))


def _upstream(kind: str, a: argparse.Namespace):
    """(checkout, its outputs function, its given commit) of a kind."""
    if kind == "dflash":
        return a.zlab, zlab_outputs, a.zlab_commit
    return a.deepspec, deepspec_gemma4_outputs if is_gemma4(kind) else deepspec_outputs, a.deepspec_commit


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--zlab", type=Path, help="a checkout of github.com/z-lab/dflash (kind dflash)")
    p.add_argument("--deepspec", type=Path, help="a checkout of github.com/deepseek-ai/DeepSpec (the dspark kinds)")
    p.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated, of {', '.join(KINDS)} (default: all)")
    p.add_argument("--zlab-commit", help="the z-lab checkout's commit, when it is not a git work tree")
    p.add_argument("--deepspec-commit", help="the DeepSpec checkout's commit, when it is not a git work tree")
    p.add_argument("--out", type=Path, default=ORACLE_DIR)
    a = p.parse_args()
    kinds = a.kinds.split(",")
    for kind in kinds:
        if kind not in KINDS:
            p.error(f"--kinds: {kind!r} is not one of {', '.join(KINDS)}")
        if _upstream(kind, a)[0] is None:
            p.error(f"--kinds {kind}: needs --{'zlab' if kind == 'dflash' else 'deepspec'}")
    a.out.mkdir(parents=True, exist_ok=True)
    for kind in kinds:
        checkout, run, commit = _upstream(kind, a)
        with tempfile.TemporaryDirectory() as tmp:
            target, export = make_export(Path(tmp), kind)
            inputs = make_inputs(export, target)
            x = {k: torch.from_numpy(v) for k, v in inputs.items()}
            ref = {k: v.float().numpy() for k, v in run(checkout.resolve(), export, x).items()}
            ours = memra_outputs(export, target, kind, inputs)
            for name, want in ref.items():
                got = ours[name.removeprefix("ref_")].reshape(want.shape).numpy()
                print(f"{kind} {name}: max |memra - upstream| {np.abs(got - want).max():.3e} "
                      f"(scale {np.abs(want).max():.3e})")
            got = ours["infer_engine_hidden"].numpy()
            print(f"{kind} engine infer_hidden: max |diff| {np.abs(got - ref['ref_infer_hidden'][0]).max():.3e}")
            np.savez_compressed(a.out / f"{kind}.npz", **inputs, **ref,
                                config_sha256=np.array(sha256(export / "config.json")),
                                model_sha256=np.array(sha256(export / "model.safetensors")),
                                upstream_commit=np.array(_commit(checkout, commit)),
                                transformers_version=np.array(transformers.__version__))
        print(f"wrote {a.out / (kind + '.npz')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
