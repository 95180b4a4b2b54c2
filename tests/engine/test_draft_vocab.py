"""Draft vocabularies (spec/draft_vocab.py): drafts restricted to a subset of the target's tokens.

The stream is plain greedy's whatever the subset (the target verifies every token); a subset
that is the whole vocabulary drafts exactly what no subset drafts; every draft lies in the
subset; the markov chain over a subset is the chain over the whole vocabulary with the other
tokens' scores at minus infinity; the file's refusals; the receipts; the CLI flag, the bench
arm key and `memra draft-vocab`."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from memra_cli.cli.app import app
from memra_cli.engine.api import ArmConfig, Engine
from memra_cli.engine.models.qwen3 import Qwen3Target
from memra_cli.engine.spec.draft_vocab import DraftVocabError, rank_tokens, read_vocab_ids
from memra_cli.engine.spec.keyed import SamplingParams, make_sampler
from memra_cli.engine.spec.proposer import SpecError, draft_heads
from memra_cli.tiny.draft import make_tiny_draft
from memra_cli.tiny.target import make_tiny_qwen3

VOCAB = 512


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("draftvocab")
    target = make_tiny_qwen3(root / "target", tokenizer=True)
    dflash = make_tiny_draft(root / "dflash", "zlab", block_size=8)
    dspark = make_tiny_draft(root / "dspark", "deepspec", block_size=8, markov_rank=16, confidence="markov")
    full = root / "full.json"
    full.write_text(json.dumps(list(range(VOCAB))))
    even = root / "even.json"
    even.write_text(json.dumps({"ids": list(range(0, VOCAB, 2)), "note": "provenance is ignored"}))
    return target, dflash, dspark, full, even


@pytest.fixture(scope="module")
def engine(pair):
    return Engine.from_model(Qwen3Target.from_dir(pair[0], dtype=torch.float32))


def _run(engine, arm, prompt, n=40):
    session = engine.session(prompt, n, arm)
    return session.run(), session.stats


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_the_stream_is_plain_greedy_with_any_subset(pair, engine, kind):
    draft = pair[1] if kind == "dflash" else pair[2]
    prompt = list(range(3, 40))
    plain = engine.session(prompt, 40).run()
    taus = {}
    for name, vocab in (("none", None), ("full", pair[3]), ("even", pair[4])):
        arm = engine.arm(ArmConfig(draft=draft, mode=kind, draft_vocab=vocab))
        tokens, stats = _run(engine, arm, prompt)
        assert tokens == plain, name
        taus[name] = stats.tau
    assert taus["full"] == taus["none"]  # the whole vocabulary as a subset drafts what no subset drafts


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_drafts_lie_in_the_subset_and_equal_a_masked_argmax(pair, engine, kind):
    """One block's drafts through `draft_heads`: with a subset, each draft is a subset token and is
    the pick over the whole vocabulary with every other token's score at minus infinity (the
    chain's too: its bias rows restricted to the subset's columns)."""
    draft = pair[1] if kind == "dflash" else pair[2]
    whole = engine.arm(ArmConfig(draft=draft, mode=kind))
    sub = engine.arm(ArmConfig(draft=draft, mode=kind, draft_vocab=pair[4]))
    d, p = sub.drafter, sub.program
    torch.manual_seed(0)
    hidden = torch.randn(p.block_size, d.cfg.hidden_size) * 3
    last = torch.tensor([7])
    got = draft_heads(d, engine.target, p, hidden, last, want_raws=False).drafts
    assert all(int(t) % 2 == 0 for t in got)
    rows = hidden[p.harvest.first_row: p.harvest.first_row + p.n_drafts]
    logits = engine.target.lm_head(rows).float()
    masked = torch.full_like(logits, float("-inf"))
    masked[:, 0::2] = logits[:, 0::2]
    if whole.program.markov:
        prev, want = last, []
        for k in range(masked.shape[0]):
            bias = torch.nn.functional.linear(d.markov_w1[prev].to(d.dtype), d._markov_w2_values()).float()
            prev = torch.argmax(masked[k: k + 1] + bias, dim=-1)
            want.append(prev)
        want = torch.cat(want)
    else:
        want = masked.argmax(-1)
    assert got.tolist() == want.tolist()
    # the whole vocabulary as a subset drafts, bit for bit, what no subset drafts
    full = engine.arm(ArmConfig(draft=draft, mode=kind, draft_vocab=pair[3]))
    assert draft_heads(full.drafter, engine.target, full.program, hidden, last, want_raws=False).drafts.tolist() == \
        draft_heads(d, engine.target, whole.program, hidden, last, want_raws=False).drafts.tolist()


def test_receipts_and_json_name_the_subset(pair, engine):
    arm = engine.arm(ArmConfig(draft=pair[2], mode="dspark", draft_vocab=pair[4]))
    line = arm.receipts.lines()[-1]
    assert line == (f"[dspark] draft-vocab=256/512 tokens (50.0%) from {pair[4]} "
                    "(drafts only from these; the target verifies every token)")
    assert arm.receipts.as_json()["draft_vocab"] == {"size": 256, "vocab_size": 512, "source": str(pair[4])}


def test_a_sampler_is_refused(pair, engine):
    arm = engine.arm(ArmConfig(draft=pair[1], mode="dflash", draft_vocab=pair[4]))
    with pytest.raises(SpecError, match="drafts greedily only"):
        engine.session([1, 2, 3], 8, arm, sampler=make_sampler(SamplingParams(temperature=0.8)))


@pytest.mark.parametrize("text, why", [
    ("[]", "is empty"),
    ("[1, 2, 2]", r"ids\[2\] = 2 appears twice"),
    ("[1, 512]", r"ids\[1\] = 512 is outside the target's vocabulary \[0, 512\)"),
    ("[1, -1]", r"ids\[1\] = -1 is outside"),
    ("[1, 2.5]", r"ids\[1\] = 2.5 is not an integer token id"),
    ("[true]", r"ids\[0\] = True is not an integer"),
    ('{"tokens": [1]}', 'an object with an "ids" list'),
    ("not json", "not a JSON draft vocabulary"),
])
def test_bad_files_are_refused_in_one_line(tmp_path, text, why):
    f = tmp_path / "v.json"
    f.write_text(text)
    with pytest.raises(DraftVocabError, match=why) as err:
        read_vocab_ids(f, VOCAB)
    assert str(f) in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(DraftVocabError, match="no such draft-vocabulary file"):
        read_vocab_ids(tmp_path / "missing.json", VOCAB)


def test_ranking_keeps_the_most_frequent_with_ties_to_the_smaller_id(tmp_path):
    ids, summary = rank_tokens([[5, 5, 5, 3, 3, 9], [9, 1]], 12, 3)
    assert ids == [3, 5, 9]  # 5 (3x), then 3 and 9 (2x each): ascending in the file
    assert summary == {"tokens_counted": 8, "distinct_seen": 4, "coverage": 7 / 8}
    assert rank_tokens([[7, 3, 7, 3, 11]], 12, 1)[0] == [3]  # 3 and 7 tie at two: the smaller id
    assert rank_tokens([[4, 2]], 12, 3)[0] == [0, 2, 4]  # a tie at count 0 goes to the smaller id too
    f = tmp_path / "v.json"
    f.write_text("[5, 1, 3]")
    assert read_vocab_ids(f, VOCAB) == [1, 3, 5]  # the file's order does not matter: ascending


def test_cli_generate_bench_and_the_writer(pair, tmp_path):
    runner = CliRunner()
    target, dflash = pair[0], pair[1]
    out = tmp_path / "v.json"
    r = runner.invoke(app, ["draft-vocab", str(out), "--target", str(target), "--prompts", "humaneval", "--n", "4",
                            "--top", "64"])
    assert r.exit_code == 0, r.output
    record = json.loads(out.read_text())
    assert len(record["ids"]) == 64 and record["ids"] == sorted(record["ids"]) and record["vocab_size"] == VOCAB
    assert record["prompts"] == [{"set": "humaneval", "source": record["prompts"][0]["source"], "n": 4}]
    again = runner.invoke(app, ["draft-vocab", str(out), "--target", str(target), "--prompts", "humaneval", "--top", "64"])
    assert again.exit_code == 2 and "exists (use --force to overwrite)" in again.output
    big = runner.invoke(app, ["draft-vocab", str(tmp_path / "w.json"), "--target", str(target), "--prompts", "humaneval",
                              "--top", "513"])
    assert big.exit_code == 2 and "--top 513: the target's vocabulary has 512 tokens" in big.output
    assert not (tmp_path / "w.json").exists()

    gen = runner.invoke(app, ["generate", "--target", str(target), "--draft", str(dflash), "--prompt-ids", "1,2,3,4",
                              "--max-new", "12", "--draft-vocab", str(out), "--json"])
    assert gen.exit_code == 0, gen.output
    rec = json.loads(gen.stdout)
    plain = json.loads(runner.invoke(app, ["generate", "--target", str(target), "--prompt-ids", "1,2,3,4",
                                           "--max-new", "12", "--json"]).stdout)
    assert rec["tokens"] == plain["tokens"]
    assert rec["receipts"]["draft_vocab"]["size"] == 64
    hot = runner.invoke(app, ["generate", "--target", str(target), "--draft", str(dflash), "--prompt-ids", "1,2",
                              "--draft-vocab", str(out), "--temperature", "0.5"])
    assert hot.exit_code == 2 and "drafts greedily only" in hot.output

    bench = runner.invoke(app, ["bench", "--target", str(target), "--draft", str(dflash), "--prompts", "humaneval",
                                "--n", "2", "--max-new", "8", "--warmup", "0", "--arm", "off", "--arm", "dflash",
                                "--arm", f"dflash:vocab={out}", "--json"])
    assert bench.exit_code == 0, bench.output
    report = json.loads(bench.stdout)
    assert report["exact"] is True
    assert [a["name"] for a in report["arms"]][-1] == f"dflash:vocab={out}"


@pytest.mark.exhaustive  # a benchmark script's CPU smoke: four CLI processes on the embedded pair
def test_the_embedded_vocab_benchmark_runs_the_users_commands(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "ev.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.embedded_vocab", "--json", str(out), "--n", "2",
                           "--max-new", "8", "--count-max-new", "4", "--warmup", "0", "--tops", "64"],
                          cwd=root, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    d = json.loads(out.read_text())
    assert d["exact"] is True and d["vocabs"]["64"]["top"] == 64
    names = list(d["summary"])
    assert names[:3] == ["off", "plain", "dspark"] and any(n.startswith("dflash:vocab=") for n in names)
