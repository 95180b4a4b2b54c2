"""`memra bench --server URL`: any OpenAI-compatible server (memra serve, vLLM, SGLang, llama.cpp's
server) measured on memra's prompt sets, and checked against memra's plain decoding.

Per prompt of the set (tokenized with the target's own tokenizer, chat-wrapped with `--chat`),
memra first decodes plainly (greedy, the engine's fixed-width steps: the reference every arm of
`memra bench` is gated on) and then every server gets the same prompt as token ids (so no
server-side tokenization or BOS rule can differ) with `temperature` 0 and `max_tokens` the
bench's `--max-new`, streamed; the servers' order rotates per prompt. Per server: tok/s (its
completion tokens over the wall time of its requests), time to first token (p50, the first
streamed text), and exact: whether its text equals the decoded text of memra's plain stream on
every prompt (EOS ends both and is not text). A server that differs anywhere fails the gate.

Nothing here prints: `cli/bench.py` renders a `ServerBench`.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

from memra_cli.engine.errors import MemraError


class ServerError(MemraError):
    """A server that cannot be benchmarked as asked (unreachable, no such model, a refused request)."""


@dataclass
class Stream:
    """One streamed completion as a client sees it."""

    text: str
    tokens: Optional[int]  # the server's usage.completion_tokens (None: it sent no usage)
    wall_s: float
    ttft_s: Optional[float]  # None: no text came


@dataclass
class ServerArm:
    """One server: where it is, the model asked for, and its streams (one per prompt)."""

    url: str
    model: str
    streams: list[Stream] = field(default_factory=list)
    mismatches: list[dict] = field(default_factory=list)

    def as_json(self, n: int) -> dict:
        wall = sum(s.wall_s for s in self.streams)
        counted = [s.tokens for s in self.streams]
        tokens = sum(counted) if all(t is not None for t in counted) else None
        ttft = [s.ttft_s for s in self.streams if s.ttft_s is not None]
        return {"name": self.url, "model": self.model, "n_prompts": len(self.streams), "tokens": tokens,
                "wall_s": wall, "tok_per_s": tokens / wall if tokens is not None and wall > 0 else None,
                "ttft_ms_p50": 1e3 * statistics.median(ttft) if ttft else None,
                "exact": not self.mismatches and len(self.streams) == n, "exact_prompts": len(self.streams) - len(self.mismatches),
                "mismatches": self.mismatches}


def _base(url: str) -> str:
    """`http://host:port` or `.../v1` -> the API root that `/completions` is under."""
    url = url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


def served_model(http, url: str, model: Optional[str]) -> str:
    """The model to ask `url` for: `model` when given (checked against /v1/models when the server
    lists it), else the first model the server lists."""
    try:
        r = http.get(_base(url) + "/models")
    except Exception as exc:  # httpx's connection errors: the server is not there
        raise ServerError(f"--server {url}: no answer ({type(exc).__name__}: {exc})") from None
    listed = [m.get("id") for m in r.json().get("data", [])] if r.status_code == 200 else []
    if model is not None:
        if listed and model not in listed:
            raise ServerError(f"--server {url}: --model {model!r} is not served there (it lists {', '.join(listed)})")
        return model
    if not listed:
        raise ServerError(f"--server {url}: /v1/models lists no model (HTTP {r.status_code}); pass --model NAME")
    return listed[0]


def stream_completion(http, url: str, model: str, prompt_ids: Sequence[int], max_tokens: int) -> Stream:
    """One greedy streamed completion of token ids; refuses in one line on an HTTP error."""
    body = {"model": model, "prompt": list(prompt_ids), "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first, parts, tokens = None, [], None
    with http.stream("POST", _base(url) + "/completions", json=body) as r:
        if r.status_code != 200:
            r.read()
            raise ServerError(f"--server {url}: HTTP {r.status_code}: {r.text[:300]}")
        for line in r.iter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            event = json.loads(data)
            if "error" in event:
                raise ServerError(f"--server {url}: {event['error'].get('message', event['error'])}")
            for choice in event.get("choices") or []:
                if choice.get("text"):
                    first = first if first is not None else time.perf_counter() - t0
                    parts.append(choice["text"])
            if event.get("usage"):
                tokens = event["usage"].get("completion_tokens")
    return Stream("".join(parts), tokens, time.perf_counter() - t0, first)


@dataclass
class ServerBench:
    """The result: memra's reference (its own plain decoding, timed too) and every server."""

    prompts: dict
    max_new: int
    reference: dict
    servers: list[ServerArm]

    @property
    def exact(self) -> bool:
        return all(a.as_json(self.prompts["n"])["exact"] for a in self.servers)

    def as_json(self) -> dict:
        n = self.prompts["n"]
        return {"prompts": self.prompts, "max_new": self.max_new, "reference": self.reference,
                "servers": [a.as_json(n) for a in self.servers], "exact": self.exact}


def _reference(engine, codec, prompts: list[list[int]], max_new: int) -> tuple[list[str], dict]:
    """memra's plain greedy decoding of every prompt: the texts, and its own tok/s and first-token time."""
    import torch

    eos = set(engine.target.cfg.eos_token_ids)
    texts, tokens, wall, firsts = [], 0, 0.0, []
    with torch.inference_mode():
        for ids in prompts:
            t0 = time.perf_counter()
            with engine.session(ids, max_new) as s:
                s.burst(1)
                firsts.append(time.perf_counter() - t0)
                out = s.run()
            wall += time.perf_counter() - t0
            tokens += len(out)
            texts.append(codec.decode([t for t in out if t not in eos]))
    return texts, {"name": "memra plain (this process)", "steps": engine.steps, "tokens": tokens, "wall_s": wall,
                   "tok_per_s": tokens / wall if wall > 0 else None, "ttft_ms_p50": 1e3 * statistics.median(firsts)}


def _first_char_difference(a: str, b: str) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def server_arms(urls: Sequence[str], model: Optional[str], timeout_s: float = 30.0) -> list[ServerArm]:
    """Every server reachable and its model known (asked before anything loads)."""
    import httpx

    with httpx.Client(timeout=timeout_s) as http:
        return [ServerArm(url, served_model(http, url, model)) for url in urls]


def run_server_bench(engine, codec, prompt_set, prompts: list[list[int]], arms: list[ServerArm], max_new: int,
                     warmup: int, timeout_s: float,
                     progress: Optional[Callable[[str, int, int], None]] = None) -> ServerBench:
    """Reference first, then every server on every prompt (order rotated per prompt) after
    `warmup` untimed prompts each."""
    import httpx

    texts, reference = _reference(engine, codec, prompts, max_new)
    with httpx.Client(timeout=timeout_s) as http:
        for ids in prompts[:warmup]:
            for arm in arms:
                stream_completion(http, arm.url, arm.model, ids, max_new)
        for i, ids in enumerate(prompts):
            for arm in arms[i % len(arms):] + arms[:i % len(arms)]:
                got = stream_completion(http, arm.url, arm.model, ids, max_new)
                arm.streams.append(got)
                if got.text != texts[i]:
                    at = _first_char_difference(texts[i], got.text)
                    arm.mismatches.append({"prompt": i, "char": at, "expected": texts[i][at:at + 40],
                                           "got": got.text[at:at + 40]})
            if progress:
                progress("measure", i + 1, len(prompts))
    meta = {"set": prompt_set.name, "source": prompt_set.source, "n": len(prompts),
            "prompt_tokens": sum(len(p) for p in prompts)}
    return ServerBench(meta, max_new, reference, arms)


def prepare(target: Optional[Path], prompts: str, n: Optional[int], chat: bool, device: str, dtype: str,
            max_new: int, env: dict, threads: Optional[int] = None, threads_source: str = "--threads"):
    """(engine, codec, prompt set, prompt ids): the target loaded for the reference (the embedded
    one by default), every prompt tokenized and checked against its context."""
    from memra_cli.engine.api import Engine, EngineConfig
    from memra_cli.engine.defaults import default_models
    from memra_cli.engine.prompts import load_prompts
    from memra_cli.engine.text import TextCodec

    target_dir, _, _ = default_models(target, None, "off")
    prompt_set = load_prompts(prompts, n)
    codec = TextCodec(Path(target_dir))
    ids = [codec.encode(text, chat=chat) for text in prompt_set.texts]
    engine = Engine.load(EngineConfig(target=Path(target_dir), device=device, dtype=dtype, env=env, threads=threads,
                                      threads_source=threads_source))
    for i, p in enumerate(ids):
        try:
            engine.check_prompt(p, max_new)
        except MemraError as exc:
            raise ServerError(f"prompt {i} of {prompt_set.name}: {exc}") from None
    return engine, codec, prompt_set, ids
