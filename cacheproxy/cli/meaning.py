"""Whether two answers mean the same, for `cacheproxy compare`: what a test asserts on once it
stops comparing bytes.

- A request with a response format (JSON object or schema): both answers parse as JSON and
  the parsed values are equal.
- An answer with tool calls: the same calls in order, by name and parsed arguments.
- Otherwise plain text: equal after the user's extractor (`--extract REGEX`: the first match,
  its first group if it has one; `--extract module:function`: a function of the text that
  returns a string, or None for no answer), or else (no extractor, or it finds nothing in
  either answer) equal as whitespace-normalized text.

Reasoning text is left out: a wording change in a thought is not a change of the answer.
"""

from __future__ import annotations

import importlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cacheproxy.keys.codec import Output

Extractor = Callable[[str], str | None]
_NOTHING = object()  # an unparseable JSON answer: equal to nothing


def load_extractor(spec: str) -> Extractor:
    """`module:function` imports that function; anything else is a regular expression."""
    module_name, colon, name = spec.partition(":")
    if colon and module_name.replace(".", "").replace("_", "").isalnum() and name.isidentifier():
        function = getattr(importlib.import_module(module_name), name, None)
        if not callable(function):
            raise ValueError(f"--extract {spec}: {module_name} has no function {name}")
        return function  # type: ignore[no-any-return]
    try:
        pattern = re.compile(spec, re.DOTALL)
    except re.error as exc:
        raise ValueError(f"--extract {spec!r} is neither module:function nor a valid regular "
                         f"expression ({exc})") from None

    def extract(text: str) -> str | None:
        found = pattern.search(text)
        if found is None:
            return None
        return found.group(1) if pattern.groups else found.group(0)

    return extract


@dataclass(frozen=True, slots=True)
class Meaning:
    """How two answers were compared by meaning (`how`) and whether they are equal."""

    equal: bool
    how: str  # "json", "tool_calls", "extracted", "text"


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return _NOTHING


def _calls(output: Output) -> list[tuple[str, Any]]:
    calls = []
    for call in output.tool_calls:
        arguments = _json(call.arguments)
        calls.append((call.name, call.arguments if arguments is _NOTHING else arguments))
    return calls


def same_meaning(stored: Output, candidate: Output, *, json_answer: bool,
                 extractor: Extractor | None = None) -> Meaning:
    """Compare two answers by what they mean (see the module docstring)."""
    if stored.tool_calls or candidate.tool_calls:
        return Meaning(_calls(stored) == _calls(candidate), "tool_calls")
    if json_answer:
        a, b = _json(stored.text), _json(candidate.text)
        return Meaning(a is not _NOTHING and a == b, "json")
    normalized = " ".join(stored.text.split()) == " ".join(candidate.text.split())
    if extractor is not None:
        a_text, b_text = extractor(stored.text), extractor(candidate.text)
        if a_text is not None or b_text is not None:
            return Meaning(a_text == b_text, "extracted")
    return Meaning(normalized, "text")  # (nothing to extract from either: the whole text)
