"""The OpenAI wire format `memra serve` speaks: request validation and the response objects.

A request body is checked completely before anything runs or any byte is sent: every refusal is
an `ApiError`, rendered as OpenAI's error object `{"error": {"message", "type", "param",
"code"}}` with its HTTP status. A setting memra cannot honour exactly (several choices, log
probabilities, penalties, a logit bias) is refused by name rather than ignored: ignoring it would
change what runs without saying so.
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

TEMPERATURE_MAX = 2.0  # OpenAI's documented range is [0, 2]
MAX_STOPS = 4  # OpenAI's limit on stop sequences
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class ApiError(Exception):
    """A refused request: HTTP `status` and OpenAI's error fields."""

    def __init__(self, message: str, *, param: Optional[str] = None, code: Optional[str] = None,
                 status: int = 400, type: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.code, self.status, self.type = message, param, code, status, type

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class Request:
    """A validated completion request. `prompt` is text (to tokenize) or token ids; `messages`
    is set for a chat request instead."""

    model: str
    chat: bool
    prompt: Optional[str | list[int]]
    messages: Optional[list[dict]]
    max_tokens: Optional[int]  # None: the endpoint's default
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    sampling: dict = field(default_factory=dict)  # SamplingParams keyword arguments as given

    @property
    def prompt_param(self) -> str:
        return "messages" if self.chat else "prompt"


# Settings with no effect at their neutral value; anything else changes what runs, so it is refused.
# (vLLM's and SGLang's extensions that change the output too: repetition_penalty, ignore_eos,
# min_tokens, stop_token_ids.) An empty object or list is neutral as well.
_NEUTRAL = {"n": (1, None), "best_of": (1, None), "presence_penalty": (0, 0.0, None),
            "frequency_penalty": (0, 0.0, None), "logprobs": (None, False), "top_logprobs": (None, 0),
            "echo": (False, None), "logit_bias": (None,), "suffix": (None, ""), "tools": (None,),
            "response_format": (None,), "repetition_penalty": (1, 1.0, None), "ignore_eos": (False, None),
            "min_tokens": (0, None), "stop_token_ids": (None,)}


def _number(body: dict, name: str, lo: float, hi: float, *, lo_open: bool = False, hi_open: bool = False,
            what: str) -> Optional[float]:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or \
            value < lo or value > hi or (lo_open and value == lo) or (hi_open and value == hi):
        raise ApiError(f"{name}={value!r}: expected {what}", param=name, code="invalid_value")
    return float(value)


def _integer(body: dict, name: str, lo: int, what: str) -> Optional[int]:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ApiError(f"{name}={value!r}: expected {what}", param=name, code="invalid_value")
    return value


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > MAX_STOPS:
        raise ApiError(f"stop: expected a non-empty string or a list of at most {MAX_STOPS} of them",
                       param="stop", code="invalid_value")
    return tuple(stops)


def _prompt(body: dict) -> str | list[int]:
    """`prompt`: a string, a list of one string, token ids, or a list of one list of token ids."""
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]
    if isinstance(p, str):
        return p
    if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        return p
    if isinstance(p, list) and len(p) > 1 and all(isinstance(t, (str, list)) for t in p):
        raise ApiError("prompt: one prompt per request (send the others as their own requests)", param="prompt",
                       code="invalid_value")
    raise ApiError("prompt: expected a string, or a non-empty list of token ids", param="prompt", code="invalid_value")


def _messages(body: dict) -> list[dict]:
    """`messages`: [{"role", "content"}], content a string or a list of text parts."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise ApiError("messages: expected a non-empty list of {role, content}", param="messages", code="invalid_value")
    out = []
    for i, m in enumerate(msgs):
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
                raise ApiError(f"messages[{i}].content: only text parts are supported", param="messages",
                               code="invalid_value")
            content = "".join(p["text"] for p in content)
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(content, str):
            raise ApiError(f"messages[{i}]: expected {{\"role\": str, \"content\": str}}", param="messages",
                           code="invalid_value")
        out.append({"role": m["role"], "content": content})
    return out


def parse_request(body: Any, *, chat: bool, models: tuple[str, ...]) -> Request:
    """A decoded JSON body -> Request, or ApiError naming the field and what was expected."""
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object", code="invalid_body")
    model = body.get("model")
    if not isinstance(model, str) or model not in models:
        raise ApiError(f"model {model!r} does not exist here (served: {', '.join(models)})", param="model",
                       code="model_not_found")
    for name, neutral in _NEUTRAL.items():
        if name in body and body[name] not in neutral and body[name] not in ({}, []):
            raise ApiError(f"{name}={body[name]!r} is not supported by memra serve (it would change what runs)",
                           param=name, code="unsupported_parameter")
    limit_key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _integer(body, limit_key, 0, "an integer >= 0")
    sampling = {k: v for k, v in {
        "temperature": _number(body, "temperature", 0.0, TEMPERATURE_MAX, what=f"a number in [0, {TEMPERATURE_MAX:g}]"),
        "top_p": _number(body, "top_p", 0.0, 1.0, lo_open=True, what="a number in (0, 1]"),
        "min_p": _number(body, "min_p", 0.0, 1.0, hi_open=True, what="a number in [0, 1)"),
        "top_k": _top_k(body),
        "seed": _integer(body, "seed", -(1 << 63), "an integer"),
    }.items() if v is not None}
    stream = body.get("stream", False)
    if not isinstance(stream, bool) and stream is not None:
        raise ApiError(f"stream={stream!r}: expected true or false", param="stream", code="invalid_value")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise ApiError("stream_options: expected an object", param="stream_options", code="invalid_value")
    return Request(model, chat, None if chat else _prompt(body), _messages(body) if chat else None, max_tokens,
                   _stop(body), bool(stream), bool(opts.get("include_usage")), sampling)


def _top_k(body: dict) -> Optional[int]:
    """`top_k` (an extension, as vLLM and SGLang take it): >= 0, or -1 for off."""
    k = body.get("top_k")
    if k == -1:
        return 0
    return _integer(body, "top_k", 0, "an integer >= 0 (0 or -1 = off)")


# --------------------------------------------------------------------------- responses


class StopMatcher:
    """Text deltas in, text deltas out, cut before the first stop string. Text that could still
    be the start of a stop string is held back until the next delta settles it."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops, self.pending, self.stopped = stops, "", False

    def push(self, delta: str) -> str:
        if self.stopped:  # nothing after the stop string is text
            return ""
        if not self.stops:
            return delta
        self.pending += delta
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self.pending, self.stopped = self.pending[:min(hits)], "", True
            return out
        hold = max((k for s in self.stops for k in range(1, len(s)) if self.pending.endswith(s[:k])), default=0)
        out = self.pending[:len(self.pending) - hold]
        self.pending = self.pending[len(out):]
        return out

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


def new_id(chat: bool) -> str:
    return f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int, stats: dict) -> dict:
    """OpenAI's usage, with memra's speculative stats as the extension field `memra`."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens, "memra": stats}


def completion(req: Request, rid: str, text: str, finish: str, use: dict) -> dict:
    """The whole (non-streamed) response."""
    created = int(time.time())
    if req.chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish,
                  "logprobs": None}
        return {"id": rid, "object": "chat.completion", "created": created, "model": req.model,
                "choices": [choice], "usage": use}
    choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
    return {"id": rid, "object": "text_completion", "created": created, "model": req.model, "choices": [choice],
            "usage": use}


def chunk(req: Request, rid: str, text: Optional[str], finish: Optional[str], *, first: bool = False,
          use: Optional[dict] = None) -> dict:
    """One streamed event. `use` set: the usage-only final chunk (`stream_options.include_usage`)."""
    created = int(time.time())
    kind = "chat.completion.chunk" if req.chat else "text_completion"
    if use is not None:
        return {"id": rid, "object": kind, "created": created, "model": req.model, "choices": [], "usage": use}
    if req.chat:
        delta = ({"role": "assistant", "content": ""} if first else {}) | ({"content": text} if text else {})
        choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
    else:
        choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
    return {"id": rid, "object": kind, "created": created, "model": req.model, "choices": [choice]}
