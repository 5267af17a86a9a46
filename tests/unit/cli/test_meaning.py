"""Equal by meaning (`cacheproxy compare`'s parsed_equal): JSON parsed, tool calls by name and
parsed arguments, text through an extractor or whitespace-normalized."""

from __future__ import annotations

import pytest

from cacheproxy.cli.meaning import load_extractor, same_meaning
from cacheproxy.keys.codec import Chunk, Output, ToolCallOut


def out(text: str, *calls: tuple[str, str], reasoning: str = "") -> Output:
    tool_calls = tuple(ToolCallOut(i, n, a) for i, (n, a) in enumerate(calls))
    return Output((Chunk(text, (1,), (), reasoning, tool_calls),), "stop", 1, 1)


def test_json_answers_compare_parsed() -> None:
    a, b = out('{"animal": "fox", "food": "berries"}'), out('{ "food":"berries","animal":"fox"}')
    assert same_meaning(a, b, json_answer=True).equal
    assert not same_meaning(a, b, json_answer=False).equal  # (as text they differ)
    assert not same_meaning(a, out('{"animal": "fox", "food": "honey"}'), json_answer=True).equal
    broken = out('{"animal": "fox", "fo')
    assert not same_meaning(broken, broken, json_answer=True).equal  # unparseable: no answer


def test_tool_calls_compare_by_name_and_parsed_arguments() -> None:
    a = out("", ("get_weather", '{"city": "Lima", "unit": "C"}'))
    b = out("", ("get_weather", '{"unit":"C","city":"Lima"}'))
    assert same_meaning(a, b, json_answer=False).how == "tool_calls"
    assert same_meaning(a, b, json_answer=False).equal
    assert not same_meaning(a, out("", ("get_time", '{"city": "Lima", "unit": "C"}')),
                            json_answer=False).equal
    assert not same_meaning(a, out("It is sunny."), json_answer=False).equal


def test_text_is_whitespace_normalized_and_reasoning_ignored() -> None:
    a = out("The fox  eats\nberries.", reasoning="I think")
    assert same_meaning(a, out("The fox eats berries. ", reasoning="Hm"), json_answer=False).equal
    assert not same_meaning(a, out("The fox eats honey."), json_answer=False).equal


def test_extractors() -> None:
    regex = load_extractor(r"eats (\w+)")
    a, b = out("The bear is brown. It eats honey."), out("The bear eats honey. It sleeps.")
    assert same_meaning(a, b, json_answer=False, extractor=regex).equal
    assert not same_meaning(a, b, json_answer=False).equal  # the control: without it
    assert not same_meaning(a, out("It eats fish."), json_answer=False, extractor=regex).equal
    # Nothing to extract from either: the whole text decides.
    assert same_meaning(out("Hi"), out("Hi "), json_answer=False, extractor=regex).equal
    function = load_extractor("os.path:basename")  # module:function, a str -> str
    assert same_meaning(out("a/b/x"), out("c/x"), json_answer=False, extractor=function).equal


@pytest.mark.parametrize("spec", ["(unclosed", "os.path:no_such_function"])
def test_a_bad_extractor_is_a_clear_error(spec: str) -> None:
    with pytest.raises(ValueError, match="--extract"):
        load_extractor(spec)
