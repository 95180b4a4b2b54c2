"""`memra train` on a tiny target: trained a few steps, interrupted and resumed (bit for bit the
uninterrupted run), exported, read by `census`, run exactly by `generate`; bad input refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from memra_cli.cli.app import app
from memra_cli.engine.greedy import greedy_reference
from memra_cli.engine.models.qwen3 import Qwen3Target
from memra_cli.tiny.target import make_tiny_qwen3
from memra_cli.train.run import TrainRequest, plan_training, run_training

runner = CliRunner()
STEPS = 4
SMALL = ["--max-new", "24", "--batch", "2", "--anchors", "4", "--block", "4", "--device", "cpu", "--eval-new", "16",
         "--export-dtype", "float32", "--checkpoint-every", "1"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    target = make_tiny_qwen3(root / "target", tokenizer=True)
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"def f{i}(x):\n    return x * {i} +"}) + "\n" for i in range(6)))
    return root, target, prompts


def train(*args):
    return runner.invoke(app, ["train", *[str(a) for a in args]], env={})


def _request(target: Path, prompts: Path, out: Path, kind: str, **kw) -> TrainRequest:
    return TrainRequest(target=target, kind=kind, prompts=str(prompts), out=out, steps=STEPS, device="cpu", max_new=24,
                        batch=2, anchors=4, block=4, eval_new=16, export_dtype="float32", checkpoint_every=1,
                        **({"markov_rank": 16} if kind == "dspark" else {}), **kw)


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_resumed_run_equals_uninterrupted_and_exports_a_drafter_generate_runs_exactly(setup, kind):
    root, target, prompts = setup
    extra = ["--markov-rank", "16"] if kind == "dspark" else []
    whole, parts = root / f"whole_{kind}", root / f"parts_{kind}"
    r = train("--target", target, "--kind", kind, "--prompts", prompts, "--out", whole, "--steps", STEPS, *SMALL, *extra,
              "--gguf", "q8", "--plot", "--json")
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)
    assert report["finished"] and report["steps_run"] == STEPS and report["heldout"]["exact"]
    assert "taps: each batch's sequences through the target's layers together (qwen3)" in report["notes"]
    assert (whole / "train.png").read_bytes()[:4] == b"\x89PNG" and report["plot"] == str(whole / "train.png")

    # the same run stopped after 2 steps (as Ctrl-C leaves it: a checkpoint, no --out), then resumed
    stopped = run_training(plan_training(_request(target, prompts, parts, kind)), stop_after=2)
    assert stopped["steps_run"] == 2 and not stopped["finished"] and not parts.exists()
    r = train("--target", target, "--kind", kind, "--prompts", prompts, "--out", parts, "--steps", STEPS, *SMALL, *extra,
              "--resume", "--json")
    assert r.exit_code == 0, r.output
    resumed = json.loads(r.stdout)
    assert resumed["resumed_from"] == 2 and resumed["steps_run"] == STEPS  # it continued, it did not start over

    a, b = load_file(str(whole / "model.safetensors")), load_file(str(parts / "model.safetensors"))
    assert a.keys() == b.keys()
    for name in a:  # f32 on the CPU, same ops in the same order: bit for bit
        assert torch.equal(a[name], b[name]), name
    sa = torch.load(root / f"whole_{kind}.ckpt" / "state.pt", weights_only=False)
    sb = torch.load(root / f"parts_{kind}.ckpt" / "state.pt", weights_only=False)
    assert sa["losses"] == sb["losses"] and sa["tokens"] == sb["tokens"]

    census = runner.invoke(app, ["census", str(whole), "--json"], env={})
    assert census.exit_code == 0, census.output
    c = json.loads(census.stdout)
    geo = report["geometry"]
    assert (c["block_size"], c["target_layer_ids"], c["mask_token_id"]) == (4, geo["taps"], 511)
    if kind == "dflash":  # z-lab's layout
        assert c["exporter"] == "zlab-dflash" and c["strategy_dspark"] is False and c["markov"] is None
    else:  # DeepSpec's, with the markov and confidence heads
        assert c["exporter"] == "deepspec" and c["strategy_dspark"] is True
        assert c["markov"] is not None and c["confidence"] is not None

    # the export against memra's independent float64 oracle (parity/reference.py), stage by stage
    oracle = root / f"oracle_{kind}.npz"
    made = runner.invoke(app, ["parity", str(whole), "--make-oracle", str(oracle), "--target", str(target)], env={})
    assert made.exit_code == 0, made.output
    par = runner.invoke(app, ["parity", str(whole), str(oracle), "--target", str(target), "--json"], env={})
    assert par.exit_code == 0 and json.loads(par.stdout)["pass"] is True, par.output

    gguf = whole / "model.q8.gguf"
    assert report["gguf"]["path"] == str(gguf) and gguf.is_file()
    census = runner.invoke(app, ["census", str(gguf), "--json"], env={})
    assert census.exit_code == 0, census.output

    ids = [5, 17, 42, 99]
    g = runner.invoke(app, ["generate", "--target", str(target), "--draft", str(whole), "--prompt-ids", "5,17,42,99",
                            "--max-new", "24", "--json"], env={})
    assert g.exit_code == 0, g.output
    ref = greedy_reference(Qwen3Target.from_dir(target), ids, 24, Qwen3Target.from_dir(target).cfg.eos_token_ids)
    assert json.loads(g.stdout)["tokens"] == ref


def _refused(r, out: Path, needle: str) -> None:
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.exit_code == 2, r.output
    assert len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0], r.stderr
    assert not out.exists() and not out.with_name(out.name + ".ckpt").exists()


def test_a_family_memra_cannot_run_is_refused(setup, tmp_path):
    root, target, prompts = setup
    other = tmp_path / "mistral"
    other.mkdir()
    cfg = json.loads((target / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**cfg, "model_type": "mistral"}))
    out = tmp_path / "out"
    _refused(train("--target", other, "--kind", "dflash", "--prompts", prompts, "--out", out), out, "mistral")


def test_taps_past_the_targets_depth_are_refused(setup, tmp_path):
    root, target, prompts = setup
    out = tmp_path / "out"
    # 4 layers: taps are -1..3
    _refused(train("--target", target, "--kind", "dflash", "--prompts", prompts, "--out", out, "--taps", "1,4"), out,
             "tap 4 is outside the target's layers (expected -1..3")


def test_an_empty_prompt_set_is_refused(setup, tmp_path):
    root, target, _ = setup
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    out = tmp_path / "out"
    _refused(train("--target", target, "--kind", "dflash", "--prompts", empty, "--out", out), out, "no prompts")


def test_an_unknown_gguf_policy_is_refused(setup, tmp_path):
    root, target, prompts = setup
    out = tmp_path / "out"
    _refused(train("--target", target, "--kind", "dflash", "--prompts", prompts, "--out", out, "--gguf", "q3"), out,
             "--gguf")


def test_an_existing_out_without_force_is_refused(setup, tmp_path):
    root, target, prompts = setup
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    r = train("--target", target, "--kind", "dflash", "--prompts", prompts, "--out", out)
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.exit_code == 2 and len(lines) == 1 and "--force" in lines[0], r.output
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"] and not (tmp_path / "out.ckpt").exists()


def test_a_hybrid_qwen3_5_target_trains_through_the_engine(setup, tmp_path):
    """The taps come from memra's engine, so a family transformers-free training never saw (the
    Qwen3.5 Gated DeltaNet hybrid, multimodal layout) trains the same way; its held-out streams
    are exact."""
    from memra_cli.tiny.qwen3_5 import make_tiny_qwen35

    _, _, prompts = setup
    target = make_tiny_qwen35(tmp_path / "q35", layout="multimodal", tokenizer=True)
    out = tmp_path / "out"
    r = train("--target", target, "--kind", "dflash", "--prompts", prompts, "--out", out, "--steps", 2, *SMALL, "--json")
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)
    assert report["steps_run"] == 2 and report["heldout"]["exact"] and report["heldout"]["prompts"] == 1
    assert runner.invoke(app, ["census", str(out)], env={}).exit_code == 0


def test_ctrl_c_leaves_a_resumable_checkpoint_and_no_output(setup, tmp_path):
    """A real SIGINT in the middle of training: exit 130, no --out, a checkpoint of whole steps that
    --resume finishes from."""
    import os
    import signal
    import subprocess
    import sys

    _, target, prompts = setup
    out = tmp_path / "out"
    args = ["--target", target, "--kind", "dflash", "--prompts", prompts, "--out", out, *SMALL, "--log-every", "1"]
    proc = subprocess.Popen([sys.executable, "-m", "memra_cli", "train", *map(str, args), "--steps", "100000",
                             "--checkpoint-every", "100000"], stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    for line in proc.stderr:  # wait until training runs
        if line.startswith("train step 3/"):
            break
    proc.send_signal(signal.SIGINT)
    rest = proc.stderr.read()
    assert proc.wait(timeout=60) == 130, rest
    assert "error: interrupted" in rest and not out.exists()
    state = torch.load(tmp_path / "out.ckpt" / "state.pt", weights_only=False)
    assert state["step"] >= 3  # saved on the signal, not only at --checkpoint-every
    done = state["step"] + 2
    other = train(*args, "--steps", done, "--resume", "--batch", 3)  # a resumed run must be the same run
    assert other.exit_code == 2 and "batch=2" in other.stderr and "batch=3" in other.stderr, other.output
    r = train(*args, "--steps", done, "--resume", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["resumed_from"] == state["step"] and (out / "model.safetensors").is_file()


def test_chat_rows_go_through_the_targets_chat_template(setup, tmp_path):
    """A chat JSONL's conversations are rendered by the target's template, ready for the
    assistant's turn (a trailing assistant answer is dropped: the target writes its own), the
    same ids `generate --chat` gives a single user turn."""
    from memra_cli.engine.text import TextCodec
    from memra_cli.train.online import encode_prompts

    _, target, _ = setup
    chats = tmp_path / "chats.jsonl"
    rows = [{"messages": [{"role": "user", "content": "sort a list"}, {"role": "assistant", "content": "sorted(x)"}]},
            {"messages": [{"role": "user", "content": "reverse it"}]}]
    chats.write_text("".join(json.dumps(r) + "\n" for r in rows))
    codec = TextCodec(target)
    got = encode_prompts(str(chats), codec, max_prompt=512)
    assert got.chat and got.ids == (tuple(codec.encode("sort a list", chat=True)), tuple(codec.encode("reverse it", chat=True)))


def test_a_spent_budget_stops_training_and_still_exports(setup, tmp_path):
    """--budget-s ends training at the first step boundary past it; the drafter is then exported
    and evaluated as after --steps (the report says what stopped it)."""
    _, target, prompts = setup
    out = tmp_path / "out"
    r = train("--target", target, "--kind", "dflash", "--prompts", prompts, "--out", out, "--steps", 1000, *SMALL,
              "--budget-s", 0, "--json")
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)
    assert report["stopped_by"] == "budget" and report["steps_run"] == 0 and not report["finished"]
    assert (out / "model.safetensors").is_file() and report["heldout"]["exact"]


def test_sampled_answers_are_a_pure_function_of_the_prompt(setup):
    """--temperature: each prompt's answer is sampled with seed + its index, so two runs (a resumed
    one regenerates its answers) draw the same answers; greedy ones are the argmax stream."""
    from memra_cli.engine.api import Engine, EngineConfig
    from memra_cli.engine.spec.keyed import SamplingParams
    from memra_cli.engine.text import TextCodec
    from memra_cli.train.online import OnlineData, encode_prompts

    _, target, prompts = setup
    engine = Engine.load(EngineConfig(target=target, device="cpu"))
    rows = encode_prompts(str(prompts), TextCodec(target), 512)
    hot = SamplingParams(temperature=5.0, seed=7)
    first, second = OnlineData(engine, rows, 8, hot), OnlineData(engine, rows, 8, hot)
    assert [first.answer(i) for i in (0, 1)] == [second.answer(i) for i in (0, 1)]
    greedy = OnlineData(engine, rows, 8)
    ids = list(rows.ids[0])
    assert list(greedy.answer(0)) == greedy_reference(Qwen3Target.from_dir(target), ids, 8, ())
    assert first.answer(0) != greedy.answer(0)  # temperature 5 over 512 tokens: a different stream


def test_compiled_training_takes_the_eager_steps(setup, tmp_path):
    """compile= sends the drafter's forward and losses through torch.compile (here its
    `aot_eager` backend: the graph capture and autograd split, without a C++ toolchain): after 3
    steps the same weights as eager, to float32 reordering (1e-4 relative, 1e-5 absolute on
    weights of O(0.1-1), a few AdamW steps of lr 6e-4 each)."""
    _, target, prompts = setup
    runs = []
    for compile in (False, "aot_eager"):
        out = tmp_path / f"c_{compile}"
        plan = plan_training(_request(target, prompts, out, "dspark", heldout=1, compile=compile))
        report = run_training(plan, stop_after=3)
        state = torch.load(tmp_path / f"c_{compile}.ckpt" / "state.pt", weights_only=False)
        runs.append((report["steps_run"], state["drafter"]))
    (n_eager, eager), (n_comp, comp) = runs
    assert n_eager == n_comp == 3
    for name, w in eager.items():
        torch.testing.assert_close(comp[name], w, rtol=1e-4, atol=1e-5, msg=name)


def test_a_budget_refits_the_schedule_to_end_inside_it(setup, tmp_path, monkeypatch):
    """With --budget-s the step total is re-planned once, at step 40, from the steady step time
    after step 10 (schedule.fit_steps), so the cosine schedule finishes inside the budget instead
    of being cut off high. A fake clock (one tick per reading of the job's clock) makes the plan
    exact: the job reads its clock once per step at the budget check and once per step for its
    progress, plus once at steps 10 and 40."""
    from dataclasses import replace
    from types import SimpleNamespace

    import memra_cli.train.job as job_module

    ticks = iter(range(10**6))
    monkeypatch.setattr(job_module, "time", SimpleNamespace(perf_counter=lambda: 0.1 * next(ticks)))
    _, target, prompts = setup
    req = replace(_request(target, prompts, tmp_path / "out", "dflash", heldout=1), steps=1000, budget_s=20.0)
    report = run_training(plan_training(req))
    # the clock reads 2.2 s at step 10 and 8.3 s at step 40: (8.3 - 2.2) / 30 s a step, and
    # (20 - 8.3) s left hold 57 more steps (57.5, rounded down)
    assert report["steps_planned"] == 97 and report["hyper"]["steps"] == 97
    assert report["steps_run"] == 97 and report["finished"] and report["stopped_by"] is None


# a Qwen3-style switch: `enable_thinking=false` closes an empty think block in the generation prompt
SWITCHED = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n"
            "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}")
# a DeepSeek-V3.1-style switch named `thinking`, off unless passed
NAMED_THINKING = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                  "{% if add_generation_prompt %}assistant:{% if thinking is defined and thinking %}<think>{% endif %}"
                  "{% endif %}")


def _with_template(target: Path, out: Path, template: str) -> Path:
    """A copy of the tiny target (weights linked) whose tokenizer_config.json has `template`."""
    out.mkdir()
    for f in target.iterdir():
        (out / f.name).symlink_to(f)
    (out / "tokenizer_config.json").unlink()
    cfg = json.loads((target / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": template}))
    return out


def _chats(path: Path) -> Path:
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "sort a list"}]}) + "\n"
                    + json.dumps({"messages": [{"role": "user", "content": "reverse it"}]}) + "\n")
    return path


@pytest.mark.parametrize("switch", ["enable_thinking", "thinking"])
def test_the_thinking_switch_is_passed_as_the_templates_own_variable(setup, tmp_path, switch):
    """--thinking/--no-thinking reach the template as its own switch variable; unset, the
    template's default renders (nothing passed) and the report says a default applied."""
    from memra_cli.engine.text import TextCodec
    from memra_cli.train.online import encode_prompts, thinking_note

    _, target, _ = setup
    switched = _with_template(target, tmp_path / "t", SWITCHED if switch == "enable_thinking" else NAMED_THINKING)
    codec = TextCodec(switched)
    chats = str(_chats(tmp_path / "chats.jsonl"))
    assert codec.thinking_switch() == switch
    msgs = [{"role": "user", "content": "sort a list"}]
    for thinking in (None, True, False):
        got = encode_prompts(chats, codec, 512, thinking)
        passed = {} if thinking is None else {switch: thinking}
        assert got.ids[0] == tuple(codec.tok.encode(codec.render_chat(msgs, passed), add_special_tokens=False).ids)
        assert got.template == {"switch": switch, "thinking": thinking, "default": thinking is None}
    on, off = encode_prompts(chats, codec, 512, True), encode_prompts(chats, codec, 512, False)
    assert on.ids != off.ids  # the switch changes the rendered prompt: it was passed, not ignored
    assert encode_prompts(chats, codec, 512).ids == (off.ids if switch == "thinking" else on.ids)  # each one's default
    assert thinking_note(off.template) == f"thinking: off ({switch}=False passed to the chat template; --no-thinking)"
    assert "default" in thinking_note(encode_prompts(chats, codec, 512).template)
    # the run's notes (and so its report) say which was used
    plan = plan_training(TrainRequest(target=switched, kind="dflash", prompts=chats, out=tmp_path / "o", device="cpu",
                                      block=4, heldout=1, thinking=False))
    assert thinking_note(off.template) in plan.notes and plan.prompts.template == off.template


def test_a_thinking_flag_without_a_switch_to_pass_it_to_is_refused(setup, tmp_path):
    """The tiny target's template has no thinking switch, and plain prompts use no template: the
    flag would change nothing, so it is refused in one line before anything loads."""
    _, target, prompts = setup
    chats, out = _chats(tmp_path / "chats.jsonl"), tmp_path / "out"
    _refused(train("--target", target, "--kind", "dflash", "--prompts", chats, "--out", out, "--thinking"), out,
             "--thinking: the chat template in ")
    _refused(train("--target", target, "--kind", "dflash", "--prompts", chats, "--out", out, "--no-thinking"), out,
             "has no thinking switch (it reads none of enable_thinking, thinking)")
    _refused(train("--target", target, "--kind", "dflash", "--prompts", prompts, "--out", out, "--thinking"), out,
             "only chat prompts go through the chat template")


def _family(name: str, directory: Path) -> Path:
    """A tiny target of each family memra loads, with the tiny tokenizer (memra_cli/tiny)."""
    from memra_cli.tiny.__main__ import TINY_MOE
    from memra_cli.tiny.gemma4 import make_tiny_gemma4
    from memra_cli.tiny.qwen3_5 import make_tiny_qwen35
    from memra_cli.tiny.qwen3_moe import make_tiny_qwen3_moe
    from memra_cli.tiny.target import make_tiny_llama

    makers = {
        "qwen3": lambda d: make_tiny_qwen3(d, tokenizer=True),
        "llama": lambda d: make_tiny_llama(d, layers=4, tokenizer=True),
        "qwen3_5-text": lambda d: make_tiny_qwen35(d, tokenizer=True),
        "qwen3_5-multimodal": lambda d: make_tiny_qwen35(d, layout="multimodal", tokenizer=True),
        "qwen3_moe": lambda d: make_tiny_qwen3_moe(d, tokenizer=True),
        "qwen3_5_moe": lambda d: make_tiny_qwen35(d, layout="multimodal", moe=TINY_MOE, tokenizer=True),
        "gemma4-text": lambda d: make_tiny_gemma4(d, tokenizer=True),
        "gemma4-multimodal": lambda d: make_tiny_gemma4(d, layout="multimodal", tokenizer=True),
        "gemma4-moe": lambda d: make_tiny_gemma4(d, moe=TINY_MOE, tie=False, tokenizer=True),
    }
    return makers[name](directory)


FAMILIES = ["qwen3", "llama", "qwen3_5-text", "qwen3_5-multimodal", "qwen3_moe", "qwen3_5_moe", "gemma4-text",
            "gemma4-multimodal", "gemma4-moe"]


@pytest.mark.exhaustive
@pytest.mark.parametrize("kind", ["dflash", "dspark"])
@pytest.mark.parametrize("family", FAMILIES)
def test_every_target_family_trains_each_drafter_kind_that_fits_it(setup, tmp_path, family, kind):
    """`memra train` over a tiny target of every family memra loads: a few steps, the export
    read by `census`, every held-out stream exact. A z-lab DFlash drafter (Qwen3 layers) trains
    over any target, Gemma's with its block embedding scaled by --emb-scale; a DSpark drafter
    over Gemma 4 is DeepSpec's Gemma4DSparkModel (its own scaled embedding, no flag needed)."""
    _, _, prompts = setup
    target, out = _family(family, tmp_path / "target"), tmp_path / "out"
    extra = ["--markov-rank", "16"] if kind == "dspark" else []
    scaled = family.startswith("gemma4")
    r = train("--target", target, "--kind", kind, "--prompts", prompts, "--out", out, "--steps", 2, *SMALL, *extra,
              *(["--emb-scale"] if scaled and kind == "dflash" else []),
              *(["--gguf", "q8"] if scaled and kind == "dspark" else []), "--json")
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)
    held = report["heldout"]
    assert report["steps_run"] == 2 and held["exact"] and held["prompts"] == 1 and held["warnings"] == []
    assert sum(n.startswith("taps: each batch's sequences") for n in report["notes"]) == 1  # every family batches
    assert held["block_embedding"]["scaled"] is scaled
    assert report["geometry"]["emb_scale"] == (8.0 if scaled else 1.0)  # √64, the tiny Gemma's hidden
    census = runner.invoke(app, ["census", str(out), "--json"], env={})
    assert census.exit_code == 0, census.output
    assert json.loads(census.stdout)["exporter"] == ("zlab-dflash" if kind == "dflash" else "deepspec")
    architecture = json.loads((out / "config.json").read_text())["architectures"]
    assert architecture == ["Gemma4DSparkModel" if scaled and kind == "dspark" else
                            {"dflash": "DFlashDraftModel", "dspark": "Qwen3DSparkModel"}[kind]]
    if scaled and kind == "dspark":
        _gemma4_dspark_runs_exactly(target, out)


def _gemma4_dspark_runs_exactly(target: Path, drafter: Path) -> None:
    """A trained Gemma4DSparkModel: census reads it and its q8 GGUF, it passes parity against the
    float64 oracle (parity/reference.py's Gemma 4 drafter), and `generate` with it (and with its
    GGUF) gives the stream of `--spec off`."""
    c = json.loads(runner.invoke(app, ["census", str(drafter), "--json"], env={}).stdout)
    assert c["strategy_dspark"] is True and c["markov"] is not None and c["confidence"] is not None
    gguf = runner.invoke(app, ["census", str(drafter / "model.q8.gguf"), "--json"], env={})  # --gguf q8's
    assert gguf.exit_code == 0 and json.loads(gguf.stdout)["exporter"] == "deepspec", gguf.output
    oracle = drafter.with_name("oracle.npz")
    made = runner.invoke(app, ["parity", str(drafter), "--make-oracle", str(oracle), "--target", str(target)], env={})
    assert made.exit_code == 0, made.output
    par = runner.invoke(app, ["parity", str(drafter), str(oracle), "--target", str(target), "--json"], env={})
    assert par.exit_code == 0 and json.loads(par.stdout)["pass"] is True, par.output
    streams = {}
    for name, draft, spec in (("dspark", drafter, "dspark"), ("q8", drafter / "model.q8.gguf", "dspark"),
                              ("off", drafter, "off")):
        g = runner.invoke(app, ["generate", "--target", str(target), "--draft", str(draft), "--spec", spec,
                                "--prompt-ids", "5,17,42,99", "--max-new", "32", "--json"], env={})
        assert g.exit_code == 0, g.output
        streams[name] = json.loads(g.stdout)
    for name in ("dspark", "q8"):
        drafted = streams[name]
        assert drafted["mode"] == "dspark" and drafted["stats"]["drafted"] > 0
        assert drafted["receipts"]["block_embedding"]["scaled"] is True
        assert drafted["tokens"] == streams["off"]["tokens"] and len(drafted["tokens"]) == 32, name


def test_training_feeds_the_drafter_the_block_rows_and_logits_it_sees_at_inference(setup):
    """--emb-scale: the drafter's block rows in training are the target's rows times the scale,
    exactly what a table pre-multiplied by it gives (as the engine's proposer multiplies); and a
    target that soft-caps its logits caps the drafter's training logits the same way."""
    from types import SimpleNamespace

    from memra_cli.train.drafter import TrainDrafter
    from memra_cli.train.losses import DraftSpec, draft_logits

    gen = torch.Generator().manual_seed(0)
    embed, head = torch.randn(32, 16, generator=gen), torch.randn(32, 16, generator=gen)
    torch.manual_seed(0)
    drafter = TrainDrafter(16, 1, 2, 1, 24, 1, 32)
    ids, anc, taps = torch.randint(0, 31, (2, 12), generator=gen), torch.tensor([[2, 5], [3, 6]]), torch.randn(2, 12, 16)
    scaled = draft_logits(drafter, SimpleNamespace(embed_weight=embed, head_weight=head, tap_batch=None), ids, anc,
                          DraftSpec("dflash", 4, (0,), 31, emb_scale=8.0), taps)[0]
    premultiplied = draft_logits(drafter, SimpleNamespace(embed_weight=embed * 8.0, head_weight=head, tap_batch=None),
                                 ids, anc, DraftSpec("dflash", 4, (0,), 31), taps)[0]
    raw = draft_logits(drafter, SimpleNamespace(embed_weight=embed, head_weight=head, tap_batch=None), ids, anc,
                       DraftSpec("dflash", 4, (0,), 31), taps)[0]
    assert torch.equal(scaled, premultiplied) and not torch.allclose(scaled, raw)
    # a Gemma target caps its logits (its lm_head, which the drafter's logits go through at inference)
    capped = draft_logits(drafter, SimpleNamespace(embed_weight=embed, head_weight=head, tap_batch=None, logit_softcap=2.0),
                          ids, anc, DraftSpec("dflash", 4, (0,), 31), taps)[0]
    assert torch.equal(capped, torch.tanh(raw / 2.0) * 2.0) and capped.abs().max() < 2.0 < raw.abs().max()


def test_a_gemma4_dspark_drafter_with_a_raw_block_embedding_is_refused(setup, tmp_path):
    """Gemma4DSparkModel's block embedding is the target's rows scaled by √hidden (the engine's arm
    refuses --no-emb-scale on it): training one with raw rows is refused before any step, nothing written."""
    from memra_cli.tiny.gemma4 import make_tiny_gemma4

    _, _, prompts = setup
    target, out = make_tiny_gemma4(tmp_path / "gemma4", layout="multimodal", tokenizer=True), tmp_path / "out"
    _refused(train("--target", target, "--kind", "dspark", "--prompts", prompts, "--out", out, "--no-emb-scale"), out,
             "--no-emb-scale: a Gemma4DSparkModel drafter's block embedding is the target's rows scaled")


def _ranks_run(target: Path, out: Path, n: int) -> list[dict]:
    import os
    import subprocess
    import sys

    out.mkdir()
    worker = Path(__file__).with_name("train_ranks_worker.py")
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}",
                          str(worker), str(target), str(out)], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(n)]


@pytest.mark.exhaustive
def test_data_parallel_ranks_average_their_gradients_and_hold_one_drafter(setup, tmp_path):
    """Two ranks (gloo on the CPU), each on its own sequences: after every step both hold the same
    drafter, bit for bit (the averaged gradients), which is not what rank 0 trains alone; the
    token count is the group's."""
    _, target, _ = setup
    two = _ranks_run(target, tmp_path / "two", 2)
    alone = _ranks_run(target, tmp_path / "alone", 1)[0]
    for name, w in two[0]["drafter"].items():
        assert torch.equal(w, two[1]["drafter"][name]), name
    assert any(not torch.equal(w, alone["drafter"][name]) for name, w in two[0]["drafter"].items())
    assert two[0]["tokens"] == 2 * alone["tokens"] == 3 * 2 * 2 * 24  # steps x batch x ranks x length
