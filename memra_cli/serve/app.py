"""`memra serve`'s HTTP side: an OpenAI-compatible ASGI app (Starlette) over one loaded engine.

    served = Served.load(engine, arm, name="memra", max_tokens=1024)
    app = build_app(served)            # /v1/models, /v1/completions, /v1/chat/completions, /health
    with ServerThread(app, "127.0.0.1", 0) as url: ...   # tests, the load script: in-process

Per request: the body is validated, tokenized (chat: through the target's chat template) and
checked against the context before anything runs, so a refusal is one whole 400 and nothing
half-sent; then one job goes to the worker (`worker.py`), which owns every session. Text is
decoded incrementally from the committed ids (an EOS ends the stream and is not text) and cut
before the first stop string. A client that goes away (mid-stream, or while a non-streamed
response is computed) cancels its job: the worker closes the session and its storages return
to the pool.
"""

from __future__ import annotations

import json
import secrets
import threading
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Optional

import anyio
from starlette.applications import Starlette
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from memra_cli.engine.errors import MemraError, PromptError
from memra_cli.serve.protocol import (
    COMPLETION_DEFAULT_MAX_TOKENS, ApiError, Request, StopMatcher, chunk, completion, new_id, parse_request, usage,
)
from memra_cli.serve.worker import Job, QueueFull, Worker, WorkerFailed


@dataclass
class Served:
    """The model a server serves: the loaded engine and arm, its tokenizer, its name, limits and worker."""

    name: str
    engine: Any  # engine.api.Engine
    arm: Any  # engine.api.Arm
    codec: Any  # engine.text.TextCodec
    max_tokens: int  # the most a request may ask for; a chat request's default
    worker: Worker

    @classmethod
    def load(cls, engine, arm, target: Path, *, name: str, max_tokens: int, max_live: int = 16,
             max_waiting: int = 64) -> "Served":
        """Around a loaded engine and arm (`Engine.load`, `engine.arm`) of the target directory
        `target`: its tokenizer, and a worker (not started: `build_app`'s lifespan starts and
        stops it) that runs at the engine's CPU thread choice (`engine.threads`)."""
        from memra_cli.engine.text import TextCodec

        codec = TextCodec(Path(target))
        served = cls(name, engine, arm, codec, max_tokens, None)  # type: ignore[arg-type]
        device = indexed_device(engine.device)  # resolved here, on the thread that loaded the engine
        served.worker = Worker(served._open, lambda: _model_thread(device, engine.threads), max_live=max_live,
                               max_waiting=max_waiting)
        return served

    @property
    def context(self) -> int:
        return self.engine.target.cfg.max_position_embeddings

    @property
    def eos(self) -> set[int]:
        return set(self.engine.target.cfg.eos_token_ids)

    def _open(self, job: Job):
        """The job's session (on the worker thread)."""
        return self.engine.session(job.prompt_ids, job.max_new, self.arm, sampler=job.sampler)

    def prompt_ids(self, req: Request) -> list[int]:
        """The request's prompt as token ids (chat: the messages through the target's template)."""
        if req.chat:
            if not isinstance(self.codec.template, str):
                raise ApiError(f"model {self.name!r} has no chat template (its target directory has no chat_template "
                               "in tokenizer_config.json, nor a chat_template.jinja): use /v1/completions with a "
                               "prompt", param="messages", code="no_chat_template")
            try:
                return self.codec.encode(self.codec.render_chat(req.messages))
            except PromptError as exc:
                raise ApiError(str(exc), param="messages", code="invalid_value") from None
        if isinstance(req.prompt, str):
            return self.codec.encode(req.prompt)
        return list(req.prompt)  # type: ignore[arg-type]

    def max_new(self, req: Request, n_prompt: int) -> int:
        """`max_tokens` as asked (at most the server's limit), else the endpoint's default:
        OpenAI's 16 for a completion, the rest of the context (up to the limit) for a chat."""
        if req.max_tokens is not None:
            if req.max_tokens > self.max_tokens:
                raise ApiError(f"max_tokens={req.max_tokens}: this server allows at most {self.max_tokens} "
                               "(memra serve --max-tokens)", param="max_tokens", code="invalid_value")
            return req.max_tokens
        if not req.chat:
            return min(COMPLETION_DEFAULT_MAX_TOKENS, self.max_tokens)
        return max(0, min(self.max_tokens, self.context - n_prompt))

    def check(self, req: Request, ids: list[int], max_new: int) -> None:
        """The engine's prompt checks (empty, ids outside the vocabulary, past the context), as 400s."""
        if len(ids) + max_new > self.context:
            raise ApiError(f"this model's context is {self.context} tokens; the prompt is {len(ids)} tokens and "
                           f"max_tokens {max_new}: {len(ids) + max_new} in all", param=req.prompt_param,
                           code="context_length_exceeded")
        try:
            self.engine.check_prompt(ids, max_new)
        except MemraError as exc:
            raise ApiError(str(exc), param=req.prompt_param, code="invalid_value") from None

    def sampler(self, req: Request):
        """(the request's sampler, the seed a sampled request runs with, or None when greedy).
        OpenAI's defaults: temperature 1; an unseeded sampled request gets a fresh seed, which
        `usage.memra.seed` reports so that the request can be repeated exactly."""
        from memra_cli.engine.errors import SettingError
        from memra_cli.engine.spec.keyed import SamplingParams, make_sampler

        kw = {"temperature": 1.0, **req.sampling}
        if kw["temperature"] > 0 and "seed" not in kw:
            kw["seed"] = secrets.randbits(63)
        try:
            params = SamplingParams(**kw)
        except SettingError as exc:
            raise ApiError(str(exc), param=exc.setting, code="invalid_value") from None
        if params.temperature > 0 and self.drafts_from_vocab:
            raise ApiError(f"temperature={params.temperature:g}: this server drafts from a draft vocabulary (memra serve "
                           "--draft-vocab), which drafts greedily only: send temperature 0", param="temperature",
                           code="invalid_value")
        return make_sampler(params), params.applied_seed

    @property
    def drafts_from_vocab(self) -> bool:
        """Whether the arm drafts from a draft vocabulary (greedy requests only)."""
        return self.arm.program is not None and self.arm.program.vocab is not None


def indexed_device(device, current_index=None):
    """`device` with its index: a bare `cuda` is the device current on the calling thread
    (`current_index()`, torch's by default), which a new thread does not inherit."""
    import torch

    if device.type != "cuda" or device.index is not None:
        return device
    return torch.device("cuda", (current_index or torch.cuda.current_device)())


@contextmanager
def _model_thread(device, threads):
    """The worker thread's lifetime: inference mode, the engine's CUDA device (an indexed one:
    `indexed_device`) as the current one, and the engine's CPU thread choice (all three are
    per-thread settings)."""
    import torch

    from memra_cli.engine.threads import applied

    if device.type == "cuda":
        torch.cuda.set_device(device)
    with torch.inference_mode(), applied(threads):
        yield


# --------------------------------------------------------------------------- one request


@dataclass
class _Run:
    """A submitted request and what its response needs."""

    req: Request
    job: Job
    rid: str
    n_prompt: int
    seed: Optional[int]


class _Text:
    """Committed ids -> the response's text deltas: EOS dropped, decoded incrementally, cut at a stop."""

    def __init__(self, served: Served, stops: tuple[str, ...]):
        from memra_cli.engine.text import StreamDecoder

        self.served, self.decoder, self.stops = served, StreamDecoder(served.codec), StopMatcher(stops)
        self.eos, self.tokens, self.ended_by_eos = served.eos, 0, False

    def push(self, ids: list[int]) -> str:
        self.tokens += len(ids)
        self.ended_by_eos = self.ended_by_eos or any(t in self.eos for t in ids)
        return self.stops.push(self.decoder.push([t for t in ids if t not in self.eos]))

    def finish(self) -> str:
        """What the decoder held back (a last incomplete character), then what the stop check held."""
        whole = self.served.codec.decode(self.decoder.ids)
        return self.stops.push(whole[len(self.decoder.printed):]) + ("" if self.stops.stopped else self.stops.flush())

    @property
    def finish_reason(self) -> str:
        return "stop" if self.stops.stopped or self.ended_by_eos else "length"


def _stats(served: Served, stats, seed: Optional[int]) -> dict:
    """usage.memra: the speculative program's stats for this request."""
    spec = served.arm.mode != "off"
    return {"mode": served.arm.mode, "rounds": stats.rounds, "drafted": stats.drafted, "accepted": stats.accepted,
            "tau": stats.tau if stats.rounds else None, "acceptance": stats.acceptance if spec and stats.drafted else None,
            "seed": seed}


async def _events(run: _Run) -> AsyncIterator[tuple[str, Any]]:
    """The job's events until it ends (its caller cancels the job when it stops reading early).
    Rounds that queued up while the client's side was busy come as one: one text delta, one
    event sent, however far the worker got ahead."""
    queue = run.job.events
    while True:
        kind, value = await queue.get()
        while kind == "tokens" and not queue.empty():
            later_kind, later = queue.get_nowait()
            if later_kind != "tokens":
                yield kind, value
                kind, value = later_kind, later
                break
            value = value + later
        yield kind, value
        if kind != "tokens":
            return


def _sse(obj: dict | str) -> bytes:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n".encode()


async def _stream_body(served: Served, run: _Run) -> AsyncIterator[bytes]:
    req, text, stats = run.req, _Text(served, run.req.stop), None
    if req.chat:
        yield _sse(chunk(req, run.rid, None, None, first=True))
    async for kind, value in _events(run):
        if kind == "error":
            yield _sse({"error": {"message": value, "type": "server_error", "param": None, "code": None}})
            return
        if kind == "done":
            stats = value
            break
        delta = text.push(value)
        if delta:
            yield _sse(chunk(req, run.rid, delta, None))
        if text.stops.stopped:
            break
    served.worker.cancel(run.job)  # after a stop string: the rest is not needed (a no-op once it ended)
    tail = text.finish()
    yield _sse(chunk(req, run.rid, tail or None, text.finish_reason))
    if req.include_usage:
        extra = _stats(served, stats, run.seed) if stats is not None else {"mode": served.arm.mode, "seed": run.seed}
        yield _sse(chunk(req, run.rid, None, None, use=usage(run.n_prompt, text.tokens, extra)))
    yield _sse("[DONE]")


class EventStream(Response):
    """Server-sent events whose body stops, and whose job is cancelled, as soon as the client
    disconnects (a listener runs beside the body whatever the server's ASGI version)."""

    media_type = "text/event-stream"

    def __init__(self, body: AsyncIterator[bytes], on_disconnect):
        self.status_code, self.background = 200, None
        self.init_headers({"Cache-Control": "no-cache"})  # no body attribute: no Content-Length (a stream)
        self.body_iter, self.on_disconnect = body, on_disconnect

    async def __call__(self, scope, receive, send) -> None:
        async with anyio.create_task_group() as tg:
            async def pump() -> None:
                try:
                    await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
                    async for part in self.body_iter:
                        await send({"type": "http.response.body", "body": part, "more_body": True})
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
                except OSError:  # the client is gone
                    self.on_disconnect()
                tg.cancel_scope.cancel()

            tg.start_soon(pump)
            await _until_disconnect(receive)
            self.on_disconnect()
            tg.cancel_scope.cancel()


async def _until_disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _collect(served: Served, run: _Run, http: HttpRequest) -> Optional[dict]:
    """A non-streamed response, or None when the client left first (its job is cancelled)."""
    result: dict = {}

    async def compute() -> None:
        text, stats, parts = _Text(served, run.req.stop), None, []
        async for kind, value in _events(run):
            if kind == "error":
                result["error"] = value
                return
            if kind == "done":
                stats = value
                break
            parts.append(text.push(value))
            if text.stops.stopped:
                break
        served.worker.cancel(run.job)  # after a stop string: the rest is not needed (a no-op once it ended)
        parts.append(text.finish())
        extra = _stats(served, stats, run.seed) if stats is not None else {"mode": served.arm.mode, "seed": run.seed}
        result["body"] = completion(run.req, run.rid, "".join(parts), text.finish_reason,
                                    usage(run.n_prompt, text.tokens, extra))

    async with anyio.create_task_group() as tg:
        async def watch() -> None:
            await _until_disconnect(http.receive)
            served.worker.cancel(run.job)
            tg.cancel_scope.cancel()

        tg.start_soon(watch)
        await compute()
        tg.cancel_scope.cancel()
    if "error" in result:
        raise ApiError(result["error"], status=500, type="server_error")
    return result.get("body")


# --------------------------------------------------------------------------- routes


def _error(exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


async def _submit(served: Served, http: HttpRequest, chat: bool) -> _Run:
    """Everything that can refuse a request, before anything runs: body, fields, prompt, limits, queue."""
    raw = await http.body()
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise ApiError(f"the request body is not valid JSON ({exc})", code="invalid_json") from None
    req = parse_request(body, chat=chat, models=(served.name,))
    ids = served.prompt_ids(req)
    max_new = served.max_new(req, len(ids))
    served.check(req, ids, max_new)
    sampler, seed = served.sampler(req)
    job = Job(ids, max_new, sampler, loop=_running_loop())
    try:
        served.worker.submit(job)
    except QueueFull as exc:
        raise ApiError(f"{exc}; retry later", status=429, type="server_busy", code="queue_full") from None
    except WorkerFailed as exc:
        raise ApiError(str(exc), status=503, type="server_error", code="worker_failed") from None
    return _Run(req, job, new_id(chat), len(ids), seed)


def _running_loop():
    import asyncio

    return asyncio.get_running_loop()


def _completions_route(served: Served, chat: bool):
    async def endpoint(http: HttpRequest) -> Response:
        try:
            run = await _submit(served, http, chat)
            if run.req.stream:
                return EventStream(_stream_body(served, run), lambda: served.worker.cancel(run.job))
            body = await _collect(served, run, http)
        except ApiError as exc:
            return _error(exc)
        return JSONResponse(body) if body is not None else Response(status_code=499)

    return endpoint


def build_app(served: Served) -> Starlette:
    """The ASGI app; its lifespan starts the worker and stops it (closing every session)."""

    async def models(_: HttpRequest) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": served.name, "object": "model", "created": 0, "owned_by": "memra",
             "max_model_len": served.context}]})

    async def health(_: HttpRequest) -> Response:
        w = served.worker
        return JSONResponse({"status": "failed" if w.failure else "ok", "error": w.failure, "model": served.name,
                             "live": len(w.live), "waiting": len(w.waiting), "rounds": w.rounds,
                             "pool_live_storages": served.engine.pool.live_count})

    async def not_found(http: HttpRequest, exc) -> Response:
        return _error(ApiError(f"no route {http.method} {http.url.path}", status=404, code="not_found"))

    @asynccontextmanager
    async def lifespan(_app):
        served.worker.start()
        try:
            yield
        finally:
            served.worker.stop()

    routes = [Route("/v1/models", models, methods=["GET"]), Route("/health", health, methods=["GET"]),
              Route("/v1/completions", _completions_route(served, False), methods=["POST"]),
              Route("/v1/chat/completions", _completions_route(served, True), methods=["POST"])]
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={404: not_found, 405: not_found})
    app.state.served = served  # ServerThread reports a failed worker's reason
    return app


# --------------------------------------------------------------------------- running it


def bind(host: str, port: int):
    """A listening socket (port 0: one the system picks; `.getsockname()[1]` says which)."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)  # connections made before the server runs wait in the backlog, not refused
    return sock


def uvicorn_server(app: Starlette, log_level: str = "warning"):
    import uvicorn

    return uvicorn.Server(uvicorn.Config(app, log_level=log_level, lifespan="on", timeout_graceful_shutdown=5))


class ServerThread:
    """The app on a loopback port in a background thread, for as long as the `with` lasts
    (tests, benchmarks/serve_load.py). Yields the base URL (`http://127.0.0.1:PORT`)."""

    def __init__(self, app: Starlette, host: str = "127.0.0.1", port: int = 0, start_timeout: float = 30.0):
        self.app, self.sock = app, bind(host, port)
        self.server = uvicorn_server(app)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.start_timeout = start_timeout
        self.url = f"http://{host}:{self.sock.getsockname()[1]}"

    def __enter__(self) -> str:
        import time

        self.thread.start()
        deadline = time.monotonic() + self.start_timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                served = getattr(self.app.state, "served", None)
                why = served.worker.failure if served is not None else None
                raise RuntimeError(f"memra serve did not start{f': the model thread failed ({why})' if why else ''}")
            time.sleep(0.01)
        return self.url

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(15)
        self.sock.close()
