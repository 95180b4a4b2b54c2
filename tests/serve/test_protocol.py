"""The wire format alone: stop strings cut the text wherever the deltas split them, and nothing
after a stop is text; request checks name the field."""

from __future__ import annotations

import pytest

from memra_cli.serve.protocol import ApiError, StopMatcher, parse_request


@pytest.mark.parametrize("cut", [1, 2, 3, 5, 100])
def test_a_stop_string_split_across_deltas_is_found(cut):
    text = "def f(x):\n    return x\n\ndef g"
    m = StopMatcher(("\n\n", "@@"))
    out = "".join(m.push(text[i:i + cut]) for i in range(0, len(text), cut))
    assert out == "def f(x):\n    return x" and m.stopped
    assert m.push("more") == "" and m.flush() == ""


def test_text_that_only_starts_like_a_stop_is_held_then_released():
    m = StopMatcher(("END",))
    assert m.push("abcE") == "abc"
    assert m.push("Nx") == "ENx" and not m.stopped
    assert m.push("E") == "" and m.flush() == "E"


def test_no_stops_passes_everything():
    m = StopMatcher(())
    assert m.push("a\n\nb") == "a\n\nb" and not m.stopped


@pytest.mark.parametrize("body, param", [
    ({"model": "m", "prompt": "x", "seed": "1"}, "seed"),
    ({"model": "m", "prompt": "x", "top_k": -2}, "top_k"),
    ({"model": "m", "prompt": "x", "min_p": 1}, "min_p"),
    ({"model": "m", "prompt": "x", "stream": "yes"}, "stream"),
    ({"model": "m", "prompt": ["a", "b"]}, "prompt"),
    ({"model": "m", "prompt": "x", "logprobs": 2}, "logprobs"),
    ({"model": "m", "prompt": "x", "max_tokens": True}, "max_tokens"),
    ({"model": "m", "prompt": "x", "repetition_penalty": 1.2}, "repetition_penalty"),
    ({"model": "m", "prompt": "x", "ignore_eos": True}, "ignore_eos"),
])
def test_bad_fields_are_named(body, param):
    with pytest.raises(ApiError) as exc:
        parse_request(body, chat=False, models=("m",))
    assert exc.value.param == param and exc.value.status == 400 and exc.value.body()["error"]["param"] == param


def test_chat_messages_take_text_parts():
    req = parse_request({"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                                    {"type": "text", "text": "b"}]}]},
                        chat=True, models=("m",))
    assert req.messages == [{"role": "user", "content": "ab"}]
    with pytest.raises(ApiError) as exc:
        parse_request({"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, chat=True,
                      models=("m",))
    assert exc.value.param == "messages"


def test_neutral_values_of_unsupported_settings_pass():
    body = {"model": "m", "prompt": "x", "n": 1, "logit_bias": {}, "tools": [], "presence_penalty": 0,
            "repetition_penalty": 1.0, "echo": False, "user": "someone"}
    assert parse_request(body, chat=False, models=("m",)).prompt == "x"
