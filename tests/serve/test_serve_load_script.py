"""benchmarks/serve_load.py on a tiny CPU run: the load part completes every request with every
stream equal to plain decoding, and the single-client part reports its three arms."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("openai")
pytest.importorskip("uvicorn")

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "serve_load.py"


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("serve_load", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_load_part(script, capsys):
    code = script.main(["load", "--requests", "8", "--clients", "4", "--max-tokens", "12", "--n-prompts", "3",
                        "--prompts", "mbpp", "--device", "cpu", "--json"])
    r = json.loads(capsys.readouterr().out)
    assert code == 0 and (r["requests"], r["completed"], r["errors"], r["inexact"]) == (8, 8, 0, 0), r
    assert 0 < r["latency_p50_s"] <= r["latency_p99_s"] and r["completion_tokens"] > 0 and r["tok_per_s"] > 0


def test_single_part(script, capsys):
    code = script.main(["single", "--requests", "2", "--max-tokens", "8", "--prompts", "mbpp", "--device", "cpu",
                        "--json"])
    r = json.loads(capsys.readouterr().out)
    assert code == 0 and r["requests"] == 2 and set(r["median_tok_per_s"]) == {"server", "generate", "session"}
    assert all(v > 0 for v in r["median_tok_per_s"].values()) and r["server_over_generate"] > 0


def test_bad_counts_are_refused(script, capsys):
    with pytest.raises(SystemExit) as exc:
        script.main(["load", "--clients", "0"])
    assert exc.value.code == 2 and "--clients 0: expected an integer >= 1" in capsys.readouterr().err
