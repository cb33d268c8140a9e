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


def test_every_role_it_accepts_is_one_its_refusal_names():
    from splitinfer.api.protocol import ROLES

    for role in ROLES:
        assert chat_messages({"messages": [{"role": role, "content": "a"}]})
    with pytest.raises(APIError) as e:
        chat_messages({"messages": [{"role": "robot", "content": "a"}]})
    assert str(e.value) == "messages[0] needs a role of system, developer, user, assistant or tool."
    assert (e.value.status, e.value.param, e.value.code) == (400, "messages[0]", "invalid_value")


def test_user_is_the_one_parameter_accepted_and_ignored():
    from splitinfer.api.protocol import IGNORED, check_parameters

    assert IGNORED == ("user",)
    for chat in (True, False):
        check_parameters({"user": "someone"}, chat)
        # accepted, and nothing it asks for changes what is generated
        assert parse_params({"user": "someone", "seed": 3}, 9, "tree", chat) == parse_params({"seed": 3}, 9, "tree", chat)
        assert parse_params({"user": None}, 9, "tree", chat) == parse_params({}, 9, "tree", chat)
    with pytest.raises(APIError) as e:
        parse_params({"user": 7}, 9, "tree")
    assert (e.value.param, str(e.value)) == ("user", "'user' must be a string.")


def api_doc_tables() -> dict[str, set[str]]:
    """The parameter names in the first column of each table of docs/api.md, by the section it is under."""
    import re
    from pathlib import Path

    out: dict[str, set[str]] = {}
    section = ""
    for line in (Path(__file__).parents[2] / "docs" / "api.md").read_text().splitlines():
        if line.startswith("## "):
            section = line[3:].strip()
        elif line.startswith("| `"):
            out.setdefault(section, set()).update(re.findall(r"`(\w+)`", line.split(" | ")[0]))
    return out


def test_the_api_page_lists_what_the_code_does():
    """docs/api.md's three tables are the protocol's lists: honoured, accepted and ignored, and accepted only at
    the value that asks for nothing. A parameter added to the code and not to the page (or the reverse) fails."""
    from splitinfer.api.protocol import IGNORED, NO_OP, PARAMETERS

    tables = api_doc_tables()
    honoured = (set(PARAMETERS[True]) | set(PARAMETERS[False])) - set(IGNORED)
    assert tables["Honoured"] == honoured
    assert tables["Accepted and ignored"] == set(IGNORED)
    assert tables["Accepted only at the value that asks for nothing"] == set(NO_OP)
