"""tau of the embedded drafters on a build's held-out heads, counted two ways (CPU, float32).

    python -m benchmarks.walk_tau --work build-work [--json out.json]

`--work` is the work folder of the build that made the shipped pair (its `data.pt` holds the
held-out continuations; `python -m memra_cli.assets.build --stage target --work W` makes one).
Prints and writes, per drafter, `tau_full` (the accepted prefix averaged over anchors drawn
uniformly over the positions: the build's earlier score) and `tau_walk` (rounds
walked as the bench walks them, tokens / rounds: `memra_cli.assets.train_draft.walk_tau`), on the
half of the held-out heads the confidence calibration did not use.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from memra_cli.assets import ASSETS
from memra_cli.assets.build import Recipe, _halves, _new_drafter
from memra_cli.assets.train_draft import DraftSpec, evaluate, walk_tau


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    from safetensors.torch import load_file

    from memra_cli.hf_compat import protect_kernels_name

    protect_kernels_name()  # the repository's kernels/ folder must not shadow Hugging Face's
    from transformers import Qwen3ForCausalLM

    torch.set_grad_enabled(False)
    target = Qwen3ForCausalLM.from_pretrained(ASSETS / "target", dtype=torch.bfloat16).float().eval()
    data = {k: (v[0].long(), v[1].long()) for k, v in torch.load(a.work / "data.pt").items()}
    _, held = _halves(data["held_heads"])
    r, dev, out = Recipe(), torch.device("cpu"), {"sequences": int(held[0].shape[0])}
    for kind in ("dspark", "dflash"):
        cfg = json.loads((ASSETS / kind / "config.json").read_text())
        taps = tuple(cfg.get("target_layer_ids") or cfg["dflash_config"]["target_layer_ids"])
        drafter = _new_drafter(kind, r, cfg["num_hidden_layers"], taps)
        weights = load_file(str(ASSETS / kind / "model.safetensors"))
        drafter.load_state_dict({k: v.float() for k, v in weights.items()
                                 if not k.startswith(("embed_tokens", "lm_head"))})
        spec = DraftSpec(kind, cfg["block_size"], taps, 1)
        full = evaluate(drafter, target, held[0], spec, anchors=r.anchors, prompt_len=held[1], device=dev)["tau_full"]
        out[kind] = {"tau_full": full, **walk_tau(drafter, target, held[0], spec, prompt_len=held[1], device=dev)}
        print(kind, out[kind], flush=True)
    if a.json:
        a.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
