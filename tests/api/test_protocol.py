"""The pure parts of the OpenAI layer: stop-string matching over any split of the text, parameter checks."""

from __future__ import annotations

import pytest

from splitinfer.api.protocol import APIError, StopMatcher, chat_messages, completion_prompt, parse_params


def run(stops, pieces):
    m = StopMatcher(stops)
    out = []
    for piece in pieces:
        text, stopped = m.feed(piece)
        out.append(text)
        if stopped:
            return "".join(out), True
    return "".join(out) + m.flush(), False


@pytest.mark.parametrize("text, stops, expected, stopped", [
    ("hello world. bye", ("world",), "hello ", True),
    ("hello world. bye", ("xyz",), "hello world. bye", False),
    ("a<|end|>b", ("<|end|>", "b"), "a", True),
    ("aab", ("ab",), "a", True),
    ("wor", ("world",), "wor", False),  # a prefix of a stop string at the end is released
])
def test_stop_matcher_is_independent_of_how_text_is_split(text, stops, expected, stopped):
    for size in (1, 2, 3, len(text)):
        pieces = [text[i : i + size] for i in range(0, len(text), size)]
        assert run(stops, pieces) == (expected, stopped)


def test_parameters_defaults_and_refusals():
    p = parse_params({}, 99, "tree")
    assert (p.max_tokens, p.temperature, p.top_p, p.seed, p.stop, p.stream) == (99, 1.0, 1.0, None, (), False)
    assert parse_params({"temperature": 0}, 9, "tree").sampling() is None
    assert parse_params({"max_completion_tokens": 7, "stop": "x"}, 9, "tree").max_tokens == 7
    for body in ({"seed": 1.5}, {"stream": "yes"}, {"top_p": 2}, {"strategy": "magic"}, {"temperature": True}):
        with pytest.raises(APIError) as e:
            parse_params(body, 9, "tree")
        assert e.value.status == 400
    assert chat_messages({"messages": [{"role": "developer", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}) == [{"role": "system", "content": "ab"}]
    with pytest.raises(APIError):
        chat_messages({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]})
    assert completion_prompt({"prompt": ["one"]}) == "one" and completion_prompt({"prompt": [1, 2]}) == [1, 2]
    with pytest.raises(APIError):
        completion_prompt({"prompt": ["one", "two"]})
