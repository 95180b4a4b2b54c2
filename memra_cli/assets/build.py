"""Build the embedded default models: `python -m memra_cli.assets.build [--out DIR] [--work DIR] [--stage S]`.

Reproducible recipe (the embedded-pair build); each stage fits one 10-minute call on one H200
(`--work` carries the state between):

1. corpus = the build machine's CPython stdlib `.py` files (Python version and a hash of the
   file list are recorded); every 20th file is held out;
2. a byte-level BPE tokenizer, vocabulary 4096, with `<|endoftext|>` (0) and `<|MASK|>` (1);
3. a Qwen3-architecture target (~5.8M parameters) trained with transformers' Qwen3ForCausalLM,
   then rounded to bf16: every later stage uses the weights as shipped;
4. drafter data = the shipped target's own greedy continuations, in the dtype the bench runs it
   in on that device (bf16 on CUDA, f32 on CPU), of two kinds of prompts, each from position 0:
   random corpus windows, and stand-alone function heads (`def` + docstring, the shape of a
   HumanEval prompt), both from training files the target never learned from; each continued
   for the bench's 128 tokens plus one block;
5. a DFlash drafter (z-lab format, mask-fill) and a DSpark drafter (DeepSpec format, shifted
   labels, vanilla markov head, confidence head) over 3 taps, each trained on the data of step
   4 by `memra train`'s own job (memra_cli/train/job.py: the same loss, schedule, optimiser,
   checkpoints and export); blocks fill one 16-row verify
   step, depth from the sweep (`--stage sweep`); the confidence head is then calibrated
   by Platt scaling on held-out drafted rounds and folded back into its weights;
6. held-out loss, per-slot acceptance, tau with rounds walked as the bench walks them, and the
   confidence head's reliability table go to
   build_info.json; the `stdlib` bench prompt set (held-out functions' heads) is written to
   memra_cli/engine/data/stdlib.jsonl;
7. the target and both drafters replace the old assets together.

Stages: `target` (1-4, state to `--work`), `seed` (a work folder whose target stage is an already
built assets folder's target, `--from DIR`, default the package's: the drafters are then retrained
for the target users already have, and the corpus must hash the same), `data` (4 again over a
finished or seeded target stage),
`sweep` (short DSpark runs over drafter depth on the `--work` data; records `sweep.json`, whose
best row sets the drafters' depth), `drafter --kind dflash|dspark` (5-6 for one drafter, into
`--work`; the two may run side by side), `assemble` (7: the finished pair into `--out`),
`drafters` (both drafters one after the other, then assemble), `all` (target, sweep, drafters).
Weights are saved in bf16. `--smoke` runs every stage at toy size (the CI test).
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from memra_cli.assets.train import (
    SPECIALS, collect_corpus, encode_corpus, greedy_forced, heldout_loss, make_target, stdlib_prompts,
    tokenized_heads, train_target, train_tokenizer, windows,
)
from memra_cli.train.export import write_drafter
from memra_cli.train.geometry import Geometry
from memra_cli.train.job import Hyper, TrainJob, spec_of
from memra_cli.train.online import FixedSequences
from memra_cli.train.ranks import Ranks
from memra_cli.train.taps import HFTaps
from memra_cli.assets.train_draft import calibrate_confidence, evaluate, param_count, walk_tau

ASSETS = Path(__file__).resolve().parent
DATA_SEED = 7  # the data step's draws (shard I of a sharded data step: DATA_SEED + I)
PROMPTS_OUT = ASSETS.parent / "engine" / "data" / "stdlib.jsonl"


@dataclass(frozen=True)
class Recipe:
    vocab: int = 4096
    hidden: int = 256
    target_layers: int = 6
    heads: int = 4
    kv_heads: int = 2
    ffn: int = 768
    max_pos: int = 4096
    target_steps: int = 6000
    val_every: int = 250  # early stopping on the drafter-prompt files (never trained on)
    drafter_files_every: int = 3  # every 3rd training file gives drafter prompts, not target text
    target_batch: int = 64
    seq_len: int = 512
    target_lr: float = 3e-3
    # random corpus windows (overlapping windows of the prompt files): enough that the compiled
    # training step sees each window only a few times in its budget (docs/tuning.md#drafter-data).
    n_prompts: int = 98304
    n_head_prompts: int = 8192  # stand-alone function heads (as many as there are)
    head_tokens: int = 192  # longest head used as a prompt
    prompt_len: int = 128
    # Continuations as long as the bench's (128 new tokens) plus a block: longer ones train on a
    # regime the bench never reaches and inflate the held-out tau (docs/tuning.md#drafter-data).
    # A head shorter than prompt_len is continued further (rows are prompt_len + cont_len long);
    # training draws its blocks only from its first cont_len tokens (FixedSequences answer_len).
    cont_len: int = 144
    # continuations generated per batch: one-token steps of a tiny model are launch-bound, so a
    # larger batch makes more sequences a second (docs/tuning.md#drafter-data)
    gen_batch: int = 16384
    draft_layers: int | None = None  # both kinds' depth (--draft-layers); None: each kind's below
    # DFlash's depth: the sweep times DSpark at 45 s, and at the full budget three DFlash layers beat
    # two in tau and speed (docs/bench.md#three-layers-the-12-06b-dflash-drafter)
    dflash_layers: int | None = 3
    dspark_layers: int | None = None  # None: the sweep's best (work/sweep.json), else 1
    dflash_block: int = 16  # 15 drafts: anchor + drafts fill one 16-row verify step
    dspark_block: int = 15  # 15 drafts, likewise
    dflash_taps: tuple[int, ...] = (1, 3, 4)
    dspark_taps: tuple[int, ...] = (-1, 2, 4)
    markov_rank: int = 64
    draft_steps: int = 60000
    draft_batch: int = 128
    anchors: int = 32
    draft_lr: float = 2e-3
    draft_checkpoint_every: int = 2000  # the drafter stage's resumable state (work/drafters/KIND.ckpt/)
    # the drafter's training step through torch.compile on CUDA (an eager step is mostly
    # elementwise kernels: benchmarks/gpu/train_probe.py); CPU builds (the smoke test) stay eager
    draft_compile: bool = True
    eval_prompts: int = 256  # of each held-out kind
    max_files: int | None = None
    heldout_every: int = 20
    stdlib_prompts: int = 164
    stdlib_prompt_tokens: int = 400
    sweep: tuple[tuple[int, int], ...] = ((15, 1), (15, 2), (15, 3))  # (block, layers), DSpark
    sweep_budget_s: float | None = 45.0
    # wall-clock caps: each stage fits one 10-minute call on the lent H200 (the two drafters train
    # side by side in one call: `--stage drafter --kind K` each, then `--stage assemble`)
    target_budget_s: float | None = 180.0
    # (training time still pays: docs/tuning.md#drafter-data; 440 s keeps seed + data + both
    # drafters side by side inside one 10-minute call)
    dflash_budget_s: float | None = 440.0
    dspark_budget_s: float | None = 440.0


# Recipe fields that decide the target stage (corpus split, tokenizer, target): a seeded work folder
# must have been built with the same, or the recorded recipe would not describe its target.
TARGET_FIELDS = ("vocab", "hidden", "target_layers", "heads", "kv_heads", "ffn", "max_pos", "target_steps", "val_every",
                 "drafter_files_every", "target_batch", "seq_len", "target_lr", "max_files", "heldout_every",
                 "target_budget_s")


SMOKE = Recipe(vocab=300, hidden=32, target_layers=4, heads=2, kv_heads=1, ffn=64, max_pos=512, target_steps=1,
               target_batch=2, seq_len=64, n_prompts=8, n_head_prompts=4, prompt_len=16, cont_len=240, gen_batch=8,
               draft_layers=None, dflash_layers=None, dflash_block=4, dspark_block=3, dflash_taps=(0, 2), dspark_taps=(-1, 2), markov_rank=8,
               draft_steps=1, draft_batch=2, anchors=4, eval_prompts=4, max_files=12, heldout_every=4,
               stdlib_prompts=8, head_tokens=200, val_every=1, drafter_files_every=3, sweep=((3, 1), (4, 1)), sweep_budget_s=None,
               target_budget_s=None, dflash_budget_s=None, dspark_budget_s=None)


def _log(msg: str) -> None:
    print(f"[build {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _geometry(kind: str, r: Recipe, taps: tuple[int, ...], block: int | None = None, *, layers: int) -> Geometry:
    """The drafter's geometry as `memra train` describes it (the export is shared: train/export.py);
    `layers` as `drafter_layers` (or a sweep row) resolved it."""
    dspark = kind == "dspark"
    return Geometry(kind, layers, block or (r.dflash_block if kind == "dflash" else r.dspark_block),
                    tuple(taps), SPECIALS.index("<|MASK|>"), r.markov_rank if dspark else 0, dspark, r.hidden, r.heads,
                    r.kv_heads, r.hidden // r.heads, r.ffn, r.vocab, r.target_layers, max_positions=r.max_pos)


def _save_target(out: Path, model, tok) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    model.float()
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
        "mask_token": "<|MASK|>", "model_max_length": 4096, "clean_up_tokenization_spaces": False,
    }, indent=2) + "\n")


def shipped(model, device: torch.device):
    """The target as the engine runs it on `device`: bf16-rounded weights, computed in bf16 on
    CUDA and in f32 on CPU (the bench's default dtypes)."""
    model = copy.deepcopy(model).to(torch.bfloat16)
    return (model if device.type == "cuda" else model.float()).to(device).eval().requires_grad_(False)


def _load_shipped_target(work: Path, device: torch.device):
    from memra_cli.hf_compat import protect_kernels_name
    protect_kernels_name()  # our kernels/ folder must not shadow HF kernels
    from transformers import Qwen3ForCausalLM

    model = Qwen3ForCausalLM.from_pretrained(work / "target", dtype=torch.bfloat16, attn_implementation="sdpa")
    return shipped(model, device)


def make_data(work: Path, r: Recipe, device: torch.device, corpus, tok, prompt_files, prompt_ids, held_ids, target) -> dict:
    """Stage 4: the drafters' data, `work/data.pt` = {split: (sequences `[n, L]` int16, prompt
    lengths `[n]`)} with L = prompt_len + cont_len, each row a prompt from position 0 and the
    shipped target's greedy continuation. Two kinds of prompt: corpus windows of prompt_len
    tokens, and stand-alone function heads (the bench's prompt shape, any length up to
    head_tokens). Also writes the stdlib bench prompt set."""
    gen = torch.Generator().manual_seed(DATA_SEED)
    t = time.time()
    total = r.prompt_len + r.cont_len
    heads = [ids for *_, ids in tokenized_heads(tok, prompt_files, r.head_tokens)]
    prompts = {
        "train": _train_prompts(heads, prompt_ids, r, gen),
        "held_windows": windows(held_ids, r.eval_prompts, r.prompt_len, gen).tolist(),
        "held_heads": [ids for *_, ids in tokenized_heads(tok, corpus.heldout, r.head_tokens)][: r.eval_prompts],
    }
    data = {}
    for name, rows in prompts.items():
        seqs, plens = greedy_forced(target, rows, total, r.gen_batch, device)
        data[name] = (seqs.to(torch.int16), plens.to(torch.int16))
    torch.save(data, work / "data.pt")
    rows = stdlib_prompts(corpus, tok, r.stdlib_prompts, r.stdlib_prompt_tokens)
    (work / "stdlib.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    shapes = {k: [int(v[0].shape[0]), total] for k, v in data.items()}
    _log(f"drafter data: {shapes} in {time.time() - t:.1f} s; stdlib prompt set: {len(rows)} held-out function heads")
    return {"datagen_s": round(time.time() - t, 1), "drafter_data": shapes,
            "drafter_heads_available": len(heads),
            "stdlib_prompts": {"n": len(rows), "from_files": len(corpus.heldout_names)}}


def _train_prompts(heads: list[list[int]], prompt_ids: torch.Tensor, r: Recipe, gen: torch.Generator) -> list[list[int]]:
    """The training prompts of one data draw: `n_prompts` random corpus windows and up to
    `n_head_prompts` function heads."""
    pick = torch.randperm(len(heads), generator=gen)[: r.n_head_prompts].tolist()
    return windows(prompt_ids, r.n_prompts, r.prompt_len, gen).tolist() + [heads[i] for i in pick]


def shard_path(work: Path, shard: int) -> Path:
    """Where the data step's training shard `shard` lives (shard 0: data.pt, with the held-out splits)."""
    return work / ("data.pt" if shard == 0 else f"data.shard{shard}.pt")


def make_shard(work: Path, r: Recipe, device: torch.device, shard: int) -> dict:
    """Stage `data --shard I` (I >= 1): another draw of training prompts (seeded DATA_SEED + I),
    continued by the shipped target as stage 4's are, into `work/data.shardI.pt` (training split
    only: the held-out splits are data.pt's). Shards generate on separate GPUs side by side, so
    a drafter trained over several GPUs sees as many fresh sequences per pass as it has ranks."""
    from tokenizers import Tokenizer

    t = time.time()
    tok = Tokenizer.from_file(str(work / "target" / "tokenizer.json"))
    _, tok, _, prompt_files, _, prompt_ids, _ = _corpus_and_split(r, tok)
    heads = [ids for *_, ids in tokenized_heads(tok, prompt_files, r.head_tokens)]
    rows = _train_prompts(heads, prompt_ids, r, torch.Generator().manual_seed(DATA_SEED + shard))
    seqs, plens = greedy_forced(_load_shipped_target(work, device), rows, r.prompt_len + r.cont_len, r.gen_batch, device)
    torch.save({"train": (seqs.to(torch.int16), plens.to(torch.int16))}, shard_path(work, shard))
    _log(f"drafter data shard {shard}: {list(seqs.shape)} in {time.time() - t:.1f} s")
    return {"shard": shard, "shape": list(seqs.shape), "s": round(time.time() - t, 1)}


def _corpus_and_split(r: Recipe, tok=None):
    corpus = collect_corpus(heldout_every=r.heldout_every, max_files=r.max_files)
    tok = tok or train_tokenizer(corpus.train, r.vocab)
    eos = tok.token_to_id("<|endoftext|>")
    # The training files split in two: the target learns from one part; the drafters' prompts come
    # from the other, so the target continues text it never saw, as it does on a bench prompt.
    every = r.drafter_files_every
    target_files = [t for i, t in enumerate(corpus.train) if i % every != every - 1]
    prompt_files = [t for i, t in enumerate(corpus.train) if i % every == every - 1]
    return corpus, tok, target_files, prompt_files, encode_corpus(tok, target_files, eos), \
        encode_corpus(tok, prompt_files, eos), encode_corpus(tok, corpus.heldout, eos)


def seed_from_assets(work: Path, src: Path, r: Recipe) -> dict:
    """Stage `seed`: `work` gets `src`'s target and a state.json made of `src/build_info.json`'s
    target-stage entries (corpus, tokens, target training), so `data` and the drafter stages run
    over the target already shipped. The depth sweep of that build comes along as
    `work/sweep.json` (it was measured on this target). Refuses an assets folder built with other
    target-stage recipe fields."""
    info_path = src / "build_info.json"
    if not info_path.is_file() or not (src / "target" / "model.safetensors").is_file():
        raise SystemExit(f"error: {src}: not a built assets folder (expected build_info.json and target/model.safetensors)")
    info = json.loads(info_path.read_text())
    built, ours = info.get("recipe", {}), asdict(r)
    for key in TARGET_FIELDS:
        if built.get(key) != ours[key]:
            raise SystemExit(f"error: {info_path}: recipe.{key} is {built.get(key)!r}, this recipe's is {ours[key]!r} "
                             f"(a seeded target must come from the same target-stage recipe)")
    work.mkdir(parents=True, exist_ok=True)  # only once the source is known good
    shutil.rmtree(work / "target", ignore_errors=True)
    shutil.copytree(src / "target", work / "target")
    for stale in ("data.pt", "drafters", "sweep.json", "stdlib.jsonl"):
        p = work / stale
        shutil.rmtree(p) if p.is_dir() else p.unlink(missing_ok=True)
    if "sweep" in info:
        (work / "sweep.json").write_text(json.dumps(info["sweep"], indent=2) + "\n")
    state = {k: v for k, v in info.items() if k not in ("dflash", "dspark", "sweep", "drafter_stage_s")}
    state["target_from"] = {"assets": src.name if src.resolve() != ASSETS else "memra_cli/assets",
                            "model_sha256": hashlib.sha256((src / "target" / "model.safetensors").read_bytes()).hexdigest(),
                            "built_with": {k: built[k] for k in TARGET_FIELDS}}
    (work / "state.json").write_text(json.dumps(state, indent=2) + "\n")
    _log(f"seeded {work} with the target of {src} (sha256 {state['target_from']['model_sha256'][:12]}…)")
    return state


def rebuild_data(work: Path, r: Recipe, device: torch.device) -> dict:
    """Stage 4 alone, over a finished target stage (same corpus and tokenizer)."""
    from tokenizers import Tokenizer

    info = json.loads((work / "state.json").read_text())
    tok = Tokenizer.from_file(str(work / "target" / "tokenizer.json"))
    corpus, tok, _, prompt_files, _, prompt_ids, held_ids = _corpus_and_split(r, tok)
    if corpus.files_sha256 != info["corpus"]["files_sha256"]:
        raise SystemExit(f"error: {work}: the target stage ran on another corpus (files_sha256 differs)")
    info.update(make_data(work, r, device, corpus, tok, prompt_files, prompt_ids, held_ids,
                          _load_shipped_target(work, device)))
    info["recipe"] = asdict(r)
    (work / "state.json").write_text(json.dumps(info, indent=2) + "\n")
    return info


def build_target(work: Path, r: Recipe, device: torch.device) -> dict:
    """Stages 1-4: corpus, tokenizer, target, drafter data. Leaves `work/target`, `work/data.pt`,
    `work/stdlib.jsonl` and `work/state.json`."""
    t0, info = time.time(), {"recipe": asdict(r), "device": str(device)}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    torch.manual_seed(0)
    corpus, tok, target_files, prompt_files, train_ids, prompt_ids, held_ids = _corpus_and_split(r)
    info["corpus"] = {"python": corpus.python_version, "files": corpus.n_files, "bytes": corpus.n_bytes,
                      "files_sha256": corpus.files_sha256, "heldout_files": len(corpus.heldout)}
    _log(f"corpus: Python {corpus.python_version} stdlib, {corpus.n_files} files, {corpus.n_bytes / 1e6:.1f} MB")
    info["tokens"] = {"target_train": int(train_ids.numel()), "drafter_prompts": int(prompt_ids.numel()),
                      "heldout": int(held_ids.numel()), "vocab": tok.get_vocab_size()}
    _log(f"tokenizer: vocab {tok.get_vocab_size()}, {train_ids.numel()} target tokens, {prompt_ids.numel()} prompt tokens")

    target = make_target(tok.get_vocab_size(), r.hidden, r.target_layers, r.heads, r.kv_heads, r.ffn, r.max_pos)
    info["target_params"] = param_count(target)
    t = time.time()
    losses, steps, curve = train_target(target, train_ids, r.target_steps, r.target_batch, r.seq_len, r.target_lr,
                                        device, _log, r.target_budget_s, val_stream=prompt_ids, val_every=r.val_every)
    info["target_train_s"], info["target_steps_run"], info["target_validation"] = round(time.time() - t, 1), steps, curve
    _save_target(work / "target", target, tok)
    target = shipped(target, device)
    info["target_loss"] = {"train_last": losses[-1], "heldout": heldout_loss(target, held_ids, r.seq_len, device)}
    _log(f"target: {info['target_params'] / 1e6:.2f}M params, held-out loss {info['target_loss']['heldout']:.3f} (as shipped)")

    info.update(make_data(work, r, device, corpus, tok, prompt_files, prompt_ids, held_ids, target))
    info["target_stage_s"] = round(time.time() - t0, 1)
    (work / "state.json").write_text(json.dumps(info, indent=2) + "\n")
    return info


def _load_work(work: Path, device: torch.device, shards: int = 1, ranks: Ranks = Ranks()):
    """(state, data, the shipped target). Of `shards` data files, rank r trains on shards r, r +
    world, ... (data["train"]); the held-out splits are data.pt's."""
    missing = [p.name for p in (work / "state.json", work / "data.pt", work / "target") if not p.exists()]
    missing += [shard_path(work, i).name for i in range(1, shards) if not shard_path(work, i).exists()]
    if missing:
        raise SystemExit(f"error: {work}: no {missing[0]} (run --stage target or data [--shard I] with this --work first)")
    if shards % ranks.world:
        raise SystemExit(f"error: --shards {shards}: expected a multiple of the {ranks.world} training ranks")
    info = json.loads((work / "state.json").read_text())
    data = {k: (v[0].long(), v[1].long()) for k, v in torch.load(work / "data.pt").items()}
    mine = range(ranks.rank, shards, ranks.world)
    load = lambda i: [t.long() for t in torch.load(shard_path(work, i))["train"]]  # noqa: E731
    data["train"] = _cat(*[data["train"] if i == 0 else load(i) for i in mine])
    return info, data, _load_shipped_target(work, device)


def _train(geo: Geometry, r: Recipe, split: tuple[torch.Tensor, torch.Tensor], target, device: torch.device,
           budget_s: float | None, ckpt: Path | None, ranks: Ranks = Ranks()) -> tuple[TrainJob, float]:
    """One drafter trained on the data step's sequences through `memra train`'s own job
    (train/job.py: the loss, the cosine schedule fitted to the budget, clipped AdamW, the
    checkpoints in `ckpt`), the taps from the shipped target in one batched forward.
    Returns the job (its drafter in eval mode) and the last step's loss."""
    job = TrainJob(geo, Hyper(steps=r.draft_steps, batch=r.draft_batch, anchors=r.anchors, lr=r.draft_lr, seed=0,
                              checkpoint_every=r.draft_checkpoint_every),
                   FixedSequences(*split, answer_len=r.cont_len), HFTaps(target), device, list(range(split[0].shape[0])),
                   compile=_compile(r, device), ranks=ranks)
    last = [float("nan")]

    def log(p) -> None:
        last[0] = p.loss
        if ranks.lead and (p.step % 100 == 1 or p.step == p.steps):
            _log(f"{geo.kind} drafter step {p.step}/{p.steps} loss {p.loss:.3f}")

    job.run(ckpt, budget_s=budget_s, on_step=log)
    job.drafter.eval()
    return job, last[0]


def _compile(r: Recipe, device: torch.device) -> bool:
    """Whether the drafter's training step goes through torch.compile: the recipe's
    `draft_compile`, on CUDA only (CPU builds, the smoke test among them, stay eager)."""
    return r.draft_compile and device.type == "cuda"


def _halves(split: tuple[torch.Tensor, torch.Tensor]):
    """A split (sequences, prompt lengths) cut in two halves of rows."""
    seqs, plens = split
    h = seqs.shape[0] // 2
    return (seqs[:h], plens[:h]), (seqs[h:], plens[h:])


def _cat(*splits):
    return torch.cat([s[0] for s in splits]), torch.cat([s[1] for s in splits])


def sweep(work: Path, r: Recipe, device: torch.device) -> list[dict]:
    """Short DSpark runs at each (block, layers) of `r.sweep` on the same data, each evaluated on
    the held-out stand-alone function heads' continuations. `score` = tau_walk / (1 + layers / target_layers)
    (tau as the bench counts it, `train_draft.walk_tau`, not tau_full, which overstates the bench
    where acceptance is uneven):
    tau over the cost of a round with the drafter's layers priced as target layers (same width,
    same rows), the quantity the choice maximises. Writes `work/sweep.json`."""
    info, data, target = _load_work(work, device)
    _, held = _halves(data["held_heads"])
    rows = []
    for block, layers in r.sweep:
        geo = _geometry("dspark", r, r.dspark_taps, block, layers=layers)
        spec = spec_of(geo)
        t = time.time()
        job, _ = _train(geo, r, data["train"], target, device, r.sweep_budget_s, None)
        drafter, steps = job.drafter, job.step
        m = evaluate(drafter, target, held[0], spec, anchors=r.anchors, prompt_len=held[1], device=device,
                     answer_len=r.cont_len)
        walk = walk_tau(drafter, target, held[0], spec, prompt_len=held[1], device=device, answer_len=r.cont_len)["tau_walk"]
        row = {"block": block, "layers": layers, "params": param_count(drafter), "steps": steps,
               "train_s": round(time.time() - t, 1), "tau_full": m["tau_full"], "tau_walk": walk,
               "p_prefix": m["p_prefix"][:8], "score": round(walk / (1 + layers / r.target_layers), 3)}
        rows.append(row)
        _log(f"sweep block {block} layers {layers}: tau_full {row['tau_full']} tau_walk {walk} score {row['score']} ({steps} steps)")
    best = max(rows, key=lambda x: x["score"])
    (work / "sweep.json").write_text(json.dumps({"budget_s": r.sweep_budget_s, "rows": rows, "best": best}, indent=2) + "\n")
    return rows


def drafter_layers(work: Path, r: Recipe, kind: str) -> tuple[int, str]:
    """(layers of the `kind` drafter, where the number came from): the recipe's when it sets one
    (`draft_layers` for both kinds, else `dflash_layers` / `dspark_layers`), else the
    best-scoring row of the sweep in `work/sweep.json`, else 1."""
    own = r.dflash_layers if kind == "dflash" else r.dspark_layers
    for layers in (r.draft_layers, own):
        if layers is not None:
            return layers, "recipe"
    if (work / "sweep.json").is_file():
        best = json.loads((work / "sweep.json").read_text())["best"]
        return int(best["layers"]), f"sweep (block {best['block']}, score {best['score']})"
    return 1, "default (no sweep.json in the work folder)"


def build_drafter(work: Path, kind: str, r: Recipe, device: torch.device, shards: int = 1,
                  ranks: Ranks = Ranks()) -> dict | None:
    """Stage 5-6 for one drafter: trained, (DSpark: confidence head calibrated), evaluated on the
    held-out continuations, saved to `work/drafters/KIND/` with its entry in `KIND.json`. The two
    kinds are independent, so they may run side by side (two processes on one GPU). In a
    data-parallel group (`ranks`, over `shards` data files) every rank trains and rank 0 alone
    evaluates and writes (the others return None)."""
    info, data, target = _load_work(work, device, shards, ranks)
    calib_w, eval_w = _halves(data["held_windows"])
    calib_h, eval_h = _halves(data["held_heads"])
    taps, block, budget = ((r.dflash_taps, r.dflash_block, r.dflash_budget_s) if kind == "dflash"
                           else (r.dspark_taps, r.dspark_block, r.dspark_budget_s))
    layers, layers_from = drafter_layers(work, r, kind)
    geo = _geometry(kind, r, taps, block, layers=layers)
    spec = spec_of(geo)
    t = time.time()
    job, loss_last = _train(geo, r, data["train"], target, device, budget, work / "drafters" / f"{kind}.ckpt", ranks)
    if not ranks.lead:
        return None
    drafter = job.drafter
    entry = {"params": param_count(drafter), "block": block, "layers": layers, "layers_from": layers_from,
             "budget_s": budget, "train_s": round(time.time() - t, 1), "steps_run": job.step, "loss_last": loss_last,
             "ranks": ranks.world, "data_shards": shards,
             "sequences_trained": job.step * r.draft_batch * ranks.world,
             "train_sequences": int(data["train"][0].shape[0]) * ranks.world}
    ev = dict(anchors=r.anchors, device=device, answer_len=r.cont_len)  # the bench's stretch, as in training
    if drafter.confidence_head is not None:
        entry["reliability_before"] = evaluate(drafter, target, eval_h[0], spec, prompt_len=eval_h[1], **ev).get("reliability")
        calib = _cat(calib_w, calib_h)
        entry["calibration"] = calibrate_confidence(drafter, target, calib[0], spec, prompt_len=calib[1], **ev)
    entry["heldout_windows"] = evaluate(drafter, target, eval_w[0], spec, prompt_len=eval_w[1], **ev)
    entry["heldout_heads"] = evaluate(drafter, target, eval_h[0], spec, prompt_len=eval_h[1], **ev)
    for name, split in (("heldout_windows", eval_w), ("heldout_heads", eval_h)):
        entry[name].update(walk_tau(drafter, target, split[0], spec, prompt_len=split[1], device=device,
                                    answer_len=r.cont_len))
    _log(f"{kind}: {layers} layer(s) ({layers_from}), tau_full windows {entry['heldout_windows']['tau_full']}, "
         f"heads {entry['heldout_heads']['tau_full']}; tau_walk windows {entry['heldout_windows']['tau_walk']}, "
         f"heads {entry['heldout_heads']['tau_walk']}")
    out = work / "drafters"
    out.mkdir(parents=True, exist_ok=True)
    write_drafter(out / kind, drafter, geo, HFTaps(target), num_anchors=r.anchors)
    (out / f"{kind}.json").write_text(json.dumps(entry, indent=2) + "\n")
    return entry


def assemble(work: Path, out: Path, r: Recipe) -> dict:
    """Stage 7: the target and both trained drafters from `work` into `out` with build_info.json
    and the stdlib prompt set; the old assets are replaced only once everything is there."""
    drafters = work / "drafters"
    missing = [k for k in ("dflash", "dspark") if not (drafters / f"{k}.json").is_file()]
    if missing:
        raise SystemExit(f"error: {work}: no trained {missing[0]} drafter (run --stage drafter --kind {missing[0]} first)")
    info = json.loads((work / "state.json").read_text())
    info["recipe"] = asdict(r)
    for kind in ("dflash", "dspark"):
        info[kind] = json.loads((drafters / f"{kind}.json").read_text())
    info["drafter_stage_s"] = round(sum(info[k]["train_s"] for k in ("dflash", "dspark")), 1)
    if (work / "sweep.json").is_file():
        info["sweep"] = json.loads((work / "sweep.json").read_text())
    staged = out / ".staging"
    shutil.rmtree(staged, ignore_errors=True)
    staged.mkdir(parents=True)
    for name in ("dflash", "dspark"):
        shutil.copytree(drafters / name, staged / name)
    shutil.copytree(work / "target", staged / "target")
    (staged / "build_info.json").write_text(json.dumps(info, indent=2) + "\n")
    prompts_out = PROMPTS_OUT if out.resolve() == ASSETS else out / "stdlib.jsonl"
    for name in ("target", "dflash", "dspark"):  # replace the old assets only once all are built
        shutil.rmtree(out / name, ignore_errors=True)
        (staged / name).rename(out / name)
    (staged / "build_info.json").replace(out / "build_info.json")
    shutil.copyfile(work / "stdlib.jsonl", prompts_out)
    staged.rmdir()
    return info


def build_drafters(work: Path, out: Path, r: Recipe, device: torch.device) -> dict:
    """Stages 5-7 in one process: both drafters one after the other, then `assemble`."""
    for kind in ("dflash", "dspark"):
        build_drafter(work, kind, r, device)
    return assemble(work, out, r)


def _process_group(device: torch.device) -> tuple[torch.device, Ranks]:
    """Under torch.distributed.run (WORLD_SIZE > 1): join the group (NCCL on CUDA, each rank on
    its LOCAL_RANK's GPU; gloo on the CPU, the smoke test) and return this rank's device."""
    import os

    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return device, Ranks()
    import torch.distributed as dist

    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return device, Ranks.current()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m memra_cli.assets.build", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=ASSETS, help="output folder (default: the package's assets)")
    p.add_argument("--work", type=Path, help="state between stages (default: OUT/.build-work, removed after 'all')")
    p.add_argument("--stage", choices=("all", "target", "seed", "data", "sweep", "drafters", "drafter", "assemble"),
                   default="all")
    p.add_argument("--from", dest="src", type=Path, default=ASSETS,
                   help="--stage seed: the built assets folder whose target to reuse (default: the package's)")
    p.add_argument("--kind", choices=("dflash", "dspark"), help="which drafter --stage drafter trains")
    p.add_argument("--smoke", action="store_true", help="toy sizes, one step per stage (CI)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--target-steps", type=int)
    p.add_argument("--draft-steps", type=int)
    p.add_argument("--draft-budget-s", type=float,
                   help="seconds of training per drafter (the drafter stages; default: the recipe's). A drafter "
                        "trained alone on the GPU (one per device call) makes more steps a second than two side by "
                        "side (docs/bench.md, 'The embedded models'), so a split build trains each alone "
                        "(benchmarks/gpu/build_assets.sh solo)")
    p.add_argument("--draft-layers", type=int,
                   help="--stage drafter: the drafter's layers (default: the recipe's, 3 for DFlash, and the depth "
                        "sweep's best for DSpark, work/sweep.json); recorded as layers_from 'recipe' in build_info.json")
    p.add_argument("--markov-rank", type=int,
                   help="--stage drafter / sweep: the DSpark markov head's rank (default: the recipe's 64; the "
                        "engine walks the chain over a full bias table, so the rank costs nothing when drafting; "
                        "256 did not raise tau here: docs/bench.md, 'Two DSpark retrains that did not ship')")
    p.add_argument("--shard", type=int, default=0,
                   help="--stage data: write training shard I (>= 1) beside data.pt: another draw of prompts, "
                        "continued the same way (shards generate on separate GPUs side by side)")
    p.add_argument("--shards", type=int, default=1,
                   help="--stage drafter: train over data.pt and data.shard1..N-1.pt; under torch.distributed.run "
                        "each rank takes its own shards and the ranks average gradients (docs/train.md)")
    a = p.parse_args(argv)
    if a.draft_budget_s is not None and not a.draft_budget_s > 0:  # refused before anything is made
        raise SystemExit(f"error: --draft-budget-s {a.draft_budget_s:g}: expected seconds > 0")
    if a.draft_layers is not None and a.draft_layers < 1:
        raise SystemExit(f"error: --draft-layers {a.draft_layers}: expected a layer count >= 1")
    if a.markov_rank is not None and a.markov_rank < 1:
        raise SystemExit(f"error: --markov-rank {a.markov_rank}: expected a rank >= 1")
    if a.shard < 0 or a.shards < 1:
        raise SystemExit(f"error: --shard {a.shard} / --shards {a.shards}: expected a shard >= 0 and shards >= 1")
    recipe = SMOKE if a.smoke else Recipe()
    if a.target_steps is not None:
        recipe = replace(recipe, target_steps=a.target_steps)
    if a.draft_steps is not None:
        recipe = replace(recipe, draft_steps=a.draft_steps)
    if a.draft_budget_s is not None:
        recipe = replace(recipe, dflash_budget_s=a.draft_budget_s, dspark_budget_s=a.draft_budget_s)
    if a.draft_layers is not None:
        recipe = replace(recipe, draft_layers=a.draft_layers)
    if a.markov_rank is not None:
        recipe = replace(recipe, markov_rank=a.markov_rank)
    if a.stage == "seed" and a.work is None:  # refused before anything is made
        raise SystemExit("error: --stage seed needs --work DIR (the folder the later stages read)")
    device, ranks = _process_group(torch.device(a.device))
    work = a.work or a.out / ".build-work"
    if a.stage != "seed":
        work.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    if a.stage in ("all", "target"):
        build_target(work, recipe, device)
    if a.stage == "seed":
        seed_from_assets(work, a.src, recipe)
    if a.stage == "data":
        make_shard(work, recipe, device, a.shard) if a.shard else rebuild_data(work, recipe, device)
    if a.stage in ("all", "sweep"):
        sweep(work, recipe, device)
    if a.stage == "drafter":
        if a.kind is None:
            raise SystemExit("error: --stage drafter needs --kind dflash|dspark")
        build_drafter(work, a.kind, recipe, device, a.shards, ranks)
    if a.stage == "assemble":
        assemble(work, a.out, recipe)
    if a.stage in ("all", "drafters"):
        build_drafters(work, a.out, recipe, device)
    if a.stage == "all" and a.work is None:
        shutil.rmtree(work)
    if ranks.world > 1:  # torn down together: a rank leaving while the lead still evaluates can abort in gloo's threads
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    if not ranks.lead:
        return 0
    _log(f"stage {a.stage} done in {time.time() - t0:.1f} s -> {a.out if a.stage in ('all', 'drafters', 'assemble') else work}")
    return 0


if __name__ == "__main__":
    code = main()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # A rank leaves without C++ static destructors: even after destroy_process_group a gloo thread
        # can still be joinable at interpreter teardown and abort it (pytorch/pytorch#179291); its
        # outputs are written and the group is gone.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    raise SystemExit(code)
