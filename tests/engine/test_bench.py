"""bench.runner + engine.prompts: arm grammar, drafter sources, prompt sets, loading once,
interleaving, the exactness gate and the aggregates."""

from __future__ import annotations

import contextlib

import gzip
import json
import sys
import types
from pathlib import Path

import pytest
import torch

from memra_cli.bench import runner as eb
from memra_cli.engine import prompts as pr
from memra_cli.engine.api import Engine
from memra_cli.bench.runner import ArmSpec, BenchError, Drafters, parse_arm, parse_arms
from memra_cli.engine.errors import PromptError
from memra_cli.engine.prompts import load_prompts
from memra_cli.engine.greedy import greedy_reference
from memra_cli.engine.models.qwen3 import Qwen3Target
from memra_cli.tiny.draft import make_tiny_draft
from memra_cli.tiny.target import make_tiny_qwen3


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench-pair")
    target = make_tiny_qwen3(root / "target", tokenizer=True)
    dflash = make_tiny_draft(root / "dflash", "zlab")
    dspark = make_tiny_draft(root / "dspark", "deepspec", markov_rank=16, confidence="markov", target_layer_ids=(-1, 1, 3))
    return target, {"dflash": dflash, "dspark": dspark}


# --------------------------------------------------------------------------- arm grammar


@pytest.mark.parametrize("text, want", [
    ("off", ArmSpec("off", "off")),
    ("dflash", ArmSpec("dflash", "dflash")),
    ("dspark:vt=ladder", ArmSpec("dspark:vt=ladder", "dspark", vt="ladder")),
    ("dspark:vt=confidence,tau=0.3", ArmSpec("dspark:vt=confidence,tau=0.3", "dspark", vt="confidence", tau="0.3")),
    ("dspark:harvest=dflash", ArmSpec("dspark:harvest=dflash", "dspark", harvest="dflash")),
    ("dspark:prec=q8,cap=5,adapt=0,markov=1", ArmSpec("dspark:prec=q8,cap=5,adapt=0,markov=1", "dspark", prec="q8", cap=5, adapt=False, markov=True)),
    ("auto:draft=/x/y", ArmSpec("auto:draft=/x/y", "auto", draft="/x/y")),
    (" dflash:draft=dspark ", ArmSpec("dflash:draft=dspark", "dflash", draft="dspark")),
])
def test_parse_arm(text, want):
    assert parse_arm(text) == want


BAD_ARMS = {
    "fast": "unknown arm 'fast'",
    "dspark:": "no key=value",
    "dspark:vt": "'vt' is not key=value",
    "dspark:speed=2": "unknown key 'speed'",
    "dspark:vt=wide": "vt=wide (expected ladder|confidence|confidence-slot|priced)",
    "dspark:tau=abc": "tau=abc is not a number",
    "dspark:tau=1.5": "tau=1.5 is outside (0,1)",
    "dspark:cap=x": "cap=x is not an integer",
    "dspark:cap=1": "cap=1: a verify cap is at least 2",
    "dspark:adapt=yes": "adapt=yes (expected 0|1)",
    "dspark:prec=q3": "prec=q3 (expected f32|bf16|q8|mixed|fc|q4)",
    "dspark:harvest=mine": "harvest=mine (expected dflash|dspark)",
    "dspark:vt=ladder,vt=confidence": "key 'vt' given twice",
    "dspark:draft=": "draft= has no value",
    "off:vt=ladder": "the off arm (plain greedy) takes no keys",
    "plain:cap=4": "the plain arm (the fastest plain decoding on the device) takes no keys",
}


@pytest.mark.parametrize("text", list(BAD_ARMS))
def test_parse_arm_refuses_naming_arm_and_value(text):
    with pytest.raises(BenchError) as e:
        parse_arm(text)
    msg = str(e.value)
    assert msg.startswith(f"--arm {text.strip()!r}: ") and BAD_ARMS[text] in msg and "\n" not in msg


def test_parse_arms_defaults_off_first_plain_after_it_and_duplicates():
    assert [a.name for a in parse_arms([])] == ["off", "plain", "dflash", "dspark"]
    assert [a.name for a in parse_arms(["dspark", "dspark:vt=ladder"])] == ["off", "plain", "dspark", "dspark:vt=ladder"]
    assert [a.name for a in parse_arms(["dspark", "off"])] == ["dspark", "off", "plain"]
    assert [a.name for a in parse_arms(["plain", "dspark"])] == ["off", "plain", "dspark"]
    assert [a.name for a in parse_arms(["dspark", "plain", "off"])] == ["dspark", "plain", "off"]  # as given
    assert parse_arm("plain") == ArmSpec("plain", "plain")
    with pytest.raises(BenchError, match="'dspark' given twice"):
        parse_arms(["dspark", " dspark"])
    with pytest.raises(BenchError, match="'plain' given twice"):
        parse_arms(["plain", "plain"])


# --------------------------------------------------------------------------- drafter sources


def test_drafters_for_arm(tmp_path):
    emb = {"dflash": tmp_path / "a", "dspark": tmp_path / "b"}
    d = Drafters(None, emb)
    assert d.for_arm(parse_arm("off")) is None
    assert d.for_arm(parse_arm("dflash")) == emb["dflash"]
    assert d.for_arm(parse_arm("dspark")) == emb["dspark"]
    assert d.for_arm(parse_arm("auto")) == emb["dspark"]
    assert d.for_arm(parse_arm("dspark:draft=dflash")) == emb["dflash"]
    assert d.for_arm(parse_arm("dspark:draft=/p")) == Path("/p")
    given = Drafters(tmp_path / "mine", emb)
    assert given.for_arm(parse_arm("dflash")) == tmp_path / "mine"
    assert given.for_arm(parse_arm("dflash:draft=dspark")) == emb["dspark"]
    with pytest.raises(BenchError, match="needs a drafter: pass --draft PATH"):
        Drafters().for_arm(parse_arm("dflash"))
    with pytest.raises(BenchError, match="draft=dspark names an embedded drafter"):
        Drafters(tmp_path / "mine").for_arm(parse_arm("dflash:draft=dspark"))


def _fake_assets(monkeypatch, target, drafters):
    mod = types.ModuleType("memra_cli.assets")
    mod.default_pair = lambda: (target, dict(drafters))
    monkeypatch.setitem(sys.modules, "memra_cli.assets", mod)


def test_resolve_inputs_hooks_default_pair(monkeypatch, pair, tmp_path):
    target, drafters = pair
    monkeypatch.setitem(sys.modules, "memra_cli.assets", None)  # a build without the embedded pair
    with pytest.raises(BenchError, match="no embedded default model pair in this build: pass --target DIR and --draft PATH"):
        eb.resolve_inputs(None, None)
    assert eb.resolve_inputs(target, None) == (target, Drafters(None), False)
    _fake_assets(monkeypatch, target, drafters)
    t, d, embedded = eb.resolve_inputs(None, None)
    assert (t, d.embedded, embedded) == (target, drafters, True)
    _, d, embedded = eb.resolve_inputs(target, tmp_path / "x")  # both given: nothing embedded
    assert (d.path, d.embedded, embedded) == (tmp_path / "x", {}, False)
    _, d, embedded = eb.resolve_inputs(tmp_path, None)  # another target: embedded drafters do not apply
    assert (d.embedded, embedded) == ({}, False)


# --------------------------------------------------------------------------- prompt sets


def test_humaneval_from_the_package():
    p = load_prompts("humaneval")
    assert len(p.texts) == 164 and p.name == "humaneval"
    assert p.texts[0].startswith("from typing import List\n\n\ndef has_close_elements(")
    assert len(load_prompts("humaneval", 3).texts) == 3


def test_mbpp_bundled():
    p = load_prompts("mbpp")
    assert len(p.texts) == 257
    assert p.texts[0] == "Write a python function to remove first and last occurrence of a given character from the string."
    assert len(load_prompts("mbpp", 1000).texts) == 257  # --n past the set: all of it


STDLIB_ROWS = [
    {"turns": ['def quote(s):\n    """Return a shell-escaped version of the string *s*."""\n'], "source": "shlex.py:quote", "python": "3.12.3"},
    {"turns": ['def dedent(text):\n    """Remove any common leading whitespace from every line in `text`."""\n'],
     "source": "textwrap.py:dedent", "python": "3.12.3"},
]


def test_stdlib_set_reads_the_bundled_file(monkeypatch, tmp_path):
    f = tmp_path / "stdlib.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in STDLIB_ROWS))
    monkeypatch.setattr(pr, "STDLIB_JSONL", f)
    p = load_prompts("stdlib")
    assert p.name == "stdlib" and p.texts == tuple(r["turns"][0] for r in STDLIB_ROWS)
    assert p.source.startswith("held-out CPython 3.12.3 standard-library functions: signature + docstring")
    assert "\n" not in p.source and "stdlib" in pr.BUILTIN_SETS
    assert load_prompts("stdlib", 1).texts == (STDLIB_ROWS[0]["turns"][0],)


def test_stdlib_set_absent_is_one_line(monkeypatch, tmp_path):
    monkeypatch.setattr(pr, "STDLIB_JSONL", tmp_path / "stdlib.jsonl")
    with pytest.raises(PromptError) as e:
        load_prompts("stdlib")
    msg = str(e.value)
    assert msg.startswith(f"--prompts stdlib: {tmp_path / 'stdlib.jsonl'} is missing") and "\n" not in msg
    assert "python -m memra_cli.assets.build" in msg


@pytest.mark.skipif(not pr.STDLIB_JSONL.is_file(), reason="this build has no stdlib.jsonl (the embedded models' build writes it)")
def test_the_bundled_stdlib_file_has_the_documented_rows():
    for i, line in enumerate(pr.STDLIB_JSONL.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            row = json.loads(line)
            assert isinstance(row["turns"][0], str) and row["turns"][0].strip(), i
            path, _, func = row["source"].rpartition(":")
            assert path.endswith(".py") and func and isinstance(row["python"], str), (i, row["source"])
    assert load_prompts("stdlib").source.startswith("held-out CPython")


def test_jsonl_files(tmp_path):
    rows = [{"turns": ["first", "second"]}, {"prompt": "raw"}, {"turns": ["x"], "id": 3}]
    f = tmp_path / "p.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    assert load_prompts(str(f)).texts == ("first", "raw", "x")
    g = tmp_path / "p.jsonl.gz"
    g.write_bytes(gzip.compress(f.read_bytes()))
    assert load_prompts(str(g), 2).texts == ("first", "raw")


@pytest.mark.parametrize("content, message", [
    ('{"turns": ["a"]}\nnot json\n', ":2: not a JSON object"),
    ('{"turns": []}\n', ':1: expected {"turns": [text, ...]} or {"prompt": text}'),
    ('["a"]\n', ":1: expected"),
    ("\n\n", "no prompts"),
])
def test_bad_prompt_files(tmp_path, content, message):
    f = tmp_path / "bad.jsonl"
    f.write_text(content)
    with pytest.raises(PromptError) as e:
        load_prompts(str(f))
    assert message in str(e.value) and "\n" not in str(e.value)


def test_missing_prompt_file_and_bad_n(tmp_path):
    with pytest.raises(PromptError, match=r"not humaneval\|mbpp\|stdlib and no such file"):
        load_prompts(str(tmp_path / "nope.jsonl"))
    with pytest.raises(PromptError, match="--n 0"):
        load_prompts("mbpp", 0)


# --------------------------------------------------------------------------- loading and running


@pytest.fixture(scope="module")
def model(pair):
    return Qwen3Target.from_dir(pair[0])


@pytest.fixture(scope="module")
def engine(model):
    return Engine.from_model(model)  # variable-width steps, no graphs


def test_each_drafter_loads_once_and_arm_refusals_name_the_arm(monkeypatch, engine, pair):
    _, drafters = pair
    from memra_cli.engine.models.drafter import Drafter

    calls = []
    real = Drafter.load.__func__
    monkeypatch.setattr(Drafter, "load", classmethod(lambda cls, path, *a, **k: calls.append((path, k.get("weight_fn"))) or real(cls, path, *a, **k)))
    specs = parse_arms(["dflash", "dspark", "dspark:vt=ladder", "dspark:harvest=dflash", "auto"])
    arms = eb.load_arms(engine, specs, Drafters(None, drafters))
    assert [p for p, _ in calls] == [drafters["dflash"], drafters["dspark"]]
    assert arms[3].loaded.drafter is arms[4].loaded.drafter is arms[6].loaded.drafter
    assert arms[3].loaded.program != arms[4].loaded.program  # each arm its own program ...
    with arms[3].session(PROMPTS[0], 4) as a, arms[4].session(PROMPTS[0], 4) as b:
        a.prime()
        b.prime()
        assert a.proposer is not b.proposer and a.proposer.kv is not b.proposer.kv  # ... and cache
    assert str(arms[4].loaded.program.window) == "Ladder" and arms[5].loaded.program.harvest.value == "dflash"
    assert arms[0].loaded.mode == "off" and arms[6].loaded.mode == "dspark" and arms[6].mode == "dspark"
    assert arms[1].mode == "plain" and arms[1].loaded.mode == "off" and arms[1].drafter is None

    for text, message in [("dflash:vt=confidence", "vt=confidence with the dflash arm: the dflash program runs the ladder window; use the dspark arm"), ("dspark:cap=99", "verify cap must be in [2, 9]"),
                          ("dspark:draft=dflash,vt=confidence", "needs a checkpoint with an accept-rate head")]:
        with pytest.raises(BenchError) as e:
            eb.load_arms(engine, [parse_arm(text)], Drafters(None, drafters))
        assert str(e.value).startswith(f"--arm {text!r}: ") and message in str(e.value), str(e.value)


def test_prec_arm_loads_its_own_quantized_drafter(engine, pair):
    from memra_cli.engine.quant.blocks import QuantLinearRef

    _, drafters = pair
    arms = eb.load_arms(engine, parse_arms(["dspark", "dspark:prec=q8"]), Drafters(None, drafters))
    plain, quant = arms[2].loaded.drafter, arms[3].loaded.drafter
    assert plain is not quant
    assert isinstance(quant.layers[0].wq, QuantLinearRef) and isinstance(plain.layers[0].wq, torch.Tensor)
    assert quant.quantized and not plain.quantized


def test_quantized_drafter_graphs_capture_in_plain_launch_order(engine, pair):
    """A quantized drafter's graphs are captured inside its step ops' `plain_launches` (PDL off:
    measured slower for it on the H200); a plain drafter's are not."""
    from memra_cli.engine.runtime import draft_graphs

    _, drafters = pair
    arms = eb.load_arms(engine, parse_arms(["dspark", "dspark:prec=q4"]), Drafters(None, drafters))
    plain, quant = arms[2].loaded.drafter, arms[3].loaded.drafter
    entered = []

    class Ops:
        @staticmethod
        def plain_launches():
            entered.append(True)
            return contextlib.nullcontext()

    for drafter, expect in ((plain, []), (quant, [True])):
        entered.clear()
        saved, drafter.step_ops = drafter.step_ops, Ops()
        try:
            with draft_graphs._launch_order(drafter):
                pass
        finally:
            drafter.step_ops = saved
        assert entered == expect


PROMPTS = [[5, 17, 42, 99], [1, 2, 3], [300, 7, 7, 7, 11, 250]]


@pytest.fixture(scope="module")
def fixed_engine(model):
    return Engine.from_model(model, step_width=16)  # the CLI's default steps: off and plain differ


def test_run_bench_gate_rotation_and_aggregates(monkeypatch, fixed_engine, model, pair):
    _, drafters = pair
    arms = eb.load_arms(fixed_engine, parse_arms(["dflash", "dspark", "dspark:harvest=dflash"]), Drafters(None, drafters))
    order = []
    real = eb.generate_one
    monkeypatch.setattr(eb, "generate_one", lambda arm, *a: order.append(arm.name) or real(arm, *a))
    steps = []
    result = eb.run_bench(arms, PROMPTS, 10, warmup=1, progress=lambda *s: steps.append(s), meta={"device": "cpu"})
    names = [a.name for a in arms]
    assert names == ["off", "plain", "dflash", "dspark", "dspark:harvest=dflash"]
    n = len(names)
    assert order[:n] == names  # warm-up on prompt 0: the plain arm runs in the same loop
    assert order[n:2 * n] == names and order[2 * n:3 * n] == names[1:] + names[:1] and order[3 * n:] == names[2:] + names[:2]
    assert steps == [("warmup", 1, 1), ("measure", 1, 3), ("measure", 2, 3), ("measure", 3, 3)]
    assert result.exact and all(a.n_prompts == 3 for a in result.arms)
    assert [a.exact for a in result.arms] == [True, None, True, True, True]  # plain: measured, not gated
    want = sum(len(greedy_reference(model, p, 10, model.cfg.eos_token_ids)) for p in PROMPTS)
    j = result.as_json()
    for a in j["arms"]:
        assert a["tokens"] == want and sum(a["tau_hist"].values()) == a["rounds"]
        assert a["tau"] == pytest.approx((a["accepted"] + a["rounds"]) / a["rounds"])
        assert sum(int(k) * v for k, v in a["tau_hist"].items()) >= a["tokens"]  # the budget may cut the last round
        assert set(a["phase_ms"]) == {"prefill", "draft", "verify", "rollback", "ingest"}  # CPU default: timed
    off, plain = j["arms"][0], j["arms"][1]
    assert off["name"] == "off" and off["speedup_vs_off"] == 1.0 and off["acceptance"] is None and off["tau_hist"] == {"1": off["rounds"]}
    assert plain["name"] == "plain" and plain["mode"] == "plain" and plain["speedup"] == 1.0 and plain["acceptance"] is None
    assert plain["tau_hist"] == {"1": plain["rounds"]} and plain["rounds"] == plain["tokens"]  # one token a step
    for a in j["arms"]:  # speedup: over the plain arm; speedup_vs_off: over the off arm
        assert a["speedup"] == pytest.approx(a["tok_per_s"] / plain["tok_per_s"])
        assert a["speedup_vs_off"] == pytest.approx(a["tok_per_s"] / off["tok_per_s"])
    assert off["speedup"] == pytest.approx(off["tok_per_s"] / plain["tok_per_s"]) and off["speedup"] != 1.0
    assert j["speedup_baseline"] == "plain"
    assert j["baselines"] == {
        "plain": {"role": "speed baseline: the fastest plain decoding on this device; speedup",
                  "steps": "one-row steps (variable width), eager", "same_as_off": 3},  # float32: the same stream
        "off": {"role": "exactness reference (every speculative stream must equal its stream); speedup_vs_off",
                "steps": "fixed 16-row steps, eager"}}
    assert [a["steps"] for a in j["arms"]] == ["fixed 16-row steps, eager", "one-row steps (variable width), eager"] + ["fixed 16-row steps, eager"] * 3
    assert j["phase_times"] is True and j["phase_clock"] == "perf_counter, no device synchronization"
    assert j["exact"] is True and j["mismatches"] == [] and j["device"] == "cpu" and j["warmup"] == 1


def test_the_plain_arm_runs_on_its_own_engine_over_the_same_weights(fixed_engine, pair):
    _, drafters = pair
    arms = eb.load_arms(fixed_engine, parse_arms(["dspark"]), Drafters(None, drafters))
    off, plain, spec = arms
    assert off.engine is spec.engine is fixed_engine and plain.engine is not fixed_engine
    assert plain.engine.target is fixed_engine.target  # no second load
    assert (plain.engine.step_width, plain.engine.cuda_graphs) == (None, False)  # CPU: variable width, eager
    assert plain.engine.pool is not fixed_engine.pool
    with torch.inference_mode(), plain.session(PROMPTS[0], 6, timed=True) as s:
        s.run()
        assert s.stats.rounds == 6 and s.proposer is None


def test_the_plain_stream_is_never_the_gate_reference(monkeypatch, fixed_engine, model, pair):
    """A plain stream that differs from off's is counted (same_as_off), never a gate failure; an off
    stream that differs fails every gated arm and never plain."""
    _, drafters = pair
    arms = eb.load_arms(fixed_engine, parse_arms(["dspark"]), Drafters(None, drafters))
    real = eb.generate_one
    victim = {"name": "plain"}

    def corrupt(arm, ids, max_new, timed):
        tokens, stats, wall = real(arm, ids, max_new, timed)
        if arm.name == victim["name"] and ids == PROMPTS[1]:
            tokens[2] = (tokens[2] + 1) % model.vocab_size
        return tokens, stats, wall

    monkeypatch.setattr(eb, "generate_one", corrupt)
    result = eb.run_bench(arms, PROMPTS, 6, warmup=0)
    assert result.exact and result.mismatches == [] and result.arm("plain").exact is None
    assert result.arm("plain").same_as_off == 2 and result.as_json()["baselines"]["plain"]["same_as_off"] == 2
    victim["name"] = "off"
    result = eb.run_bench(arms, PROMPTS, 6, warmup=0)
    assert not result.exact and [(m.arm, m.prompt, m.index) for m in result.mismatches] == [("dspark", 1, 2)]
    assert [a.exact for a in result.arms] == [True, None, False] and result.arm("plain").same_as_off == 2


def test_phases_are_not_timed_by_default_on_cuda(monkeypatch):
    """A CUDA run times no phase unless asked (its clock would synchronize at every phase
    boundary); on CPU the default times them (perf_counter alone)."""
    from memra_cli.engine.api import Arm as LoadedArm
    from memra_cli.engine.stats import DecodeStats

    assert eb.default_phase_times(torch.device("cuda")) is False and eb.default_phase_times(torch.device("cpu")) is True
    cuda = types.SimpleNamespace(device=torch.device("cuda"), steps="fixed 16-row steps, CUDA graphs on")
    fast = types.SimpleNamespace(device=torch.device("cuda"), steps="one-row steps, CUDA graphs on")
    arms = [eb.Arm(ArmSpec("off", "off"), cuda, LoadedArm("off")), eb.Arm(ArmSpec("plain", "plain"), fast, LoadedArm("off"))]
    timed = []

    def fake(arm, ids, max_new, t):
        timed.append(t)
        return [1] * max_new, DecodeStats(rounds=max_new, tokens=max_new), 0.01 if arm.name == "off" else 0.005

    monkeypatch.setattr(eb, "generate_one", fake)
    j = eb.run_bench(arms, PROMPTS[:2], 4, warmup=1).as_json()
    assert timed == [False] * 6
    assert j["phase_times"] is False and j["phase_clock"] is None and all(a["phase_ms"] is None for a in j["arms"])
    assert [a["speedup"] for a in j["arms"]] == [0.5, 1.0] and [a["speedup_vs_off"] for a in j["arms"]] == [1.0, 2.0]
    assert j["baselines"]["plain"]["steps"] == "one-row steps, CUDA graphs on"
    timed.clear()
    j = eb.run_bench(arms, PROMPTS[:2], 4, warmup=0, phase_times=True).as_json()
    assert timed == [True] * 4 and j["phase_clock"].startswith("perf_counter, device synchronized at every phase boundary")


def test_without_a_plain_arm_the_speedup_is_over_off(engine):
    arms = eb.load_arms(engine, [ArmSpec("off", "off")], Drafters())
    j = eb.run_bench(arms, PROMPTS[:1], 3, warmup=0, phase_times=False).as_json()
    assert j["speedup_baseline"] == "off" and j["arms"][0]["speedup"] == 1.0 and "plain" not in j["baselines"]
    assert j["phase_times"] is False and j["arms"][0]["phase_ms"] is None


def test_gate_reports_first_difference(monkeypatch, engine, model, pair):
    _, drafters = pair
    arms = eb.load_arms(engine, parse_arms(["dflash", "dspark"]), Drafters(None, drafters))
    real = eb.generate_one

    def corrupt(arm, ids, max_new, timed):
        tokens, stats, wall = real(arm, ids, max_new, timed)
        if arm.name == "dspark" and ids == PROMPTS[1]:
            tokens[3] = (tokens[3] + 1) % model.vocab_size
        return tokens, stats, wall

    monkeypatch.setattr(eb, "generate_one", corrupt)
    result = eb.run_bench(arms, PROMPTS[:2], 6, warmup=0, phase_times=False)
    assert not result.exact and [a.exact for a in result.arms] == [True, None, True, False]
    (m,) = result.mismatches
    assert (m.arm, m.prompt, m.index, m.got) == ("dspark", 1, 3, (m.expected + 1) % model.vocab_size)
    j = result.as_json()
    assert j["exact"] is False and j["mismatches"][0]["arm"] == "dspark" and j["arms"][0]["phase_ms"] is None


def test_first_difference():
    assert eb.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert eb.first_difference([1, 2, 3], [1, 9, 3]) == 1
    assert eb.first_difference([1, 2, 3], [1, 2]) == 2
    assert eb.first_difference([1], [1, 4]) == 1


def test_broken_embedded_pair_only_matters_without_target(monkeypatch, pair):
    target, _ = pair
    mod = types.ModuleType("memra_cli.assets")

    def missing():
        raise eb.MemraError("the embedded default models are missing from this installation")

    mod.default_pair = missing
    monkeypatch.setitem(sys.modules, "memra_cli.assets", mod)
    with pytest.raises(eb.MemraError, match="missing from this installation"):
        eb.resolve_inputs(None, None)
    assert eb.resolve_inputs(target, None) == (target, Drafters(None), False)


def test_graphs_are_captured_before_the_timed_pass(monkeypatch, pair):
    """With CUDA graphs (the eager stand-in on the CPU), every arm primes every prompt and runs a
    round before timing, so no capture lands in a timed run: counted per stage. Without graphs
    there is no such pass (the test above: warm-up and measure stages only)."""
    from memra_cli.engine.runtime import cuda_graphs
    from memra_cli.engine.runtime.steps import StepRunner

    captures = []

    def capture(fn, device, pool=None):
        out = fn()
        captures.append(fn)

        class Replay:
            def replay(self):
                fresh = fn()
                for mine, new in zip(_flat(out), _flat(fresh)):
                    mine.copy_(new)
        return Replay(), out

    def _flat(x):
        if isinstance(x, torch.Tensor):
            return [x]
        if isinstance(x, (tuple, list)):
            return [t for y in x for t in _flat(y)]
        return []

    monkeypatch.setattr(cuda_graphs, "capture", capture)
    model = Qwen3Target.from_dir(pair[0])
    runner = StepRunner(model, 16)
    runner.cuda_graphs = True  # a runner refuses graphs off CUDA: switched on after construction
    model.ensure_positions(runner._rows(model.cfg.max_position_embeddings))
    engine = Engine(model, runner, model.device, model.dtype, ["graphs on (CPU stand-in)"], draft_graphs=True,
                    round_graphs=True)
    arms = eb.load_arms(engine, parse_arms(["dspark", "dspark:adapt=0"]), Drafters(None, pair[1]))
    after_graphs = []

    def progress(stage, done, total):
        if stage == "graphs" and done == total:
            after_graphs.append(len(captures))

    result = eb.run_bench(arms, PROMPTS, 10, warmup=0, progress=progress)
    assert after_graphs and after_graphs[0] > 0
    assert len(captures) == after_graphs[0]  # the timed pass captured nothing
    assert result.as_json()["graph_warmup"] is True and result.exact
