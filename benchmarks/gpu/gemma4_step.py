"""The Gemma 4 target step against its floor, in one process (random weights, bf16 on CUDA):
`python benchmarks/gpu/target_step.py --shape gemma4-31b [--contexts 512,4096,32768] [--json OUT]`.

The 31B text shape (`GEMMA4_31B`) is google/gemma-4-31b-it's published text_config: hidden 5376,
60 layers in a 5 sliding : 1 full pattern, 32 query heads, 16 KV heads of 256 on sliding layers,
4 KV heads of 512 on full ones with attention_k_eq_v, MLP 21504, vocab 262144, window 1024, final
softcap 30, tied embeddings, no per-layer inputs or KV sharing (the values several public configs
and test fixtures of Gemma 4 runtimes carry; hidden 5376 is also the reference engine's drafter).

Prints and writes: the cuBLAS matmul chain of one 16-row step (graphed), the HBM read floor
(weights + live K/V once at the measured copy bandwidth), the graphed fixed-width step as plain
decode (1 real row of 16) and as a 16-row verify at each live context with the Triton step ops
(the headline `plain_ms` / `verify16_ms`: windowed attention, Gemma's q/k norm + rope + K/V
write, the sandwich norms' add + norm, GELU-tanh · up, softcap) and with the torch step ops
beside them (`torch_plain_ms` / `torch_verify16_ms`, and the ratios), CUDA kernels per eager step
for each, how far one 16-row step's logits of the two are apart (`ops_agreement`), and peak GPU
memory; then the Triton step again with each of `STEP_FULL_TILES` as the full layers' attention
tile (`full_tile_steps`, the same process). Before those, the exactness gate (`exactness_sweep`,
`exact`): speculative rounds == plain greedy on the timed target at 512 and 2,048 keys (past the
window). `SMALL` is the CPU smoke test's shape.

With `--attn-sweep` (target_step.py) it also times the attention alone at the 31B's two layer
shapes for the module's tile and the candidates in `ATTN_CANDIDATES` (graphed, us per call, one
row and 16 rows at each context; `attention_sweep`), each candidate's distance from the module
tile's output beside it: the data for `memra_kernels.attention.TILES[512]`, which no GPU has swept.
"""

from __future__ import annotations

import gc
import json
import sys

import torch
import torch.nn.functional as F

from memra_cli.engine.formats.gemma4_config import FULL, SLIDING, parse_gemma4_config
from memra_cli.engine.models.gemma4 import Gemma4Target, LayerWeights

GEMMA4_31B = dict(vocab=262144, hidden=5376, layers=60, heads=32, kv=16, hd=256, global_kv=4, global_hd=512,
                  ffn=21504, window=1024, softcap=30.0)
SMALL = dict(vocab=512, hidden=128, layers=6, heads=4, kv=2, hd=32, global_kv=1, global_hd=64, ffn=256,
             window=64, softcap=30.0)
# the 31B's attention per layer type: (n_heads, n_kv, head_dim, window)
GEMMA4_ATTN = {"sliding": (32, 16, 256, 1024), "full": (32, 4, 512, 0)}
# candidate tiles per head-dim class, (SPLIT, BLOCK_N, BLOCK_M, STAGES, WARPS[, LONG_SPLIT, LONG_FROM[,
# BLOCK_DV]]), beside the module's: a candidate that fails to launch is recorded, not fatal.
# A 16-row step is g * 16 query rows a KV head (sliding g = 2: 32; full g = 8: 128) and every
# BLOCK_M tile of them reads all of the head's keys. The 512 class: the 16-row tile before the
# module's, and 64-row wgmma tiles near it (value parts of 128 or 256, other growing splits):
# docs/gemma4.md#kernels-and-cuda
ATTN_CANDIDATES = {
    256: [(128, 32, 16, 3, 4), (256, 64, 16, 2, 4), (128, 32, 32, 2, 8)],
    512: [(128, 32, 16, 2, 8), (256, 32, 64, 3, 8, 2048, 4096, 256), (256, 32, 64, 3, 4, 2048, 4096, 128),
          (256, 32, 64, 3, 4, 1024, 8192, 128), (128, 32, 64, 3, 4, 1024, 4096, 128),
          (256, 32, 64, 2, 4, 1024, 4096, 128)],
}
# Full-layer tiles the whole step also runs with (`full_tile_steps`), beside the module tile and
# the attention sweep's pick for the 512 class (`pick_tile`) when the sweep ran: the tile before
# the module's, and the 8-warp 64-row tile with value parts of 256
STEP_FULL_TILES = [(128, 32, 16, 2, 8), (256, 32, 64, 3, 8, 2048, 4096, 256)]


def gemma4_raw(s: dict) -> dict:
    """config.json keys of the Gemma 4 text shape `s` (published key layout)."""
    types = [SLIDING if (i + 1) % 6 else FULL for i in range(s["layers"])]
    raw = {"model_type": "gemma4_text", "vocab_size": s["vocab"], "hidden_size": s["hidden"],
           "intermediate_size": s["ffn"], "num_hidden_layers": s["layers"], "num_attention_heads": s["heads"],
           "num_key_value_heads": s["kv"], "head_dim": s["hd"], "global_head_dim": s["global_hd"],
           "num_global_key_value_heads": s["global_kv"], "attention_k_eq_v": True, "sliding_window": s["window"],
           "layer_types": types, "final_logit_softcapping": s["softcap"], "hidden_size_per_layer_input": 0,
           "max_position_embeddings": 262144, "tie_word_embeddings": True,
           "rope_parameters": {SLIDING: {"rope_type": "default", "rope_theta": 1e4},
                               FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6}}}
    return raw


def gemma4_config(s: dict):
    """The Gemma 4 text config of shape `s` (published key layout)."""
    return parse_gemma4_config(gemma4_raw(s), f"random-gemma4-{s['hidden']}")


def random_gemma4(s: dict, dtype: torch.dtype, device: torch.device) -> Gemma4Target:
    """A Gemma4Target of shape `s` with random weights (~1/sqrt(fan_in) projections, unit norms)."""
    cfg = gemma4_config(s)
    g = torch.Generator(device=device).manual_seed(0)

    def rnd(*shape, std=0.02):
        return (torch.randn(*shape, generator=g, device=device, dtype=torch.float32) * std).to(dtype)

    ones = lambda n: torch.ones(n, dtype=dtype, device=device)  # noqa: E731
    h, nh, layers = cfg.hidden_size, cfg.num_attention_heads, []
    for i in range(cfg.num_hidden_layers):
        hd, kv = cfg.head_dims[i], cfg.kv_heads[i]
        rows = (nh + kv * (1 if cfg.k_eq_v(i) else 2)) * hd
        layers.append(LayerWeights(rnd(rows, h), rnd(h, nh * hd), ones(hd), ones(hd), (ones(h),) * 4,
                                   rnd(2 * cfg.intermediate(i), h), rnd(h, cfg.intermediate(i)), ones(1),
                                   None, None, None))
    embed = rnd(cfg.vocab_size, h, std=1.0)
    return Gemma4Target(cfg, embed, layers, ones(h), embed)


def kv_bytes(target: Gemma4Target, ctx: int) -> int:
    """K/V bytes a step reads at context `ctx`: a full layer's `ctx` keys, a sliding layer's
    window of them (every layer owns its K/V in the 31B shape)."""
    cfg = target.cfg
    keys = [min(ctx, cfg.sliding_window) if kind == SLIDING else ctx for kind in cfg.layer_types]
    return sum(2 * cfg.kv_heads[i] * cfg.head_dims[i] * keys[i] * target.dtype.itemsize
               for i in range(cfg.num_hidden_layers))


def weight_bytes(target: Gemma4Target) -> int:
    return sum(t.numel() * t.element_size() for w in target.layers for t in (w.wqkv, w.wo, w.w_gate_up, w.w_down)) \
        + target.lm_head_weight.numel() * target.dtype.itemsize


def matmul_chain(target: Gemma4Target, rows: int):
    """Every weight matmul of one `rows`-row step, as one callable (inputs allocated once)."""
    dev, dt, h = target.device, target.dtype, target.hidden_size
    x = torch.randn(rows, h, dtype=dt, device=dev)
    ins = [(torch.randn(rows, w.wo.shape[1], dtype=dt, device=dev), torch.randn(rows, w.w_down.shape[1], dtype=dt,
                                                                                device=dev)) for w in target.layers]

    def chain():
        for w, (attn, act) in zip(target.layers, ins):
            F.linear(x, w.wqkv)
            F.linear(attn, w.wo)
            F.linear(x, w.w_gate_up)
            F.linear(act, w.w_down)
        return F.linear(x, target.lm_head_weight)

    return chain


def ops_agreement(target: Gemma4Target, ops_by_name: dict, width: int, prompt: int = 600) -> dict:
    """One `width`-row step after a `prompt`-token prefill (past the window on sliding layers)
    under each step ops: the logits' relative L2 distance of the others from the first, and the
    fraction of rows whose argmax agrees. `target.step_ops` is left as the last one."""
    from memra_cli.engine.runtime.steps import StepRunner

    g = torch.Generator(device=target.device).manual_seed(1)
    ids = torch.randint(0, target.vocab_size - 1, (prompt + width,), generator=g, device=target.device)
    logits = {}
    for name, ops in ops_by_name.items():
        target.step_ops = ops
        runner = StepRunner(target, width)
        state = runner.new_state(prompt + width)
        runner.prefill(ids[:prompt], state)
        logits[name] = runner.step(ids[prompt:], prompt, state)[0].float()
        runner.release(state)
    first, *others = logits
    ref = logits[first]
    return {f"{n}_vs_{first}": {"rel_l2": ((logits[n] - ref).norm() / ref.norm()).item(),
                                "argmax_agree": (logits[n].argmax(-1) == ref.argmax(-1)).float().mean().item()}
            for n in others}


def attention_sweep(contexts: list[int], timer, device, dtype=torch.bfloat16, shapes=None, candidates=None) -> dict:
    """Per layer shape, tile and context: us per call of the attention alone for 1 and 16 rows
    at the cache's last positions (`timer(fn) -> ms`, e.g. target_step's graph_ms), and the
    relative L2 distance of each tile's 16-row output from the module tile's."""
    from dataclasses import asdict

    from memra_kernels import attention

    shapes = GEMMA4_ATTN if shapes is None else shapes
    candidates = ATTN_CANDIDATES if candidates is None else candidates
    g = torch.Generator(device=device).manual_seed(2)
    out: dict = {}
    for kind, (nh, nkv, hd, window) in shapes.items():
        module = asdict(attention.tile_for(hd))
        cls = 128 if hd <= 128 else 256 if hd <= 256 else 512
        tiles = [module] + [asdict(attention.Tile(*c)) for c in candidates.get(cls, [])]
        for c in contexts:
            k, v = (torch.randn(nkv, c, hd, generator=g, device=device).to(dtype) for _ in range(2))
            q = torch.randn(16, nh, hd, generator=g, device=device).to(dtype)
            pos = torch.arange(c - 16, c, device=device)
            ref = attention._launch(q, k, v, pos, 1.0, **module, window=window).float()
            # a sliding layer's module tile again on the causal grid over every position: the window grid's A/B
            runs = [(tile, True) for tile in tiles] + ([(module, False)] if window else [])
            for tile, over_windows in runs:
                name = ",".join(str(x) for x in tile.values()) + ("" if over_windows else ",causal-grid")
                row = out.setdefault(kind, {}).setdefault(name, {})
                attention.GRID_OVER_WINDOWS = over_windows
                try:
                    got = attention._launch(q, k, v, pos, 1.0, **tile, window=window).float()
                    row[str(c)] = {
                        "us_1": 1e3 * timer(lambda: attention._launch(q[-1:], k, v, pos[-1:], 1.0, **tile,
                                                                      window=window)),
                        "us_16": 1e3 * timer(lambda: attention._launch(q, k, v, pos, 1.0, **tile, window=window)),
                        "rel_l2_vs_module": ((got - ref).norm() / ref.norm()).item()}
                except Exception as exc:  # a candidate the GPU refuses (shared memory, ...): its row says why
                    row[str(c)] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
                finally:
                    attention.GRID_OVER_WINDOWS = True
    return out


def pick_tile(sweep_rows: dict, slack: float = 1.05) -> tuple | None:
    """The tile of one layer shape's sweep rows (`attention_sweep(...)[kind]`) fastest at 16 rows
    at the longest context among those within `slack` of the module tile (its first row) at every
    shorter one: a tuple of Tile's fields, or None when the module tile is that one."""
    keys = list(sweep_rows)
    module = sweep_rows[keys[0]]
    contexts = sorted(int(c) for c in module if "us_16" in module[c])
    if not contexts:
        return None
    longest = str(contexts[-1])

    def fits(row):
        return all("us_16" in row.get(str(c), {}) and row[str(c)]["us_16"] <= slack * module[str(c)]["us_16"]
                   for c in contexts[:-1]) and "us_16" in row.get(longest, {})

    best = min((k for k in keys if fits(sweep_rows[k])), key=lambda k: sweep_rows[k][longest]["us_16"],
               default=keys[0])
    return None if best == keys[0] else tuple(int(x) for x in best.split(","))


def full_tile_steps(target: Gemma4Target, contexts: list[int], helpers, width: int, tiles) -> dict:
    """The Triton step again with each of `tiles` as the full layers' attention tile
    (`TILES[512]`, restored after), beside the module tile's rows: plain and verify ms per context."""
    from dataclasses import asdict

    from memra_kernels import attention

    module, rows = attention.TILES[512], {}
    try:
        for cand in tiles:
            attention.TILES[512] = attention.Tile(*cand)
            rows[",".join(map(str, cand))] = {"tile": asdict(attention.TILES[512]),
                                              **_triton_steps(target, contexts, helpers, width, f"full tile {cand}")}
    finally:
        attention.TILES[512] = module
    return rows


def _triton_steps(target: Gemma4Target, contexts: list[int], helpers, width: int, label: str) -> dict:
    """Plain and verify ms per context of the graphed step with the Triton step ops, as the
    module's attention globals stand; the Engine (its states, its graphs) freed after."""
    from memra_cli.engine.api import Engine
    from memra_cli.engine.layers.triton_step_ops import TritonStepOps

    target.step_ops = TritonStepOps()
    engine = Engine.from_model(target, step_width=width, cuda_graphs=True)
    rows: dict = {}
    for c in contexts:
        rows[str(c)] = {"plain_ms": helpers.step_ms(engine, c, 1)[0],
                        "verify16_ms": helpers.step_ms(engine, c, width)[0]}
        print(f"{label} ctx {c}: plain {rows[str(c)]['plain_ms']:.3f} ms, "
              f"verify16 {rows[str(c)]['verify16_ms']:.3f} ms", flush=True)
    del engine
    _free_engines()
    return rows


def _free_engines() -> None:
    """Collect dropped Engines (their states and graphs) and hand their CUDA memory back, so the
    next stage's Engine starts from the same memory."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def causal_grid_steps(target: Gemma4Target, contexts: list[int], helpers, width: int) -> dict:
    """The Triton step with the sliding layers' attention on the causal grid over every position
    (`attention.GRID_OVER_WINDOWS` off, restored after): the window grid's A/B, plain and verify
    ms per context (the same bits: tests/kernels/test_attention.py)."""
    from memra_kernels import attention

    before, attention.GRID_OVER_WINDOWS = attention.GRID_OVER_WINDOWS, False
    try:
        return _triton_steps(target, contexts, helpers, width, "causal grid")
    finally:
        attention.GRID_OVER_WINDOWS = before


def exactness_sweep(target: Gemma4Target, helpers, width: int, lengths: tuple[int, ...] = (512, 2048),
                    prompts: int = 2, tokens: int = 48, cuda_graphs: bool = True) -> dict:
    """Speculative == plain greedy on the timed target: each random prompt's plain stream, then
    the same stream through speculative rounds whose drafts are that stream with one slot
    corrupted per round (`helpers.oracle_run`, target_step's StreamOracle), so every acceptance
    length is verified and rolled back. A length past the sliding window (1,024 on the 31B) runs
    the sliding layers' rings through wrapped rounds. {"runs": [...], "exact": bool}."""
    from benchmarks.gpu_shapes import run_arm
    from memra_cli.engine.api import Engine

    engine = Engine.from_model(target, step_width=width, cuda_graphs=cuda_graphs)
    runs = []
    for length in lengths:
        for k in range(prompts):
            ids = torch.randint(0, target.vocab_size - 1, (length,),
                                generator=torch.Generator().manual_seed(100 + k)).tolist()
            plain, _ = run_arm(engine, None, ids, tokens)
            spec, tau = helpers.oracle_run(engine, ids, plain.tokens, seed=k)
            runs.append({"length": length, "prompt": k, "exact": spec == plain.tokens, "oracle_tau": tau})
            print(f"exactness length {length} prompt {k}: {'exact' if runs[-1]['exact'] else 'MISMATCH'}, "
                  f"oracle tau {tau:.2f}", flush=True)
    del engine
    _free_engines()
    return {"tokens": tokens, "runs": runs, "exact": all(r["exact"] for r in runs)}


def measure(contexts: list[int], out_path, helpers, attn_sweep: bool = False,
            ops: tuple[str, ...] = ("torch", "triton")) -> dict:
    """The CUDA run (`helpers`: target_step's graph_ms / replay_ms / copy_gbps / step_ms /
    kernels_per_step)."""
    from memra_cli.engine.api import Engine
    from memra_cli.engine.layers.torch_step_ops import TorchStepOps
    from memra_cli.engine.layers.triton_step_ops import TritonStepOps

    W = 16
    out: dict = {"shape": "gemma4-31b", "config": GEMMA4_31B, "dtype": "bfloat16",
                 "device": torch.cuda.get_device_name(), "step_width": W,
                 "step_ops": "triton (headline); torch beside it (torch_*)",
                 "command": "python benchmarks/gpu/target_step.py " + " ".join(sys.argv[1:])}
    with torch.inference_mode():
        target = random_gemma4(GEMMA4_31B, torch.bfloat16, torch.device("cuda"))
        bw = helpers.copy_gbps()["used"]
        chain = helpers.graph_ms(matmul_chain(target, W))
        wb = weight_bytes(target)
        out.update(copy_gbps=bw, matmul_chain_ms=chain, weight_bytes=wb,
                   floor_ms={str(c): chain + kv_bytes(target, c) / bw / 1e6 for c in contexts},
                   hbm_read_floor_ms={str(c): (wb + kv_bytes(target, c)) / bw / 1e6 for c in contexts})
        ops_by_name = {n: {"torch": TorchStepOps, "triton": TritonStepOps}[n]() for n in ops}
        if len(ops_by_name) > 1:
            out["ops_agreement"] = ops_agreement(target, ops_by_name, W)
            print(f"ops agreement: {out['ops_agreement']}")
        out["kernels_per_step"] = {}
        for name, step_ops in ops_by_name.items():  # same process, same target: a side-by-side ratio
            target.step_ops = step_ops
            engine = Engine.from_model(target, step_width=W, cuda_graphs=True)
            out["kernels_per_step"][name] = helpers.kernels_per_step(engine)
            key = "" if name == "triton" else f"{name}_"
            for field in ("plain_ms", "verify16_ms", "peak_gib"):
                out.setdefault(key + field, {})
            for c in contexts:
                plain, _ = helpers.step_ms(engine, c, 1)
                verify, peak = helpers.step_ms(engine, c, W)
                out[key + "plain_ms"][str(c)], out[key + "verify16_ms"][str(c)] = plain, verify
                out[key + "peak_gib"][str(c)] = peak
                print(f"{name} ctx {c}: plain {plain:.3f} ms (floor {out['floor_ms'][str(c)]:.3f}, HBM read floor "
                      f"{out['hbm_read_floor_ms'][str(c)]:.3f}), verify16 {verify:.3f} ms, peak {peak:.1f} GiB")
            del engine
            _free_engines()
        if "torch" in ops_by_name:
            out["triton_over_torch"] = {f: {c: out[f][c] / out["torch_" + f][c] for c in out[f]}
                                        for f in ("plain_ms", "verify16_ms")}
        save(out, out_path)  # each stage's results kept should a later one fail
        target.step_ops = TritonStepOps()  # the gate runs the shipped path: Triton ops, graphs on
        out["exactness"] = exactness_sweep(target, helpers, W)
        out["exact"] = out["exactness"]["exact"]
        save(out, out_path)
        tiles = list(STEP_FULL_TILES)
        if attn_sweep:
            out["attention_sweep"] = attention_sweep(contexts, helpers.graph_ms, torch.device("cuda"))
            print(json.dumps(out["attention_sweep"], indent=1))
            pick = out["full_tile_pick"] = pick_tile(out["attention_sweep"]["full"])
            if pick and pick not in tiles:
                tiles.insert(0, pick)
            save(out, out_path)
        out["causal_grid_steps"] = causal_grid_steps(target, contexts, helpers, W)
        save(out, out_path)
        out["full_tile_steps"] = full_tile_steps(target, contexts, helpers, W, tiles)
    save(out, out_path)
    return out


def save(out: dict, out_path) -> None:
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(out, indent=2) + "\n")
