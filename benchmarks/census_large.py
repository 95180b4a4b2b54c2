"""Census time on a synthetic multi-GB sharded drafter checkpoint (not a test).

Writes a sharded safetensors checkpoint of a large DFlash drafter shape (default: the reference engine's 31B
drafter geometry — hidden 5376, 5 layers, ffn 10752, 6 taps — in bf16, ~3 GB) and times
`memra census` on it, in-process (take_census) and as a whole command. The shards' data sections
are written as sparse files: their size on disk is real, the bytes are zeros, and census never
reads them (that is the point being measured).

    python -m benchmarks.census_large [--dir /tmp/memra-big] [--hidden 5376] [--layers 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import struct
import subprocess
import sys
import time
from pathlib import Path


def tensor_shapes(hidden: int, layers: int, ff: int, heads: int, kv: int, hd: int, taps: int) -> dict[str, list[int]]:
    shapes = {"fc.weight": [hidden, taps * hidden], "hidden_norm.weight": [hidden], "norm.weight": [hidden]}
    for i in range(layers):
        p = f"layers.{i}."
        shapes.update({
            p + "self_attn.q_proj.weight": [heads * hd, hidden], p + "self_attn.k_proj.weight": [kv * hd, hidden],
            p + "self_attn.v_proj.weight": [kv * hd, hidden], p + "self_attn.o_proj.weight": [hidden, heads * hd],
            p + "self_attn.q_norm.weight": [hd], p + "self_attn.k_norm.weight": [hd],
            p + "input_layernorm.weight": [hidden], p + "post_attention_layernorm.weight": [hidden],
            p + "mlp.gate_proj.weight": [ff, hidden], p + "mlp.up_proj.weight": [ff, hidden],
            p + "mlp.down_proj.weight": [hidden, ff],
        })
    return shapes


def write_sparse_shard(path: Path, shapes: dict[str, list[int]]) -> int:
    header, offset = {}, 0
    for name, shape in shapes.items():
        n = 2
        for d in shape:
            n *= d
        header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    with path.open("wb") as fh:
        fh.write(struct.pack("<Q", len(blob)) + blob)
        fh.truncate(8 + len(blob) + offset)  # sparse data section
    return 8 + len(blob) + offset


def build(out: Path, a: argparse.Namespace) -> int:
    out.mkdir(parents=True, exist_ok=True)
    shapes = tensor_shapes(a.hidden, a.layers, a.ff, a.heads, a.kv, a.head_dim, a.taps)
    names = list(shapes)
    per = (len(names) + a.shards - 1) // a.shards
    weight_map, total = {}, 0
    for s in range(a.shards):
        part = {n: shapes[n] for n in names[s * per:(s + 1) * per]}
        fname = f"model-{s + 1:05d}-of-{a.shards:05d}.safetensors"
        total += write_sparse_shard(out / fname, part)
        weight_map.update({n: fname for n in part})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    taps = [round(1 + i * (a.target_layers - 4) / (a.taps - 1)) for i in range(a.taps)]
    cfg = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": a.hidden,
           "num_hidden_layers": a.layers, "num_attention_heads": a.heads, "num_key_value_heads": a.kv,
           "head_dim": a.head_dim, "intermediate_size": a.ff, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
           "vocab_size": 262144, "max_position_embeddings": 131072, "block_size": 16, "torch_dtype": "bfloat16",
           "num_target_layers": a.target_layers, "dflash_config": {"mask_token_id": 4, "target_layer_ids": taps}}
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return total


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", type=Path, default=Path("/tmp/memra-census-large"))
    p.add_argument("--hidden", type=int, default=5376)
    p.add_argument("--layers", type=int, default=5)
    p.add_argument("--ff", type=int, default=10752 * 2)
    p.add_argument("--heads", type=int, default=64)
    p.add_argument("--kv", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--taps", type=int, default=6)
    p.add_argument("--target-layers", type=int, default=62)
    p.add_argument("--shards", type=int, default=4)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    total = build(a.dir, a)
    from memra_cli.engine.formats.census import take_census

    take_census(a.dir)  # warm imports
    inproc = []
    for _ in range(a.repeat):
        t0 = time.perf_counter()
        c = take_census(a.dir)
        inproc.append(time.perf_counter() - t0)
    cmd = []
    for _ in range(a.repeat):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "memra_cli", "census", str(a.dir), "--json"], check=True, capture_output=True)
        cmd.append(time.perf_counter() - t0)
    result = {"checkpoint_bytes": total, "tensors": len(c.tensors), "shards": a.shards,
              "take_census_ms_median": 1e3 * sorted(inproc)[len(inproc) // 2],
              "command_s_median": sorted(cmd)[len(cmd) // 2]}
    print(json.dumps(result, indent=2) if a.json else
          f"{total / 1e9:.2f} GB, {len(c.tensors)} tensors in {a.shards} shards: take_census "
          f"{result['take_census_ms_median']:.2f} ms (median of {a.repeat}); whole `memra census --json` "
          f"{result['command_s_median']:.2f} s (interpreter start included; census never imports torch)")


if __name__ == "__main__":
    main()
