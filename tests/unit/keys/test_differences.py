"""differences(): the canonical fields two requests differ in, named as paths."""

from __future__ import annotations

from cacheproxy.keys.canonical import parse
from cacheproxy.keys.differences import differences
from policies.sampling import SamplingMode
from tests.unit.keys.test_structured_keys import DEFAULTS


def wire(**body: object) -> dict[str, object]:
    full = {"messages": [{"role": "system", "content": "Be brief."},
                         {"role": "user", "content": "What does the fox eat?"}], **body}
    return parse(full, "chat", DEFAULTS, SamplingMode.FORCE_GREEDY).request.wire()


def test_one_field_a_message_and_a_list_length_are_named() -> None:
    base = wire(max_tokens=20)
    assert differences(base, base) == []  # control: the same request differs nowhere
    assert differences(base, wire(max_tokens=21)) == ["max_tokens"]
    other = wire(max_tokens=20, messages=[{"role": "system", "content": "Be brief."},
                                          {"role": "user", "content": "What does the owl eat?"}])
    assert differences(base, other) == ["messages[1].content"]
    longer = wire(max_tokens=20, messages=[{"role": "system", "content": "Be brief."},
                                           {"role": "user", "content": "What does the fox eat?"},
                                           {"role": "assistant", "content": "Mice."}])
    assert differences(base, longer) == ["messages: 2 items vs 3"]


def test_greedy_sampling_knobs_do_not_differ_and_a_type_change_does() -> None:
    # top_p cannot change an argmax: the canonical request drops it, so it differs nowhere.
    assert differences(wire(max_tokens=5), wire(max_tokens=5, top_p=0.5)) == []
    assert differences({"a": 1}, {"a": 1.0}) == ["a"]
    assert differences({"a": 1}, {"b": 1}) == ["a", "b"]
