"""First numbers at real shapes (not a test): plain greedy ms/token and speculative ms/round.

Builds a random-weight target of the Qwen3-8B shape (36 layers, hidden 4096, 32/8 heads x 128,
ffn 12288, vocab 151936) in memory and writes a random 5-layer DFlash drafter (5 taps, block 16)
to disk (so it goes through the real loader), then on one prompt of 512 random ids measures:

- plain greedy through memra's target (ms/token, `off` arm),
- one DFlash round with the verify window pinned at 16 (ms/round), with its phase breakdown,
- the exactness gate: the speculative stream equals the plain one, token for token,

once per target step mode (`--widths 16g,16,variable`: 16-row steps replayed as CUDA graphs, 16-row
steps eager, natural widths): fixed-width modes must be exact; variable steps are measured and
reported (in bf16 they are not exact: docs/perf.md).

Random drafters are almost never accepted, so rounds commit ~1 token: this measures cost, not
speed-up. The HF transformers + z-lab anchors and the floors it was compared with are in
docs/journal.md ("First numbers at the Qwen3-8B shape").

    python -m benchmarks.gpu_shapes [--small] [--tokens 48] [--prompts 3] [--widths 16,variable] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from memra_cli.engine.api import ArmConfig, Engine
from memra_cli.engine.formats.config import parse_target_config
from memra_cli.engine.spec.policy import PolicySettings
from memra_cli.engine.models.llama import LlamaTarget
from memra_cli.engine.models.qwen3 import LayerWeights, Qwen3Target
from memra_cli.tiny.draft import make_tiny_draft

# LLaMA-3.1-8B (its published config.json): llama3 rope, factor 8 over 8192 original positions,
# theta 5e5; the drafter taps by z-lab's default rule for 32 target layers and 5 draft layers.
LLAMA3_8B_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
SHAPES = {
    "8b": dict(vocab=151936, hidden=4096, layers=36, heads=32, kv=8, hd=128, ffn=12288, d_layers=5, taps=(1, 9, 17, 25, 33)),
    "small": dict(vocab=512, hidden=128, layers=4, heads=4, kv=2, hd=32, ffn=256, d_layers=2, taps=(0, 2)),
    "llama-8b": dict(vocab=128256, hidden=4096, layers=32, heads=32, kv=8, hd=128, ffn=14336, d_layers=5,
                     taps=(1, 8, 15, 22, 29), family="llama", rope=LLAMA3_8B_ROPE, max_pos=131072),
    # vocab 640: the lm_head's shape differs from gate/up's (512 x 128), so step_launches routes each by its own 8B role
    "llama-small": dict(vocab=640, hidden=128, layers=4, heads=4, kv=2, hd=32, ffn=256, d_layers=2, taps=(0, 2),
                        family="llama", rope={**LLAMA3_8B_ROPE, "original_max_position_embeddings": 32}, max_pos=2048),
}


def random_target(s: dict, dtype: torch.dtype, device: torch.device) -> Qwen3Target:
    """A random-weight target of shape `s` in memory: Qwen3, or LLaMA when `s["family"]` says so
    (no q/k norms, its rope parameters)."""
    family = s.get("family", "qwen3")
    raw = {"model_type": family, "vocab_size": s["vocab"], "hidden_size": s["hidden"], "intermediate_size": s["ffn"],
           "num_hidden_layers": s["layers"], "num_attention_heads": s["heads"], "num_key_value_heads": s["kv"],
           "head_dim": s["hd"], "max_position_embeddings": s.get("max_pos", 40960),
           "rope_parameters": s.get("rope", {"rope_type": "default", "rope_theta": 1e6}), "tie_word_embeddings": False}
    cfg = parse_target_config(raw, f"random-{family}-{s['hidden']}")
    g = torch.Generator(device=device).manual_seed(0)

    def rnd(*shape, std=0.02):
        return (torch.randn(*shape, generator=g, device=device, dtype=torch.float32) * std).to(dtype)

    h, q, kv, ff = s["hidden"], s["heads"] * s["hd"], s["kv"] * s["hd"], s["ffn"]
    ones = lambda n: torch.ones(n, dtype=dtype, device=device)  # noqa: E731
    qk_norm = (lambda: ones(s["hd"])) if cfg.qk_norm else (lambda: None)  # noqa: E731
    layers = [LayerWeights(rnd(q + 2 * kv, h), None, rnd(h, q), None, qk_norm(), qk_norm(), ones(h), ones(h),
                           rnd(2 * ff, h), rnd(h, ff)) for _ in range(s["layers"])]
    cls = LlamaTarget if family == "llama" else Qwen3Target
    return cls(cfg, rnd(s["vocab"], h, std=1.0), layers, ones(h), rnd(s["vocab"], h))


def run_arm(engine, arm, ids, n):
    """One session of `arm` (None: plain greedy), primed outside the clock: (session, seconds)."""
    s = engine.session(ids, n, arm, timed=False, eos_ids=())
    s.prime()
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    s.run()
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    return s, time.perf_counter() - t0


def timed_phases(engine, arm, ids, n):
    s = engine.session(ids, n, arm, timed=True, eos_ids=())
    s.run()
    st = s.stats
    return {k: 1e3 * v / max(1, st.rounds) for k, v in st.phase_s.items() if k != "prefill"}


def measure(engine, spec_arm, ids, tokens) -> dict:
    """Plain ms/token, round ms and phases, and exactness on one prompt, at the engine's step mode."""
    run_arm(engine, None, ids, 8)  # warm-up (allocator, kernels, graph captures)
    run_arm(engine, spec_arm, ids, 8)
    plain, t_plain = run_arm(engine, None, ids, tokens)
    spec, t_spec = run_arm(engine, spec_arm, ids, tokens)
    phases = timed_phases(engine, spec_arm, ids, min(tokens, 16))
    first = next((i for i, (a, b) in enumerate(zip(spec.tokens, plain.tokens)) if a != b), None)
    return {"plain_ms_per_token": 1e3 * t_plain / len(plain.tokens), "round_ms": 1e3 * t_spec / spec.stats.rounds,
            "rounds": spec.stats.rounds, "tau": spec.stats.tau, "round_phase_ms": phases,
            "exact": spec.tokens == plain.tokens, "first_mismatch": first}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--small", action="store_true", help="a tiny shape (CPU smoke)")
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--prompts", type=int, default=1, help="exactness over this many random prompts (timings from the first)")
    p.add_argument("--widths", default="16g,16,variable",
                   help="target step modes to compare: N (step_width N, eager), Ng (N with CUDA graphs), NG (Ng and "
                        "the drafter's rounds graphed too), variable")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto")
    p.add_argument("--kernels", action="store_true", help="the target's fixed-width steps through memra_kernels")
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    s = SHAPES["small" if a.small else "8b"]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(
        a.dtype, torch.bfloat16 if device.type == "cuda" else torch.float32)
    # "16g": target steps graphed; "16G": the drafter's round side too (MEMRA_DRAFT_GRAPHS)
    modes = [(w, None if w == "variable" else int(w.rstrip("gG")), w[-1] in "gG", w.endswith("G"))
             for w in a.widths.split(",")]
    if device.type != "cuda":
        modes = [m for m in modes if not m[2]]
    torch.manual_seed(0)
    runs = {}
    with torch.inference_mode():
        target = random_target(s, dtype, device)
        if a.kernels:
            from memra_cli.engine.layers.triton_step_ops import TritonStepOps

            target.step_ops = TritonStepOps()
        tmp = Path(tempfile.mkdtemp())
        draft = make_tiny_draft(tmp / "draft", "zlab", hidden=s["hidden"], layers=s["d_layers"], heads=s["heads"],
                                kv_heads=s["kv"], head_dim=s["hd"], intermediate=s["ffn"], vocab=s["vocab"],
                                mask_token_id=s["vocab"] - 1, block_size=16, target_layer_ids=s["taps"],
                                num_target_layers=s["layers"], dtype=torch.bfloat16, std=0.02)
        prompts = [torch.randint(0, s["vocab"] - 1, (a.prompt,), generator=torch.Generator().manual_seed(1 + k)).tolist()
                   for k in range(a.prompts)]
        # verify window pinned at the cap: 16 rows per round
        arm_cfg = ArmConfig(draft=draft, mode="dflash", settings=PolicySettings(adapt="0"), verify_cap=16)
        drafter = None  # loaded once (by the first engine's arm), shared by every step mode
        for name, w, graphs, draft_graphs in modes:
            # one engine per step mode around the same target: its runner owns width and graphs
            engine = Engine.from_model(target, step_width=w, cuda_graphs=graphs, draft_graphs=draft_graphs)
            spec_arm = engine.arm(arm_cfg, drafter=drafter)
            drafter = spec_arm.drafter
            first = measure(engine, spec_arm, prompts[0], a.tokens)
            more = []
            for ids in prompts[1:]:
                plain, _ = run_arm(engine, None, ids, a.tokens)
                spec, _ = run_arm(engine, spec_arm, ids, a.tokens)
                more.append(spec.tokens == plain.tokens)
            first["exact_prompts"] = f"{int(first['exact']) + sum(more)}/{len(prompts)}"
            runs[name] = first
            print(f"step mode {name}: " + json.dumps(first), flush=True)
            del engine, spec_arm  # its pool (storages, graphs) goes before the next mode's
    out = {
        "shape": "small" if a.small else "qwen3-8b", "step_ops": target.step_ops.name, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "dtype": str(dtype), "prompt": a.prompt, "tokens": a.tokens, "prompts": a.prompts, "by_step_width": runs,
        "anchors_hf_ms": {"plain": 32.8, "round": 57.2}, "floors_ms": {"plain": 3.85, "round": 4.7},
    }
    print(json.dumps(out, indent=2))
    if a.json:
        a.json.write_text(json.dumps(out, indent=2))
    bad = [w for w, r in runs.items() if w != "variable" and r["exact_prompts"] != f"{a.prompts}/{a.prompts}"]
    if bad:
        raise SystemExit(f"EXACTNESS GATE FAILED at step width {', '.join(bad)}: speculative stream != plain greedy")


if __name__ == "__main__":
    main()
