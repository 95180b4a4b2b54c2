"""`memra serve` through the official `openai` client, on the CPU, in-process on a loopback port:
every response equals `memra generate`'s for the same prompt and settings (greedy and seeded,
streamed or not, completions and chat), alone or beside 7 other clients; a client that leaves
frees its session; bad requests get OpenAI-shaped 400s and the server keeps serving."""

from __future__ import annotations

import gc
import json
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

import torch  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from memra_cli.cli.app import app  # noqa: E402
from memra_cli.engine.api import ArmConfig, Engine, EngineConfig  # noqa: E402
from memra_cli.engine.defaults import default_models  # noqa: E402
from memra_cli.serve.app import ServerThread, Served, build_app  # noqa: E402
from memra_cli.tiny.draft import make_tiny_draft  # noqa: E402
from memra_cli.tiny.target import make_tiny_qwen3  # noqa: E402

runner = CliRunner()
NAME = "memra-embedded"
LONG = 3500  # tokens: seconds of decoding on a CPU, so the client leaves long before the end
PROMPTS = ["def fibonacci(n):", "import os\n\ndef walk(", "class Stack:\n    def push(self, x):",
           "def parse_args(argv):", "    return sorted(", "def gcd(a, b):", "# read a file\n", "def main():\n"]


def _serve(target: Path, draft: Path | None, name: str, draft_vocab: Path | None = None, **kw):
    with torch.inference_mode():
        engine = Engine.load(EngineConfig(target=target, device="cpu"))
        arm = engine.arm(ArmConfig(draft=draft, draft_vocab=draft_vocab))
    served = Served.load(engine, arm, target, name=name, max_tokens=kw.pop("max_tokens", 64), **kw)
    return served, ServerThread(build_app(served))


@pytest.fixture(scope="module")
def embedded():
    target, draft, _ = default_models(None, None, "auto")
    served, server = _serve(target, draft, NAME, max_tokens=LONG)
    with server as url:
        yield served, url, openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


def generate(*args) -> dict:
    """`memra generate --json` in-process: what the server must give."""
    r = runner.invoke(app, ["generate", *map(str, args), "--json"])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def _streamed(stream) -> tuple[str, list]:
    chunks = list(stream)
    text = "".join((c.choices[0].delta.content or "") if c.object == "chat.completion.chunk" else c.choices[0].text
                   for c in chunks if c.choices)
    return text, chunks


SAMPLED = {"temperature": 0.8, "top_p": 0.95, "seed": 1234}
CASES = [pytest.param({"temperature": 0}, id="greedy"), pytest.param(SAMPLED, id="seeded")]


def _flags(sampling: dict) -> list[str]:
    return [x for k, v in sampling.items() for x in (f"--{k.replace('_', '-')}", v)]


@pytest.mark.parametrize("sampling", CASES)
def test_completions_equal_generate(embedded, sampling):
    served, url, client = embedded
    want = generate("--prompt", PROMPTS[0], "--max-new", 40, *_flags(sampling))
    r = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=40, **sampling)
    assert r.choices[0].text == want["text"]
    assert r.choices[0].finish_reason == ("length" if len(want["tokens"]) == 40 else "stop")
    assert r.usage.completion_tokens == len(want["tokens"]) and r.usage.prompt_tokens == len(served.codec.encode(PROMPTS[0]))
    stats = r.usage.model_extra["memra"]  # the same rounds: the same program ran the same stream
    assert stats["mode"] == want["mode"] == "dspark"
    assert (stats["rounds"], stats["accepted"], stats["drafted"]) == tuple(want["stats"][k] for k in ("rounds", "accepted", "drafted"))
    assert stats["seed"] == sampling.get("seed")
    text, chunks = _streamed(client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=40, stream=True,
                                                       stream_options={"include_usage": True}, **sampling))
    assert text == want["text"]
    assert chunks[-1].usage.completion_tokens == len(want["tokens"]) and not chunks[-1].choices


def test_token_id_prompts_and_an_unseeded_sample_reports_its_seed(embedded):
    served, url, client = embedded
    want = generate("--prompt-ids", "5,17,42,99", "--max-new", 12, "--temperature", 0)
    r = client.completions.create(model=NAME, prompt=[5, 17, 42, 99], max_tokens=12, temperature=0)
    assert r.choices[0].text == want["text"]
    first = client.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=12)  # OpenAI's default: temperature 1
    seed = first.usage.model_extra["memra"]["seed"]
    assert isinstance(seed, int)
    again = client.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=12, temperature=1, seed=seed)
    assert again.choices[0].text == first.choices[0].text  # the reported seed repeats the request exactly


def test_stop_cuts_before_the_stop_string(embedded):
    served, url, client = embedded
    full = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=40, temperature=0).choices[0].text
    stop = full[12:15]
    cut = full[:full.index(stop)]
    r = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=40, temperature=0, stop=[stop, "@@@"])
    assert (r.choices[0].text, r.choices[0].finish_reason) == (cut, "stop")
    text, chunks = _streamed(client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=40, temperature=0,
                                                       stop=stop, stream=True))
    assert text == cut and chunks[-1].choices[0].finish_reason == "stop"


def test_eight_concurrent_clients_each_get_their_solo_stream(embedded):
    served, url, client = embedded
    requests = [dict(prompt=p, max_tokens=24 + 4 * i, **(SAMPLED | {"seed": i} if i % 2 else {"temperature": 0}))
                for i, p in enumerate(PROMPTS)]
    solo = [client.completions.create(model=NAME, **r).choices[0].text for r in requests]
    start = threading.Barrier(len(requests))

    def one(r):
        start.wait()
        return _streamed(client.completions.create(model=NAME, stream=True, **r))[0]

    before = served.worker.rounds
    with ThreadPoolExecutor(len(requests)) as pool:
        together = list(pool.map(one, requests))
    assert together == solo
    assert served.worker.rounds > before


def _leave_mid_stream(url: str, served, stream: bool = True) -> weakref.ref:
    """Open a long request, read its first event (not streamed: wait a moment), hang up; wait
    until the worker has let go. Checks that the session was closed long before its end;
    returns a weak reference to it."""
    opened = []
    open_session = served.worker.open_session
    served.worker.open_session = lambda job: opened.append(open_session(job)) or opened[-1]
    body = {"model": NAME, "prompt": PROMPTS[2], "max_tokens": LONG, "temperature": 0, "stream": stream}
    try:
        if stream:
            with httpx.Client(timeout=30) as http, http.stream("POST", url + "/v1/completions", json=body) as r:
                assert r.status_code == 200
                first = next(r.iter_lines())  # the first event: the request is in; the worker takes it from its
                until = time.monotonic() + 5  # queue on its own thread (a loaded CPU may take a moment)
                while not served.worker.live and time.monotonic() < until:
                    time.sleep(0.005)
                if not served.worker.live:  # say how the request ended: the events after the first
                    rest = [line[:300] for _, line in zip(range(4), r.iter_lines())]
                    pytest.fail(f"no live session after the first event {first[:200]!r}; then {rest!r}")
        else:
            with pytest.raises(httpx.ReadTimeout), httpx.Client(timeout=httpx.Timeout(30, read=0.5)) as http:
                http.post(url + "/v1/completions", json=body)  # the client gives up after 0.5 s and hangs up
    finally:
        served.worker.open_session = open_session
    session = opened.pop()
    deadline = time.monotonic() + 20
    while (served.worker.live or not session._released) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert session._released and len(session.tokens) < LONG  # closed, not run to its end
    return weakref.ref(session)


def test_a_client_that_leaves_mid_stream_frees_its_session(embedded):
    """Closed long before its end and dropped: on the CPU its storages are freed with it; with CUDA
    graphs they go back to the pool, which then holds what it held before (no leak)."""
    served, url, client = embedded
    pool = served.engine.pool
    session = _leave_mid_stream(url, served)
    assert not served.worker.live and pool.live_count == 0
    gc.collect()
    assert session() is None  # nothing holds the session (or its KV cache) any more
    idle = pool.idle_bytes
    session = _leave_mid_stream(url, served)
    gc.collect()
    assert session() is None and pool.live_count == 0 and pool.idle_bytes == idle
    health = httpx.get(url + "/health").json()
    assert (health["live"], health["waiting"], health["pool_live_storages"]) == (0, 0, 0)
    session = _leave_mid_stream(url, served, stream=False)  # a non-streamed request's client, too
    gc.collect()
    assert session() is None and pool.live_count == 0
    assert client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=4, temperature=0).choices[0].text


BAD = [
    ({"model": "nope", "prompt": "x"}, "model", "model_not_found"),
    ({"model": NAME, "prompt": "x", "max_tokens": -1}, "max_tokens", "invalid_value"),
    ({"model": NAME, "prompt": "x", "temperature": 3}, "temperature", "invalid_value"),
    ({"model": NAME, "prompt": "x", "top_p": 0}, "top_p", "invalid_value"),
    ({"model": NAME, "prompt": "x", "n": 2}, "n", "unsupported_parameter"),
    ({"model": NAME, "prompt": "x", "max_tokens": LONG + 1}, "max_tokens", "invalid_value"),
    ({"model": NAME, "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop", "invalid_value"),
    ({"model": NAME, "prompt": [5] * 4090, "max_tokens": 10}, "prompt", "context_length_exceeded"),
    ({"model": NAME, "prompt": [10 ** 9]}, "prompt", "invalid_value"),
    ({"model": NAME, "prompt": ""}, "prompt", "invalid_value"),
    ({"model": NAME}, "prompt", "invalid_value"),
]


@pytest.mark.parametrize("stream", [False, True])
def test_bad_requests_are_openai_shaped_400s_and_the_server_keeps_serving(embedded, stream):
    served, url, client = embedded
    with httpx.Client(timeout=30) as http:
        for body, param, code in BAD:
            r = http.post(url + "/v1/completions", json=body | {"stream": stream})
            assert r.status_code == 400 and r.headers["content-type"] == "application/json", (body, r.text)
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["message"], err
            assert (err["type"], err["param"], err["code"]) == ("invalid_request_error", param, code), (body, err)
        r = http.post(url + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
        r = http.post(url + "/v1/chat/completions", json={"model": NAME, "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 400 and r.json()["error"]["code"] == "no_chat_template"  # the embedded target is raw code
        assert "no chat template" in r.json()["error"]["message"]
        assert http.get(url + "/v1/nothing").status_code == 404
        health = http.get(url + "/health").json()
        assert health["status"] == "ok" and health["live"] == 0 and health["pool_live_storages"] == 0
    with pytest.raises(openai.BadRequestError) as exc:  # the client sees the same body
        client.completions.create(model=NAME, prompt="x", max_tokens=-1)
    assert exc.value.body["param"] == "max_tokens"
    assert client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=3, temperature=0).usage.completion_tokens == 3


def test_models_lists_the_served_name(embedded):
    served, url, client = embedded
    assert [m.id for m in client.models.list().data] == [NAME]


# --------------------------------------------------------------------------- chat


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat")
    target = make_tiny_qwen3(root / "target", tokenizer=True)  # with a chat template
    draft = make_tiny_draft(root / "dspark", "deepspec", markov_rank=16, confidence="markov", target_layer_ids=(-1, 1, 3))
    served, server = _serve(target, draft, "tiny")
    with server as url:
        yield target, draft, openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.mark.parametrize("sampling", CASES)
def test_chat_completions_equal_generate_chat(chat, sampling):
    target, draft, client = chat
    want = generate("--target", target, "--draft", draft, "--chat", "--prompt", "def fibonacci(n):", "--max-new", 16,
                    *_flags(sampling))
    messages = [{"role": "user", "content": "def fibonacci(n):"}]
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=16, **sampling)
    assert r.choices[0].message.content == want["text"] and r.choices[0].message.role == "assistant"
    assert r.usage.completion_tokens == len(want["tokens"])
    text, chunks = _streamed(client.chat.completions.create(model="tiny", messages=messages, max_tokens=16, stream=True,
                                                            **sampling))
    assert text == want["text"] and chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")


def test_a_draft_vocabulary_serves_greedy_requests_and_refuses_sampled_ones(tmp_path):
    """`memra serve --draft-vocab`: a greedy completion equals `memra generate --draft-vocab`'s (the
    same stream as plain greedy, the same rounds), and a sampled one is a 400 naming temperature
    (a draft vocabulary drafts greedily only); the server keeps serving."""
    target, draft, _ = default_models(None, None, "auto")
    vocab = tmp_path / "vocab.json"
    vocab.write_text(json.dumps(list(range(0, 4096, 2))))  # half the embedded vocabulary
    want = generate("--prompt", PROMPTS[0], "--max-new", 24, "--draft-vocab", vocab)
    plain = generate("--prompt", PROMPTS[0], "--max-new", 24, "--spec", "off")
    assert want["tokens"] == plain["tokens"]
    served, server = _serve(target, draft, NAME, draft_vocab=vocab)
    assert served.drafts_from_vocab
    with server as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        r = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=24, temperature=0)
        assert r.choices[0].text == want["text"]
        stats = r.usage.model_extra["memra"]
        assert (stats["rounds"], stats["accepted"]) == (want["stats"]["rounds"], want["stats"]["accepted"])
        with pytest.raises(openai.BadRequestError) as exc:
            client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=4, **SAMPLED)
        assert exc.value.body["param"] == "temperature" and "draft vocabulary" in exc.value.body["message"]
        with pytest.raises(openai.BadRequestError):  # OpenAI's default temperature is 1: sampled too
            client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=4)
        assert client.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=3, temperature=0).usage.completion_tokens == 3


def test_past_the_queue_a_request_gets_a_429(tmp_path):
    """One request at a time and none waiting: a second one while the first runs is refused
    with an OpenAI-shaped 429, and served once the first is done."""
    target, draft, _ = default_models(None, None, "auto")
    served, server = _serve(target, draft, NAME, max_tokens=LONG, max_live=1, max_waiting=0)
    # the first request holds its place until the second was answered: its session's first
    # round waits for this event, so how fast the machine decodes cannot end it early
    release, opened = threading.Event(), served.worker.open_session

    def held_session(job):
        session = opened(job)
        burst = session.burst

        def held_burst(n):
            release.wait(30)
            return burst(n)

        session.burst = held_burst
        return session

    served.worker.open_session = held_session
    with server as url, httpx.Client(timeout=30) as http:
        body = {"model": NAME, "prompt": PROMPTS[2], "max_tokens": LONG, "temperature": 0, "stream": True}
        with http.stream("POST", url + "/v1/completions", json=body) as first:
            deadline = time.monotonic() + 20
            while not served.worker.pending and time.monotonic() < deadline:  # admitted, held
                time.sleep(0.01)
            r = http.post(url + "/v1/completions", json={"model": NAME, "prompt": "x", "max_tokens": 2})
            release.set()
            assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full", r.text
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}
            assert any(line for line in first.iter_lines())  # and the first is served in full
        served.worker.open_session = opened
        deadline = time.monotonic() + 20
        while served.worker.pending and time.monotonic() < deadline:
            time.sleep(0.01)
        r = http.post(url + "/v1/completions", json={"model": NAME, "prompt": "x", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_a_server_whose_model_thread_cannot_start_says_why(monkeypatch):
    """The worker's setup raising (here: the device refused) stops the server's start with the
    reason, instead of a server that accepts requests nobody runs."""
    import contextlib

    from memra_cli.serve import app as serve_app

    @contextlib.contextmanager
    def refused(device, threads):
        raise ValueError(f"cannot use {device}")
        yield  # pragma: no cover

    monkeypatch.setattr(serve_app, "_model_thread", refused)
    target, draft, _ = default_models(None, None, "auto")
    served, server = _serve(target, draft, NAME)
    with pytest.raises(RuntimeError, match=r"did not start: the model thread failed \(ValueError: cannot use cpu\)"):
        with server:
            pass
    server.__exit__(None, None, None)
