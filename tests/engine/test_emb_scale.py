"""The `emb_scale` setting: whether a drafter's block embedding is the target's raw embedding rows
(the default, as the reference engine) or those rows times the target's `embed_scale` (Gemma's
√hidden; 1.0 for Qwen3 / LLaMA). Resolution and receipts, the multiplier rounded to the model
dtype, the effect on the block input of the eager and the graph-body proposal (against a
stand-in target whose embed_scale is not 1), exactness either way, and the CLI's flag, variable
and bench arm key."""

from __future__ import annotations

import json
import math

import pytest
import torch
from typer.testing import CliRunner

from memra_cli.engine.errors import SettingError
from memra_cli.cli.app import app
from memra_cli.engine.api import ArmConfig, Engine
from memra_cli.engine.greedy import greedy_reference
from memra_cli.engine.models.qwen3 import Qwen3Target
from memra_cli.engine.spec import proposer as proposer_mod
from memra_cli.engine.spec.policy import EMB_SCALE_ENV, resolve_block_embedding
from memra_cli.tiny.draft import make_tiny_draft
from memra_cli.tiny.target import make_tiny_qwen3

GEMMA_LIKE = math.sqrt(3072)  # a √hidden that bfloat16 cannot hold exactly (55.43 -> 55.5)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("embscale")
    return make_tiny_qwen3(root / "target", tokenizer=True), make_tiny_draft(root / "draft", "zlab", block_size=8)


def stand_in(target_dir, dtype=torch.float32, scale=GEMMA_LIKE) -> Qwen3Target:
    """The tiny Qwen3 target claiming a scaling family's embed_scale (its own math unchanged)."""
    target = Qwen3Target.from_dir(target_dir, dtype=dtype)
    target.embed_scale = scale
    return target


def test_resolution_and_receipts():
    raw = resolve_block_embedding(None, 8.0)
    assert (raw.scaled, raw.scale, raw.set) == (False, 1.0, False)
    assert raw.line("dflash") == (f"[dflash] block-embedding=raw (the target's embedding rows) "
                                  f"({EMB_SCALE_ENV} unset: the reference engine's default)")
    off = resolve_block_embedding(False, 8.0)
    assert (off.scaled, off.scale, off.set) == (False, 1.0, True)
    on = resolve_block_embedding(True, 8.0)
    assert (on.scaled, on.scale, on.set) == (True, 8.0, True)
    assert on.line("dspark") == f"[dspark] block-embedding=scaled x8 (the target's embed_scale) ({EMB_SCALE_ENV} set)"
    assert on.as_json() == {"scaled": True, "scale": 8.0, "set": True}
    # a drafter format that fixes the scaled embedding (Gemma4DSparkModel): the setting may only agree
    fixed = resolve_block_embedding(None, 8.0, "its own embedding is scaled")
    assert (fixed.scaled, fixed.scale, fixed.set) == (True, 8.0, False)
    assert fixed.as_json() == {"scaled": True, "scale": 8.0, "set": False, "recorded": "its own embedding is scaled"}
    assert fixed.line("dspark") == "[dspark] block-embedding=scaled x8 (the target's embed_scale; its own embedding is scaled)"
    assert resolve_block_embedding(True, 8.0, "why").scaled
    with pytest.raises(SettingError, match="block embedding is scaled \\(why\\)"):
        resolve_block_embedding(False, 8.0, "why")


@pytest.mark.parametrize("dtype,want", [(torch.float32, float(torch.tensor(GEMMA_LIKE))), (torch.bfloat16, 55.5)])
def test_an_arm_resolves_the_targets_scale_in_the_model_dtype(pair, dtype, want):
    engine = Engine.from_model(stand_in(pair[0], dtype))
    for setting, scale in ((None, 1.0), (False, 1.0), (True, want)):
        arm = engine.arm(ArmConfig(draft=pair[1], mode="dflash", emb_scale=setting))
        assert arm.program.emb_scale == scale
        assert arm.receipts.as_json()["block_embedding"] == {"scaled": bool(setting), "scale": scale,
                                                             "set": setting is not None}
        assert arm.receipts.lines()[-1].startswith("[dflash] block-embedding=" + ("scaled" if setting else "raw"))


def _captured_block_inputs(monkeypatch, target, engine_arm, prompt, max_new, engine):
    """Run a session and record every block input the drafter's eager round received."""
    seen = []
    drafter = engine_arm.drafter
    real = drafter.forward_round

    def spy(kv, noise, positions, *a, **kw):
        seen.append(noise.clone())
        return real(kv, noise, positions, *a, **kw)

    monkeypatch.setattr(drafter, "forward_round", spy)
    out = engine.session(prompt, max_new, engine_arm, eos_ids=()).run()
    monkeypatch.setattr(drafter, "forward_round", real)
    return out, seen


def test_the_eager_block_input_is_scaled_and_streams_stay_exact(pair, monkeypatch):
    target = stand_in(pair[0])
    engine = Engine.from_model(target)
    prompt = [5, 17, 42, 99, 3]
    plain = greedy_reference(target, prompt, 30)
    inputs = {}
    for setting in (None, True):
        arm = engine.arm(ArmConfig(draft=pair[1], mode="dflash", emb_scale=setting))
        out, inputs[setting] = _captured_block_inputs(monkeypatch, target, arm, prompt, 30, engine)
        assert out == plain  # the drafter only proposes: either embedding, the target's stream
    raw, scaled = inputs[None], inputs[True]
    assert len(raw) > 0
    ids = torch.full((8,), 511)  # the block: the anchor, then mask ids (z-lab: the tiny <|MASK|>)
    for noise in raw:
        ids[0] = int(torch.nonzero((target.embed_weight == noise[0]).all(-1))[0])  # the anchor's row
        assert torch.equal(noise, target.embed(ids))
    scale = float(torch.tensor(GEMMA_LIKE))
    assert torch.equal(scaled[0], raw[0] * scale)  # the first round's block is the same anchor and masks


def test_the_graph_body_scales_the_same_way(pair, monkeypatch):
    """`static_proposal` (the body a ProposeGraph captures) reads the program's scale too."""
    target = stand_in(pair[0])
    engine = Engine.from_model(target)
    arm = engine.arm(ArmConfig(draft=pair[1], mode="dflash", emb_scale=True))
    drafter, seen = arm.drafter, []
    monkeypatch.setattr(drafter, "static_round", lambda kv, noise, start, at=None, heads=None: seen.append(noise) or
                        torch.zeros(noise.shape[0], target.hidden_size))
    last, mask_ids = torch.tensor([7]), torch.full((8,), 511)
    proposer_mod.static_proposal(drafter, target, arm.program, None, last, mask_ids, torch.tensor(0), False)
    assert torch.equal(seen[0], target.embed(torch.cat([last, mask_ids[1:]])) * arm.program.emb_scale)
    assert arm.program.emb_scale != 1.0


# --------------------------------------------------------------------------- CLI

runner = CliRunner()


def test_the_flag_and_the_variable_name_the_resolution(pair):
    target, draft = pair
    args = ["generate", "--target", str(target), "--draft", str(draft), "--prompt-ids", "5,6,7", "--max-new", "6"]
    r = runner.invoke(app, args + ["--emb-scale", "--json"], env={})
    assert r.exit_code == 0, r.output
    obj = json.loads(r.stdout)
    assert obj["receipts"]["block_embedding"] == {"scaled": True, "scale": 1.0, "set": True}  # Qwen3: scale 1
    text = runner.invoke(app, args, env={EMB_SCALE_ENV: "1"})
    assert text.exit_code == 0, text.output
    assert f"[dflash] block-embedding=scaled x1 (the target's embed_scale) ({EMB_SCALE_ENV} set)" in text.stderr
    plain = runner.invoke(app, args + ["--no-emb-scale", "--json"], env={})
    assert json.loads(plain.stdout)["receipts"]["block_embedding"]["scaled"] is False
    assert json.loads(plain.stdout)["tokens"] == obj["tokens"]
    bad = runner.invoke(app, args, env={EMB_SCALE_ENV: "maybe"})
    assert bad.exit_code == 2 and EMB_SCALE_ENV in bad.stderr


def test_a_bench_arm_key(pair, tmp_path):
    target, draft = pair
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "def add(a, b):"}) + "\n")
    r = runner.invoke(app, ["bench", "--target", str(target), "--draft", str(draft), "--prompts", str(prompts),
                            "--max-new", "8", "--warmup", "0", "--arm", "dflash", "--arm", "dflash:emb_scale=1",
                            "--json"], env={})
    assert r.exit_code == 0, r.output
    arms = {a["name"]: a for a in json.loads(r.stdout)["arms"]}
    assert arms["dflash"]["receipts"]["block_embedding"]["scaled"] is False
    assert arms["dflash:emb_scale=1"]["receipts"]["block_embedding"] == {"scaled": True, "scale": 1.0, "set": True}
