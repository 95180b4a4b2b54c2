"""The Gemma 4 target through the CLI: `python -m memra_cli.tiny OUT` writes a tiny Gemma 4 text
target (with the tiny tokenizer) and a z-lab DFlash drafter for it; `memra generate` / `memra bench`
run the pair and the speculative stream equals plain greedy (`--spec off`) token for token;
`memra census` reads the drafter; an MoE Gemma config routing more experts than it has and an
unknown layer type exit 2 with one `error:` line. The DeepSpec Gemma4DSparkModel drafter it writes
too goes through census, parity (`--make-oracle` and the check), generate and bench, with its
refusals."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from memra_cli.cli.app import app
from memra_cli.engine.greedy import greedy_reference
from memra_cli.engine.models.gemma4 import Gemma4Target
from memra_cli.tiny.__main__ import GEMMA4_DRAFT_TAPS, main as tiny_main

runner = CliRunner()
IDS = "5,17,42,99,3,250,7,8,9,10,11,12"  # longer than the tiny target's window of 8


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tinyg4")
    assert tiny_main([str(root)]) == 0
    return root / "gemma4", root / "gemma4_dflash"


def run(*args):
    return runner.invoke(app, [str(a) for a in args], env={})


def one_error_line(r) -> str:
    assert r.exit_code == 2, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    return lines[0]


def test_tiny_writes_the_gemma_pair(tiny):
    target, draft = tiny
    cfg = json.loads((target / "config.json").read_text())
    assert cfg["model_type"] == "gemma4_text" and (target / "tokenizer.json").is_file()
    dcfg = json.loads((draft / "config.json").read_text())
    assert dcfg["dflash_config"]["target_layer_ids"] == list(GEMMA4_DRAFT_TAPS)
    assert dcfg["num_target_layers"] == cfg["num_hidden_layers"] and dcfg["hidden_size"] == cfg["hidden_size"]


@pytest.mark.parametrize("width", [None, "variable"], ids=["default-16", "variable"])
def test_generate_spec_equals_plain(tiny, width):
    target, draft = tiny
    extra = ["--step-width", width] if width else []
    common = ["--target", target, "--draft", draft, "--prompt-ids", IDS, "--max-new", "40", "--json", *extra]
    spec, plain = run("generate", *common), run("generate", "--spec", "off", *common)
    assert spec.exit_code == 0 and plain.exit_code == 0, (spec.output, plain.output)
    s, p = json.loads(spec.stdout), json.loads(plain.stdout)
    assert s["mode"] == "dflash" and p["mode"] == "off"
    assert s["tokens"] == p["tokens"] and len(s["tokens"]) == 40
    assert s["tokens"] == greedy_reference(Gemma4Target.from_dir(target), [int(i) for i in IDS.split(",")], 40)


def test_generate_text_and_census(tiny):
    target, draft = tiny
    r = run("generate", "--target", target, "--draft", draft, "--prompt", "def fibonacci(n):", "--max-new", "12")
    assert r.exit_code == 0, r.output
    assert r.stderr.splitlines()[-1].startswith("[dflash] tokens=12 rounds=") and r.stdout.strip()
    c = run("census", draft, "--json")
    assert c.exit_code == 0, c.output
    assert json.loads(c.stdout)["target_layer_ids"] == list(GEMMA4_DRAFT_TAPS)


def test_bench_gate_passes(tiny, tmp_path):
    target, draft = tiny
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in ("def add(a, b):", "The quick brown fox")) + "\n")
    r = run("bench", "--target", target, "--draft", draft, "--prompts", prompts, "--max-new", "16", "--warmup", "0",
            "--arm", "dflash", "--json")
    assert r.exit_code == 0, r.output
    obj = json.loads(r.stdout)
    assert obj["exact"] is True and [a["name"] for a in obj["arms"]] == ["off", "plain", "dflash"]
    assert obj["arms"][2]["tokens"] == obj["arms"][0]["tokens"]


@pytest.mark.parametrize("change,want", [
    ({"enable_moe_block": True, "num_experts": 4, "top_k_experts": 8, "moe_intermediate_size": 16},
     "top_k_experts 8 is more than num_experts 4"),
    ({"layer_types": ["sliding_attention"] * 4 + ["bogus_attention"]},
     "layer_types has 'bogus_attention', a layer type Gemma 4 does not have"),
])
def test_bad_configs_are_one_error_line(tiny, tmp_path, change, want):
    target, _ = tiny
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in target.iterdir():
        (bad / f.name).symlink_to(f)
    cfg = {**json.loads((target / "config.json").read_text()), **change}
    (bad / "config.json").unlink()
    (bad / "config.json").write_text(json.dumps(cfg))
    line = one_error_line(run("generate", "--target", bad, "--prompt-ids", IDS, "--max-new", "4", "--spec", "off"))
    assert want in line and str(bad / "config.json") in line


def test_parity_reads_the_gemma_tables(tiny, tmp_path):
    """`memra parity --make-oracle` takes the noise rows and lm_head from a Gemma target (the raw
    embedding table; the multimodal checkpoint's under model.language_model.), and the drafter passes."""
    from memra_cli.tiny.gemma4 import make_tiny_gemma4

    target, draft = tiny
    mm = make_tiny_gemma4(tmp_path / "mm", layout="multimodal")
    for t in (target, mm):
        oracle = tmp_path / f"{t.name}.npz"
        made = run("parity", draft, "--make-oracle", oracle, "--target", t)
        assert made.exit_code == 0, made.output
        r = run("parity", draft, oracle, "--target", t)
        assert r.exit_code == 0 and "parity PASS" in r.stdout, r.output
    # a drafter whose hidden size differs from the target's: one error line
    from memra_cli.tiny.draft import make_tiny_draft

    narrow = make_tiny_draft(tmp_path / "narrow", "zlab", hidden=32, target_layer_ids=(-1, 1, 2), num_target_layers=5)
    line = one_error_line(run("generate", "--target", target, "--draft", narrow, "--prompt-ids", IDS, "--max-new", "4"))
    assert "drafter hidden_size 32" in line and "!= target hidden_size 64" in line


@pytest.fixture(scope="module")
def dspark(tiny):
    """The DeepSpec Gemma4DSparkModel drafter `python -m memra_cli.tiny` writes beside the target."""
    return tiny[0].parent / "gemma4_dspark"


def test_census_reports_the_gemma_dspark_drafter(dspark):
    r = run("census", dspark)
    assert r.exit_code == 0, r.output
    words = " ".join(r.stdout.split())  # the table wraps its cells
    assert "Gemma 4 layers (sandwich norms, layer_scalar, q/k/v norms, scaling 1.0, GELU-tanh, k_eq_v)" in words
    assert "[dspark] harvest=dspark" in r.stdout
    obj = json.loads(run("census", dspark, "--json").stdout)
    assert obj["backbone"] == "gemma4" and obj["kind"] == "dspark" and obj["head_dim"] == 32
    assert obj["gemma4"] == {"attention_k_eq_v": True, "final_logit_softcapping": 30.0, "notes": []}
    assert obj["rope"]["type"] == "proportional" and obj["rope"]["partial_rotary_factor"] == 0.25


def test_parity_makes_and_passes_the_gemma_dspark_oracle(tiny, dspark, tmp_path):
    target, _ = tiny
    oracle = tmp_path / "o.npz"
    made = run("parity", dspark, "--make-oracle", oracle, "--target", target)
    assert made.exit_code == 0, made.output
    assert "Gemma4RMSNorm/Gemma4TextMLP/Gemma4TextRotaryEmbedding" in made.stdout
    for dtype in ("float32", "bfloat16"):
        r = run("parity", dspark, oracle, "--target", target, "--dtype", dtype)
        assert r.exit_code == 0 and "parity PASS: 12/12 checks" in r.stdout, r.output


@pytest.mark.parametrize("extra", [[], ["--vt", "ladder", "--no-markov"], ["--step-width", "variable"]],
                         ids=["default", "ladder-no-markov", "variable"])
def test_generate_with_the_gemma_dspark_drafter_equals_plain(tiny, dspark, extra):
    target, _ = tiny
    common = ["--target", target, "--draft", dspark, "--prompt-ids", IDS, "--max-new", "32", "--json", *extra]
    spec, plain = run("generate", *common), run("generate", "--spec", "off", *common)
    assert spec.exit_code == 0 and plain.exit_code == 0, (spec.output, plain.output)
    s, p = json.loads(spec.stdout), json.loads(plain.stdout)
    assert s["mode"] == "dspark" and s["tokens"] == p["tokens"] and len(s["tokens"]) == 32
    text = run("generate", *[a for a in common if a != "--json"])
    assert ("[dspark] block-embedding=scaled x8 (the target's embed_scale; Gemma4DSparkModel's own embedding "
            "is scaled)") in text.stderr


def test_bench_runs_the_gemma_dspark_arm(tiny, dspark):
    target, _ = tiny
    r = run("bench", "--target", target, "--draft", dspark, "--prompts", "mbpp", "--n", "2", "--max-new", "12",
            "--warmup", "0", "--arm", "dspark", "--json")
    assert r.exit_code == 0, r.output
    obj = json.loads(r.stdout)
    assert obj["exact"] is True and obj["arms"][2]["tokens"] == obj["arms"][0]["tokens"]


def test_gemma_dspark_refusals_are_one_error_line(tiny, dspark, tmp_path):
    """A malformed Gemma 4 DSpark config (a sliding drafter layer), the drafter over a Qwen target and
    with --no-emb-scale: one `error:` line each, exit 2."""
    target, _ = tiny
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "model.safetensors").symlink_to(dspark / "model.safetensors")
    cfg = json.loads((dspark / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "layer_types": ["sliding_attention", "full_attention"]}))
    for args in (("census", bad), ("generate", "--target", target, "--draft", bad, "--prompt-ids", IDS)):
        line = one_error_line(run(*args))
        assert str(bad / "config.json") in line and "drafter's layers are all 'full_attention'" in line
    qwen = target.parent / "target"
    line = one_error_line(run("generate", "--target", qwen, "--draft", dspark, "--prompt-ids", IDS, "--max-new", "4"))
    assert "drafts for a Gemma 4 target, not model_type 'qwen3'" in line
    line = one_error_line(run("generate", "--target", target, "--draft", dspark, "--prompt-ids", IDS, "--no-emb-scale"))
    assert "--no-emb-scale" in line and "block embedding is scaled" in line


def test_quantize_writes_a_gguf_of_the_gemma_dspark_drafter_that_runs(tiny, dspark, tmp_path):
    """`memra quantize` over the Gemma 4 layer names (sandwich norms, layer_scalar, no v_proj): the
    GGUF's census is the source's, and generate with it equals plain greedy."""
    target, _ = tiny
    gguf = tmp_path / "d.gguf"
    q = run("quantize", dspark, "--out", gguf, "--policy", "q8")
    assert q.exit_code == 0, q.output
    c = json.loads(run("census", gguf, "--json").stdout)
    assert c["backbone"] == "gemma4" and c["n_tensors"] == json.loads(run("census", dspark, "--json").stdout)["n_tensors"]
    common = ["--target", target, "--prompt-ids", IDS, "--max-new", "24", "--json"]
    spec, plain = run("generate", "--draft", gguf, *common), run("generate", "--spec", "off", *common)
    assert spec.exit_code == 0, spec.output
    assert json.loads(spec.stdout)["tokens"] == json.loads(plain.stdout)["tokens"]
