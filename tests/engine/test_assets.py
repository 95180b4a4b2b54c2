"""The embedded default models: present, censused, loadable by transformers and by memra with
the same greedy stream, and the build recipe runs end to end at toy size on CPU."""

from __future__ import annotations

import ast
import re
from dataclasses import replace
import hashlib
import json

import pytest
import torch

from memra_cli.assets import default_pair
from memra_cli.assets.build import main as build_main
from memra_cli.engine.formats.census import take_census
from memra_cli.engine.greedy import greedy_reference
from memra_cli.engine.models.qwen3 import Qwen3Target
from memra_cli.engine.text import TextCodec


@pytest.fixture(scope="module")
def pair():
    return default_pair()


def test_assets_census_as_their_formats(pair):
    target, drafts = pair
    dflash, dspark = take_census(drafts["dflash"]), take_census(drafts["dspark"])
    assert dflash.config.exporter == "zlab-dflash" and dflash.kind == "dflash" and dflash.markov is None
    assert dspark.config.exporter == "deepspec" and dspark.kind == "dspark"
    assert dspark.markov is not None and dspark.confidence is not None and dspark.confidence.with_markov
    assert -1 in dspark.config.target_layer_ids and dspark.own_embed_tokens and dspark.own_lm_head
    total = sum(f.stat().st_size for d in (target, *drafts.values()) for f in d.iterdir())
    assert total <= 30 * 1024 * 1024
    info = json.loads((target.parent / "build_info.json").read_text())
    assert info["corpus"]["files_sha256"] and info["dspark"]["heldout_heads"]["p_prefix"]
    # the confidence head was calibrated and its reliability measured on held-out rounds
    rel = info["dspark"]["heldout_heads"]["reliability"]
    n = sum(row["n"] for row in rel)
    assert info["dspark"]["calibration"]["n"] > 0 and n > 0
    assert abs(sum(row["n"] * (row["predicted"] - row["observed"]) for row in rel) / n) < 0.1
    # drafters retrained over a seeded target (--stage seed) name the target they trained against:
    # it must be the one shipped beside them
    if "target_from" in info:
        shipped = hashlib.sha256((target / "model.safetensors").read_bytes()).hexdigest()
        assert info["target_from"]["model_sha256"] == shipped


def test_stdlib_prompt_set_comes_from_held_out_files(pair):
    """Every bundled stdlib prompt is a function head from a file the build held out of training."""
    from memra_cli.engine.prompts import load_prompts

    target, _ = pair
    info = json.loads((target.parent / "build_info.json").read_text())
    rows = [json.loads(line) for line in (target.parent.parent / "engine" / "data" / "stdlib.jsonl").read_text().splitlines()]
    assert len(rows) == info["stdlib_prompts"]["n"] == len(load_prompts("stdlib").texts) >= 100
    for r in rows:  # each a function whose body is its docstring: a signature and docstring to continue
        fn = ast.parse(r["turns"][0]).body[0]
        assert isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and ast.get_docstring(fn) and len(fn.body) == 1
    assert all(r["python"] == info["corpus"]["python"] and ".py:" in r["source"] for r in rows)


def test_shipped_target_matches_transformers_greedy(pair):
    from transformers import Qwen3ForCausalLM

    target_dir, _ = pair
    ours = Qwen3Target.from_dir(target_dir, dtype=torch.float32)
    hf = Qwen3ForCausalLM.from_pretrained(target_dir, dtype=torch.float32, attn_implementation="eager").eval()
    ids = TextCodec(target_dir).encode("def binary_search(items, target):\n")
    want = greedy_reference(ours, ids, 64)
    x = torch.tensor([ids])
    with torch.no_grad():
        got = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=64, do_sample=False,
                          eos_token_id=ours.cfg.vocab_size, pad_token_id=0)[0, len(ids):].tolist()
    assert got == want


def test_build_recipe_smoke_runs_on_cpu(tmp_path):
    assert build_main(["--smoke", "--out", str(tmp_path), "--device", "cpu"]) == 0
    for name in ("target", "dflash", "dspark"):
        assert (tmp_path / name / "config.json").is_file()
    assert take_census(tmp_path / "dspark").markov is not None
    info = json.loads((tmp_path / "build_info.json").read_text())
    assert info["target_steps_run"] == 1 and info["dflash"]["steps_run"] == 1
    assert (tmp_path / "stdlib.jsonl").is_file() and not (tmp_path / ".build-work").exists()
    from safetensors import safe_open

    from memra_cli.assets import ASSETS

    for kind in ("dflash", "dspark"):  # the shipped drafters' formats: config keys, tensor names
        built, ours = (json.loads((d / kind / "config.json").read_text()) for d in (ASSETS, tmp_path))
        assert ours.keys() == built.keys(), kind
        with safe_open(ASSETS / kind / "model.safetensors", "pt") as a, safe_open(tmp_path / kind / "model.safetensors", "pt") as b:
            names = [{re.sub(r"^layers\.\d+\.", "layers.N.", k) for k in f.keys()} for f in (a, b)]
            assert names[0] == names[1], kind  # the depth is the sweep's: compare one layer's names
            assert {a.get_tensor(k).dtype for k in a.keys()} == {b.get_tensor(k).dtype for k in b.keys()}, kind


@pytest.mark.exhaustive  # a whole drafter stage in subprocesses (quick-tier time); the build's CPU smoke stays quick
def test_drafters_retrain_over_a_shipped_target(tmp_path):
    """`--stage seed` reuses a built assets folder's target: the data and drafter stages over it
    assemble a pair whose target is byte for byte the old one, and the build record says so; an
    assets folder built with other target-stage recipe fields is refused by name."""
    old, work, new = tmp_path / "old", tmp_path / "work", tmp_path / "new"
    assert build_main(["--smoke", "--out", str(old), "--device", "cpu"]) == 0
    for stage in (["--stage", "seed", "--from", str(old)], ["--stage", "data"], ["--stage", "drafters", "--out", str(new)]):
        assert build_main(["--smoke", "--work", str(work), "--device", "cpu", *stage]) == 0
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (new / "target" / name).read_bytes() == (old / "target" / name).read_bytes()
    assert (new / "stdlib.jsonl").read_text() == (old / "stdlib.jsonl").read_text()
    info, before = (json.loads((d / "build_info.json").read_text()) for d in (new, old))
    assert info["target_from"]["built_with"]["hidden"] == before["recipe"]["hidden"]
    assert info["target_from"]["model_sha256"] == hashlib.sha256((old / "target" / "model.safetensors").read_bytes()).hexdigest()
    assert info["target_steps_run"] == before["target_steps_run"] and info["dspark"]["steps_run"] == 1
    assert take_census(new / "dspark").markov is not None

    before["recipe"]["hidden"] += 1  # as if built by another recipe
    (old / "build_info.json").write_text(json.dumps(before))
    with pytest.raises(SystemExit, match=r"build_info.json: recipe.hidden is 33, this recipe's is 32"):
        build_main(["--smoke", "--work", str(work), "--stage", "seed", "--from", str(old)])
    with pytest.raises(SystemExit, match="not a built assets folder"):
        build_main(["--smoke", "--work", str(tmp_path / "fresh"), "--stage", "seed", "--from", str(tmp_path)])
    with pytest.raises(SystemExit, match="--stage seed needs --work DIR"):
        build_main(["--smoke", "--out", str(tmp_path / "out"), "--stage", "seed", "--from", str(old)])
    assert not (tmp_path / "fresh").exists() and not (tmp_path / "out").exists()  # refused before anything is made


@pytest.mark.exhaustive  # a whole drafter stage in subprocesses (quick-tier time); the build's CPU smoke stays quick
def test_split_build_trains_each_drafter_in_its_own_process_with_its_budget(tmp_path):
    """The split build (benchmarks/gpu/build_assets.sh solo KIND, then assemble): each drafter
    stage in its own process over its own seeded work folder, `--draft-budget-s` recorded in its
    entry, `--draft-layers` overriding the depth sweep's pick, the two drafter folders gathered
    into one work folder and assembled. A budget that is not a positive number of seconds, or a
    depth below one layer, is refused in one line before anything is made."""
    import shutil

    old, new = tmp_path / "old", tmp_path / "new"
    assert build_main(["--smoke", "--out", str(old), "--device", "cpu"]) == 0
    for kind in ("dflash", "dspark"):
        work = tmp_path / f"work-{kind}"
        depth = ["--draft-layers", "2"] if kind == "dspark" else []  # the sweep's depth overridden
        for stage in (["--stage", "seed", "--from", str(old)], ["--stage", "data"],
                      ["--stage", "drafter", "--kind", kind, "--draft-budget-s", "30", *depth]):
            assert build_main(["--smoke", "--work", str(work), "--device", "cpu", *stage]) == 0
        # the stage trained through `memra train`'s job: its resumable state, of the exported geometry
        state = torch.load(work / "drafters" / f"{kind}.ckpt" / "state.pt", weights_only=False)
        cfg = json.loads((work / "drafters" / kind / "config.json").read_text())
        assert state["step"] == 1 and state["geometry"]["block"] == cfg["block_size"]
    shutil.copytree(tmp_path / "work-dspark" / "drafters" / "dspark", tmp_path / "work-dflash" / "drafters" / "dspark")
    shutil.copyfile(tmp_path / "work-dspark" / "drafters" / "dspark.json", tmp_path / "work-dflash" / "drafters" / "dspark.json")
    assert build_main(["--smoke", "--work", str(tmp_path / "work-dflash"), "--out", str(new), "--stage", "assemble"]) == 0
    info = json.loads((new / "build_info.json").read_text())
    assert info["dflash"]["budget_s"] == info["dspark"]["budget_s"] == 30.0
    assert info["dspark"]["layers"] == 2 and info["dspark"]["layers_from"] == "recipe"
    assert info["dflash"]["layers_from"] != "recipe"
    assert take_census(new / "dflash").markov is None and take_census(new / "dspark").markov is not None
    for bad in ("0", "-5"):
        with pytest.raises(SystemExit, match=rf"--draft-budget-s {bad}: expected seconds > 0"):
            build_main(["--smoke", "--work", str(tmp_path / "never"), "--stage", "drafter", "--kind", "dspark",
                        "--draft-budget-s", bad])
    with pytest.raises(SystemExit, match=r"--draft-layers 0: expected a layer count >= 1"):
        build_main(["--smoke", "--work", str(tmp_path / "never"), "--stage", "drafter", "--kind", "dspark",
                    "--draft-layers", "0"])
    assert not (tmp_path / "never").exists()


def test_each_kinds_depth_comes_from_the_recipe_or_the_sweep(tmp_path):
    """DFlash's depth is the recipe's (the sweep times DSpark), DSpark's the sweep's best row, and
    `--draft-layers` (the recipe's `draft_layers`) overrides both."""
    from dataclasses import replace

    from memra_cli.assets.build import Recipe, drafter_layers

    r = Recipe()
    assert r.dflash_layers == 3 and r.dspark_layers is None
    (tmp_path / "sweep.json").write_text(json.dumps({"best": {"block": 15, "layers": 2, "score": 5.0}}))
    assert drafter_layers(tmp_path, r, "dflash") == (3, "recipe")
    assert drafter_layers(tmp_path, r, "dspark") == (2, "sweep (block 15, score 5.0)")
    assert drafter_layers(tmp_path / "none", r, "dspark") == (1, "default (no sweep.json in the work folder)")
    both = replace(r, draft_layers=4)
    assert drafter_layers(tmp_path, both, "dflash") == drafter_layers(tmp_path, both, "dspark") == (4, "recipe")


def test_trainable_drafter_matches_the_engine_drafter(tmp_path):
    """The training twin and the engine compute the same function on exported weights, so the
    acceptance measured at build time is the acceptance the engine will see."""
    import types

    from memra_cli.assets.build import SMOKE, _geometry
    from memra_cli.train.export import write_drafter
    from memra_cli.assets.train import TrainDrafter
    from memra_cli.assets.train_draft import DraftSpec, block_batch
    from memra_cli.engine.models.drafter import Drafter

    torch.manual_seed(0)
    r = SMOKE
    drafter = TrainDrafter(r.hidden, 2, r.heads, r.kv_heads, r.ffn, 2, r.vocab, markov_rank=8, confidence=True).eval()
    for p in drafter.parameters():  # make norms non-trivial too
        p.data.normal_(0, 0.2).add_(1.0 if p.ndim == 1 else 0.0)
    tables = types.SimpleNamespace(embed_weight=torch.randn(r.vocab, r.hidden), head_weight=torch.randn(r.vocab, r.hidden))
    write_drafter(tmp_path / "d", drafter, _geometry("dspark", r, (-1, 2), layers=2), tables)
    engine = Drafter.load(tmp_path / "d", dtype=torch.float32)
    L, anchor = 20, 13
    ids = torch.randint(2, r.vocab, (1, L))
    spec = DraftSpec("dspark", r.dspark_block, (-1, 2), 1)
    noise_ids, blk_pos, _, _, mask = block_batch(ids, torch.tensor([[anchor]]), spec)
    embed = torch.randn(r.vocab, r.hidden)
    taps = torch.randn(1, L, 2 * r.hidden)
    noise = torch.nn.functional.embedding(noise_ids, embed)
    with torch.no_grad():
        want = drafter.to(torch.bfloat16).float()(taps, noise, torch.arange(L)[None], blk_pos, mask)[0]
    got = engine.forward_full(taps[0, :anchor], noise[0], torch.cat([torch.arange(anchor), blk_pos[0]])).hidden_out
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4), (got - want).abs().max()


@pytest.mark.exhaustive  # torch.compile on the CPU (quick-tier time)
def test_compiled_drafter_training_takes_the_eager_steps():
    """The build's drafter stage (`memra train`'s TrainJob over the data step's sequences, taps
    from the transformers target; the build compiles on CUDA) traces the drafter's forward and
    losses without changing them: three steps through torch.compile's `aot_eager` backend (the
    graph capture and autograd split the GPU build uses, without a C++ toolchain) take the eager
    run's losses and leave the same weights, to float32 reordering (1e-5 on losses of O(1),
    1e-4 relative on weights after three AdamW steps). The taps it trains on are the full
    model's hidden states (computed without the lm_head)."""
    from memra_cli.assets.build import SMOKE, _geometry
    from memra_cli.assets.train import make_target, target_taps
    from memra_cli.train.job import Hyper, TrainJob
    from memra_cli.train.online import FixedSequences
    from memra_cli.train.taps import HFTaps

    torch.manual_seed(0)
    target = make_target(64, 32, 3, 2, 1, 64, 128).eval()
    seqs = torch.randint(2, 64, (8, 40))
    with torch.no_grad():
        hs = target(input_ids=seqs[:2], output_hidden_states=True).hidden_states
        assert torch.equal(target_taps(target, seqs[:2], (-1, 1)), torch.cat([hs[0], hs[2]], -1))
    r = replace(SMOKE, vocab=64, hidden=32, heads=2, kv_heads=1, ffn=64, target_layers=3, markov_rank=8)
    geo = _geometry("dspark", r, (-1, 1), block=4, layers=1)
    runs = []
    for compile in (False, "aot_eager"):
        job = TrainJob(geo, Hyper(steps=3, batch=4, anchors=3, lr=1e-2), FixedSequences(seqs, torch.full((8,), 6)),
                       HFTaps(target), torch.device("cpu"), list(range(8)), compile=compile)
        losses = [float(job.one_step()) for _ in range(3)]
        runs.append((losses, {k: v.clone() for k, v in job.drafter.state_dict().items()}))
    (eager, w_eager), (compiled, w_compiled) = runs
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
    assert eager[-1] != eager[0]  # it trained
    for name, w in w_eager.items():
        torch.testing.assert_close(w_compiled[name], w, rtol=1e-4, atol=1e-5, msg=name)


def test_step_planner_uses_the_steady_step_time():
    """Warm-up steps must not shrink the plan: 40 steps in 4 s after a 10 s warm-up, with a
    100 s budget, leave room for ~(100 - 14) / 0.1 more steps (capped by the requested total)."""
    from memra_cli.assets.train import fit_steps

    t0, t_warm, now = 0.0, 10.0, 13.0  # steps 10..40 took 3 s: 0.1 s/step
    assert fit_steps(10_000, 40, t0, t_warm, now, 100.0) == 40 + int((100.0 - 13.0) / 0.1)
    assert fit_steps(500, 40, t0, t_warm, now, 100.0) == 500
    assert fit_steps(500, 40, t0, t_warm, now, None) == 500


def test_short_bench_on_the_embedded_pair_passes_its_exactness_gate(monkeypatch):
    """Three HumanEval prompts through `memra bench`'s defaults (the embedded pair). On the CPU
    the DSpark arms' markov chain loops in numpy (eager rounds): counted, so the gate below
    covers that loop too."""
    from typer.testing import CliRunner

    import memra_cli.engine.layers.torch_step_ops as torch_step_ops
    from memra_cli.cli.app import app

    host_chains = []
    real = torch_step_ops.markov_chain_host
    monkeypatch.setattr(torch_step_ops, "markov_chain_host", lambda *a: host_chains.append(1) or real(*a))

    r = CliRunner().invoke(app, ["bench", "--n", "3", "--max-new", "24", "--warmup", "0", "--arm", "off", "--arm", "dflash",
                                 "--arm", "dspark", "--arm", "dspark:harvest=dflash", "--json"], env={"OMP_NUM_THREADS": "1"})
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["exact"] and all(a["exact"] for a in out["arms"] if a["name"] != "plain")
    assert [a["name"] for a in out["arms"]] == ["off", "plain", "dflash", "dspark", "dspark:harvest=dflash"]
    assert all(a["tokens"] == 3 * 24 for a in out["arms"])
    assert out["arms"][3]["receipts"]["harvest"] == "dspark"
    assert len(host_chains) >= out["arms"][3]["rounds"]  # every eager DSpark round's chain


def test_generate_defaults_to_the_embedded_pair(pair):
    from typer.testing import CliRunner

    from memra_cli.cli.app import app

    runner = CliRunner()
    r = runner.invoke(app, ["generate", "--prompt", "def add(a, b):", "--max-new", "8"])
    assert r.exit_code == 0, r.output
    assert r.stderr.startswith("note: using the embedded default models") and "[dspark] harvest=dspark" in r.stderr
    r = runner.invoke(app, ["generate", "--spec", "dflash", "--prompt-ids", "5,6,7", "--max-new", "8", "--json"])
    out = json.loads(r.stdout)
    assert out["mode"] == "dflash" and out["receipts"]["harvest"] == "dflash" and len(out["tokens"]) == 8
    assert out["tokens"] == greedy_reference(Qwen3Target.from_dir(pair[0]), [5, 6, 7], 8, Qwen3Target.from_dir(pair[0]).cfg.eos_token_ids)


def test_greedy_forced_equals_generate_row_by_row():
    """Rows of different prompt lengths decoded in one batch (prompt tokens forced) are each what
    transformers' generate gives for that prompt alone."""
    from memra_cli.assets.train import greedy_forced, make_target

    torch.manual_seed(0)
    model = make_target(64, 32, 2, 2, 1, 64, 128).eval()
    prompts = [[5, 6, 7, 8, 9, 10, 11], [40, 41, 42], list(range(12, 30))]
    with torch.no_grad():
        seqs, plens = greedy_forced(model, prompts, 40, 8, torch.device("cpu"))
        for row, p in zip(seqs, prompts):
            x = torch.tensor([p])
            want = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=40 - len(p), do_sample=False,
                                  eos_token_id=64, pad_token_id=0)[0]
            assert torch.equal(row, want)
    assert plens.tolist() == [len(p) for p in prompts]


def test_function_heads_are_signature_and_docstring():
    from memra_cli.assets.train import function_heads, head_prompt

    text = 'import os\n\nclass A:\n    def m(self, x):\n        """Doc of m.\n\n        More."""\n        return x\n\n' \
           'def f():\n    "one line"\n    pass\n\ndef g():\n    return 1\n'
    heads = {h.qualname: head_prompt(text, h) for h in function_heads(text)}
    assert heads == {"A.m": 'def m(self, x):\n    """Doc of m.\n\n    More."""\n', "f": 'def f():\n    "one line"\n'}


def test_confidence_calibration_is_folded_into_the_head():
    """Platt scaling fits a, b on drafted rounds and folds them into the head's weights: the head's
    new raw scores are a * old + b on the same rounds, and the fitted loss is no worse."""
    from memra_cli.assets.train import TrainDrafter, make_target
    from memra_cli.train.losses import DraftSpec, _rounds, calibrate_confidence

    torch.manual_seed(0)
    target = make_target(64, 32, 3, 2, 1, 64, 128).eval()
    drafter = TrainDrafter(32, 1, 2, 1, 64, 2, 64, markov_rank=8, confidence=True).eval()
    spec = DraftSpec("dspark", 4, (-1, 1), 1)
    seqs = torch.randint(2, 64, (6, 40))
    kw = dict(anchors=4, prompt_len=torch.tensor([8, 9, 10, 8, 12, 8]), device=torch.device("cpu"), seed=5)
    before = torch.cat([raw.flatten() for _, raw in _rounds(drafter, target, seqs, spec, **kw)])
    fit = calibrate_confidence(drafter, target, seqs, spec, anchors=4, prompt_len=kw["prompt_len"], device=kw["device"])
    after = torch.cat([raw.flatten() for _, raw in _rounds(drafter, target, seqs, spec, **kw)])
    torch.testing.assert_close(after, fit["a"] * before + fit["b"], rtol=1e-3, atol=1e-3)
    assert fit["bce_after"] <= fit["bce_before"] and fit["n"] > 0


def test_walk_tau_counts_rounds_as_the_bench_does(monkeypatch):
    """`walk_tau` walks rounds from the last prompt token: a drafter right on every slot of the
    first 20 positions and wrong after them crosses the first stretch in 5 rounds of 4 tokens and
    the rest one token a round: 36 tokens / 21 rounds. The position-uniform `tau_full` of the same
    drafter would say 1 + (20 * 3) / 36 = 2.67."""
    import types

    from memra_cli.train import losses as train_draft
    from memra_cli.assets.train_draft import DraftSpec, block_batch, walk_tau

    L, V = 40, 50
    spec = DraftSpec("dflash", 4, (0,), 1)  # 3 drafts a block
    seqs = torch.randint(2, V, (2, L))

    def fake_logits(drafter, target, ids, anchors, spec, taps=None):
        _, _, labels, prev, _ = block_batch(ids, anchors, spec)
        right = (anchors < 20)[..., None].expand_as(labels)
        picks = torch.where(right, labels, (labels + 1) % V)
        return torch.nn.functional.one_hot(picks, V).float(), None, labels, prev

    monkeypatch.setattr(train_draft, "draft_logits", fake_logits)
    monkeypatch.setattr(train_draft, "target_taps", lambda target, ids, taps: None)
    out = walk_tau(types.SimpleNamespace(markov_head=None), None, seqs, spec, prompt_len=1, device=torch.device("cpu"))
    assert out["rounds"] == 2 * 21 and out["tau_walk"] == round(36 / 21, 3)
    # walked over the first 20 tokens past the prompt only (the bench's stretch): the last anchor
    # with a whole block there is 1 + 20 - 1 - 4 = 16, reached in the right stretch: 5 rounds of 4
    out = walk_tau(types.SimpleNamespace(markov_head=None), None, seqs, spec, prompt_len=1, device=torch.device("cpu"),
                   answer_len=20)
    assert out["rounds"] == 2 * 5 and out["tau_walk"] == 4.0


@pytest.mark.exhaustive
def test_a_drafter_trains_over_two_ranks_each_on_its_own_data_shards(tmp_path):
    """The four-GPU retrain (benchmarks/gpu/build_assets.sh retrain on four GPUs) at toy size on
    the CPU: a second data shard (another draw of prompts, the held-out splits only in data.pt),
    then the drafter stage under torch.distributed.run over two gloo ranks, each on its own shard,
    with a budget the ranks must agree to stop at; rank 0 alone writes the drafter and its entry."""
    import os
    import subprocess
    import sys

    old, work = tmp_path / "old", tmp_path / "work"
    assert build_main(["--smoke", "--out", str(old), "--device", "cpu"]) == 0
    for stage in (["--stage", "seed", "--from", str(old)], ["--stage", "data"], ["--stage", "data", "--shard", "1"]):
        assert build_main(["--smoke", "--work", str(work), "--device", "cpu", *stage]) == 0
    shard0, shard1 = (torch.load(work / name) for name in ("data.pt", "data.shard1.pt"))
    assert shard1.keys() == {"train"} and shard1["train"][0].shape == shard0["train"][0].shape
    assert not torch.equal(shard1["train"][0], shard0["train"][0])  # another draw, not a copy
    with pytest.raises(SystemExit, match="no data.shard2.pt"):
        build_main(["--smoke", "--work", str(work), "--device", "cpu", "--stage", "drafter", "--kind", "dspark",
                    "--shards", "3"])
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m",
                          "memra_cli.assets.build", "--smoke", "--work", str(work), "--device", "cpu", "--stage",
                          "drafter", "--kind", "dspark", "--shards", "2", "--draft-steps", "100000",
                          "--draft-budget-s", "2"], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    entry = json.loads((work / "drafters" / "dspark.json").read_text())
    assert entry["ranks"] == 2 and entry["data_shards"] == 2 and entry["budget_s"] == 2.0
    # both ranks stopped at one step (else the other would wait in its next all-reduce and time out):
    # the plan made at step 40, or the budget agreed at a tenth step on a slow machine
    assert 0 < entry["steps_run"] < 100000
    assert entry["sequences_trained"] == entry["steps_run"] * 2 * 2  # smoke batch 2, two ranks
    assert take_census(work / "drafters" / "dspark").markov is not None


def test_fixed_sequences_count_only_the_benchs_answer_length_past_each_prompt():
    """The build's rows are prompt_len + cont_len long whatever the prompt: a short function head
    runs on past the bench's 128 tokens. With `answer_len`, a row's length (where the job draws
    its blocks: anchors <= length - 1 - block) stops answer_len tokens past its own prompt."""
    from memra_cli.train.online import FixedSequences

    seqs = torch.arange(3 * 40).view(3, 40)
    ids, lengths, plens = FixedSequences(seqs, torch.tensor([4, 20, 35]), answer_len=10).batch([2, 0, 1], pad=0)
    assert torch.equal(ids, seqs[[2, 0, 1]]) and plens.tolist() == [35, 4, 20]
    assert lengths.tolist() == [40, 14, 30]  # cut at L where the prompt leaves fewer than answer_len
    assert FixedSequences(seqs, torch.tensor([4, 20, 35])).batch([0], pad=0)[1].tolist() == [40]
