"""`memra census` on what is not a drafter checkpoint says what it is and what was expected:
a lone weights file names its directory; a target model directory is called a target."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from memra_cli.cli.app import app

runner = CliRunner()
ASSETS = Path(__file__).resolve().parents[2] / "memra_cli" / "assets"


def _one_error(args: list) -> str:
    r = runner.invoke(app, [str(a) for a in args])
    assert r.exit_code == 2, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_a_single_safetensors_file_names_its_checkpoint_directory():
    weights = ASSETS / "dspark" / "model.safetensors"
    assert _one_error(["census", weights]) == (
        f"error: {weights}: expected a drafter checkpoint directory (config.json + safetensors) or a memra .gguf "
        f"file; for this file's checkpoint give its directory {weights.parent}")


def test_a_target_directory_is_called_a_target(tmp_path):
    line = _one_error(["census", ASSETS / "target"])
    assert line == (f"error: {ASSETS / 'target' / 'config.json'}: a target model (Qwen3ForCausalLM, model_type 'qwen3'), "
                    "not a drafter (a drafter's config.json has block_size and mask_token_id); give it as --target")
    assert "block_size' is missing" not in line
