"""Whether an answer holds to the structured output its request asked for: upstream mode's
guarantee, where nothing constrains decoding (mlx_lm.server ignores `response_format`), so
an answer is checked against the same canonical schema a grammar would have enforced.

Pure: a canonical request and an output in, the first violation (or None) out.
"""

from __future__ import annotations

import json
from typing import Any

from cacheproxy.keys.canonical import CanonicalRequest
from cacheproxy.keys.codec import Output

_SHOWN = 200  # characters of a violation message: the answer is the client's, but long


def violation(request: CanonicalRequest, output: Output) -> str | None:
    """Where `output` breaks its request's response_format or strict tools; None if it
    holds (or the request asked for neither)."""
    if request.response_format:
        spec = json.loads(request.response_format)
        schema = {"type": "object"} if spec["type"] == "json_object" else spec["schema"]
        return _against(schema, output.text, "the answer")
    strict = {tool.name: tool for tool in request.tools if tool.strict}
    if not strict:
        return None
    offered = {tool.name for tool in request.tools}
    for call in output.tool_calls:
        where = f"the arguments of tool call {call.index} ({call.name})"
        if call.name not in offered:
            return f"tool call {call.index} names {call.name[:64]!r}, which was not offered"
        if call.name in strict and (why := _against(
                json.loads(strict[call.name].parameters), call.arguments, where)):
            return why
    return None


def _against(schema: dict[str, Any], text: str, where: str) -> str | None:
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import best_match

    try:
        instance = json.loads(text)
    except ValueError:
        return f"{where} is not JSON"
    error = best_match(Draft202012Validator(schema).iter_errors(instance))
    if error is None:
        return None
    path = "$" + "".join(f"[{p!r}]" for p in error.absolute_path)
    return f"{where} breaks its schema at {path}: {error.message}"[:_SHOWN]
