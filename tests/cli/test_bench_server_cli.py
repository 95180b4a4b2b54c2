"""`memra bench --server URL`: a server measured on memra's prompt sets, gated on memra's plain
decoding; against `memra serve` itself (exact), against a stand-in server that answers other
text (the gate fails, exit 1), and refusals in one line."""

from __future__ import annotations

import json
import socket

import pytest
from typer.testing import CliRunner

pytest.importorskip("httpx")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

import torch  # noqa: E402
from starlette.applications import Starlette  # noqa: E402
from starlette.responses import JSONResponse, StreamingResponse  # noqa: E402
from starlette.routing import Route  # noqa: E402

from memra_cli.cli.app import app  # noqa: E402
from memra_cli.engine.api import ArmConfig, Engine, EngineConfig  # noqa: E402
from memra_cli.engine.defaults import default_models  # noqa: E402
from memra_cli.serve.app import ServerThread, Served, build_app  # noqa: E402

runner = CliRunner()
BENCH = ["bench", "--prompts", "mbpp", "--n", "3", "--max-new", "16", "--warmup", "1"]


@pytest.fixture(scope="module")
def memra_server():
    target, draft, _ = default_models(None, None, "auto")
    with torch.inference_mode():
        engine = Engine.load(EngineConfig(target=target, device="cpu"))
        arm = engine.arm(ArmConfig(draft=draft))
    with ServerThread(build_app(Served.load(engine, arm, target, name="memra-embedded", max_tokens=64))) as url:
        yield url


def test_memra_serve_is_exact_and_measured(memra_server):
    r = runner.invoke(app, BENCH + ["--server", memra_server, "--json"])
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)
    (arm,) = report["servers"]
    assert report["exact"] and arm["exact"] and arm["exact_prompts"] == arm["n_prompts"] == 3 and not arm["mismatches"]
    assert arm["model"] == "memra-embedded" and arm["tok_per_s"] > 0 and arm["ttft_ms_p50"] > 0
    assert arm["tokens"] == report["reference"]["tokens"]  # the same streams, token counts included
    r = runner.invoke(app, BENCH + ["--server", memra_server + "/v1", "--model", "memra-embedded"])
    assert r.exit_code == 0, r.output
    assert "memra-embedded" in r.stdout and "ref" in r.stdout and "yes" in r.stdout


def _stand_in(text: str) -> Starlette:
    """An OpenAI-compatible server that answers every completion with `text`."""

    async def models(_):
        return JSONResponse({"object": "list", "data": [{"id": "other", "object": "model"}]})

    async def completions(_):
        async def events():
            yield f"data: {json.dumps({'choices': [{'index': 0, 'text': text}]})}\n\n"
            yield f"data: {json.dumps({'choices': [], 'usage': {'completion_tokens': 1}})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/models", models), Route("/v1/completions", completions, methods=["POST"])])


def test_a_server_that_answers_other_text_fails_the_gate():
    with ServerThread(_stand_in("nope")) as url:
        r = runner.invoke(app, BENCH + ["--server", url, "--json"])
        assert r.exit_code == 1, r.output
        (arm,) = json.loads(r.stdout)["servers"]
        assert not arm["exact"] and arm["exact_prompts"] == 0 and len(arm["mismatches"]) == 3
        assert arm["model"] == "other" and arm["mismatches"][0]["got"] == "nope"
        assert "EXACTNESS GATE FAILED" in r.stderr
        r = runner.invoke(app, BENCH + ["--server", url, "--model", "missing"])
        assert r.exit_code == 2 and r.stderr.strip() == (
            f"error: --server {url}: --model 'missing' is not served there (it lists other)"), r.output


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("args, start", [
    (["--model", "x"], "error: --model applies to --server"),
    (["--server", "http://127.0.0.1:1", "--arm", "dspark"], "error: --arm with --server: a server arm runs greedy"),
    (["--server", "http://127.0.0.1:1", "--temperature", "0.5"], "error: --temperature with --server"),
    (["--server", "localhost:8000"], "error: --server localhost:8000: expected an http:// or https:// URL"),
    (["--server", "http://127.0.0.1:{port}"], "error: --server http://127.0.0.1:{port}: no answer (ConnectError"),
])
def test_refusals_are_one_line(args, start):
    port = _closed_port()
    args = [a.format(port=port) for a in args]
    r = runner.invoke(app, BENCH + args)
    lines = r.stderr.strip().splitlines()
    assert r.exit_code == 2 and len(lines) == 1 and lines[-1].startswith(start.format(port=port)), r.output
