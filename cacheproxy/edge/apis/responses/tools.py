"""A Responses request's tools as chat function tools, and the thought it asks to carry.

- A `function` tool becomes a chat function tool. Each key of OpenAI's schema for it is
  applied (`name`, `description`, `parameters`, `strict`) or moot here (`defer_loading`
  false, `allowed_callers` with "direct": this server runs neither a tool search nor a
  programmatic caller, both hosted tools) or refused where it would matter (a deferred tool,
  one only a program may call, an `output_schema`); any other key is a 400 naming it.
- A `namespace` tool (Codex sends `multi_agent_v1`) groups function tools: each becomes a
  chat function tool under its own name, which is how the model calls it and how the call is
  rendered back (`name`, plus the `namespace` it came from). A chat template has no place for
  a namespace's own description, so the prompt never shows it: it is echoed, and not keyed.
- A hosted tool (`web_search`, `file_search`, `code_interpreter`...) runs on OpenAI's
  servers; this server runs no tools, so it is refused by name (400), with how to turn it
  off where a client turns it on by default (Codex's `web_search`).
- `include: ["reasoning.encrypted_content"]` asks for the thought in a form the client sends
  back with a stateless (`store: false`) history. This server keeps no state and has nothing
  to hide: the "encrypted" content is the thought itself, encoded (`seal`); an input
  reasoning item that carries one gives the thought back exactly (`unseal`).
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping
from typing import Any

from cacheproxy.errors import InvalidRequest, Unsupported

ENCRYPTED_REASONING = "reasoning.encrypted_content"
# Parts of items this server never produces: the hosted tools and input images are refused by
# name, so there is never such an item to add them to, as OpenAI answers a request without them.
_VACUOUS_INCLUDES = frozenset({
    "file_search_call.results", "web_search_call.results", "web_search_call.action.sources",
    "message.input_image.image_url", "computer_call_output.output.image_url",
    "code_interpreter_call.outputs"})
_WEB_SEARCH = frozenset({"web_search", "web_search_preview", "web_search_preview_2025_03_11",
                         "web_search_2025_08_26"})
_HOSTED = _WEB_SEARCH | {"file_search", "code_interpreter", "computer_use_preview", "computer",
                         "image_generation", "mcp", "local_shell", "shell", "apply_patch",
                         "tool_search", "programmatic_tool_calling"}
# The keys of OpenAI's function tool (FunctionToolParam; in a namespace, its ToolFunction)
# and namespace tool (NamespaceToolParam).
_FUNCTION_KEYS = frozenset({"type", "name", "description", "parameters", "strict",
                            "defer_loading", "allowed_callers", "output_schema"})
_NAMESPACE_KEYS = frozenset({"type", "name", "description", "tools"})
_CALLERS = frozenset({"direct", "programmatic"})
_SEAL = "cpx1."


def includes(body: Mapping[str, Any]) -> frozenset[str]:
    """The `include` values, each honoured or (for parts of items never produced) moot;
    a value this server could serve but does not (logprobs) or an unknown one is a 400."""
    raw = body.get("include")
    if raw is None:
        return frozenset()
    if not isinstance(raw, list) or not all(isinstance(v, str) for v in raw):
        raise InvalidRequest("'include' must be a list of strings", param="include")
    for value in raw:
        if value == "message.output_text.logprobs":
            raise Unsupported("'include' value 'message.output_text.logprobs' is not "
                              "supported by this server's Responses API", param="include")
        if value != ENCRYPTED_REASONING and value not in _VACUOUS_INCLUDES:
            allowed = sorted(_VACUOUS_INCLUDES | {ENCRYPTED_REASONING})
            raise InvalidRequest(f"'include' value {value!r} is not one of {allowed}",
                                 param="include")
    return frozenset(raw)


def tools(raw: object) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """The chat function tools of a Responses `tools` list, and the namespace of each
    function that came from one (function name -> namespace name)."""
    if not isinstance(raw, list):
        raise InvalidRequest("'tools' must be a list", param="tools")
    out: list[dict[str, Any]] = []
    namespaces: dict[str, str] = {}
    for i, tool in enumerate(raw):
        where = f"tools[{i}]"
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind == "function":
            out.append(_function(tool, where))
        elif kind == "namespace":
            for function in _namespace(tool, where):
                out.append(function)
                namespaces[function["function"]["name"]] = tool["name"]
        else:
            raise _unsupported(kind, f"{where}.type")
    _unique(out)
    return out, namespaces


def _function(tool: Mapping[str, Any], where: str) -> dict[str, Any]:
    _known(tool, _FUNCTION_KEYS, where)
    _offered_directly(tool, where)
    function = {k: tool[k] for k in ("name", "description", "parameters", "strict")
                if k in tool}
    return {"type": "function", "function": function}


def _known(tool: Mapping[str, Any], keys: frozenset[str], where: str) -> None:
    for name in tool:
        if name not in keys:
            raise Unsupported(f"'{where}.{name}' is not a key of a {tool['type']} tool this "
                              "server knows", param=f"{where}.{name}")


def _offered_directly(tool: Mapping[str, Any], where: str) -> None:
    """A tool search loads a deferred tool; a program calls a tool `allowed_callers` gives
    it, reading `output_schema`. Both are hosted tools this server refuses: a tool is served
    only as the model calls it directly, and one meant only for them is a 400."""
    deferred = tool.get("defer_loading")
    if deferred is not None and not isinstance(deferred, bool):
        raise InvalidRequest(f"'{where}.defer_loading' must be a boolean",
                             param=f"{where}.defer_loading")
    if deferred:
        raise Unsupported(f"'{where}.defer_loading' true is not supported: this server has no "
                          "tool search to load it (offer the tool directly)",
                          param=f"{where}.defer_loading")
    callers = tool.get("allowed_callers")
    if callers is not None and (not isinstance(callers, list)
                                or not all(isinstance(c, str) and c in _CALLERS for c in callers)):
        raise InvalidRequest(f"'{where}.allowed_callers' must be a list of {sorted(_CALLERS)}",
                             param=f"{where}.allowed_callers")
    if callers is not None and "direct" not in callers:
        raise Unsupported(f"'{where}.allowed_callers' without 'direct' is not supported: this "
                          "server runs no programmatic tool calling",
                          param=f"{where}.allowed_callers")
    if tool.get("output_schema") is not None:
        raise Unsupported(f"'{where}.output_schema' is not supported: no chat template shows "
                          "the model a function's output schema", param=f"{where}.output_schema")


def _namespace(tool: Mapping[str, Any], where: str) -> list[dict[str, Any]]:
    _known(tool, _NAMESPACE_KEYS, where)
    name, inner = tool.get("name"), tool.get("tools")
    if not isinstance(name, str) or not name:
        raise InvalidRequest(f"'{where}.name' must be a non-empty string", param=f"{where}.name")
    if not isinstance(tool.get("description", ""), str):
        raise InvalidRequest(f"'{where}.description' must be a string",
                             param=f"{where}.description")
    if not isinstance(inner, list) or not inner:
        raise InvalidRequest(f"'{where}.tools' must be a non-empty list", param=f"{where}.tools")
    out = []
    for j, function in enumerate(inner):
        kind = function.get("type") if isinstance(function, dict) else None
        if kind != "function":
            raise Unsupported(f"'{where}.tools[{j}].type' {kind!r}: a namespace's tools must "
                              "be function tools here", param=f"{where}.tools[{j}].type")
        out.append(_function(function, f"{where}.tools[{j}]"))
    return out


def _unique(found: list[dict[str, Any]]) -> None:
    """A namespace's functions are offered by their own names: two of one name is a 400."""
    seen: set[str] = set()
    for tool in found:
        name = tool["function"].get("name")
        if isinstance(name, str) and name in seen:
            raise InvalidRequest(f"'tools' offer the function {name!r} twice (a namespace's "
                                 "functions are offered by their own names)", param="tools")
        if isinstance(name, str):
            seen.add(name)


def _unsupported(kind: object, where: str) -> Unsupported:
    if kind in _WEB_SEARCH:
        return Unsupported(
            f"'{where}' {kind!r}: this server cannot search the web (a hosted tool runs on "
            "OpenAI's servers). In Codex, turn it off with web_search = \"disabled\" in "
            "~/.codex/config.toml (or `codex -c web_search=disabled`)", param=where)
    if kind in _HOSTED:
        return Unsupported(f"'{where}' {kind!r}: a hosted tool runs on OpenAI's servers and "
                           "this server runs no tools; offer a function tool instead",
                           param=where)
    return Unsupported(f"'{where}' {kind!r}: only function and namespace tools are supported",
                       param=where)


def seal(thought: str) -> str:
    """The `encrypted_content` of a reasoning item: its thought, encoded (not secret)."""
    return _SEAL + base64.urlsafe_b64encode(thought.encode()).decode()


def opened(token: object) -> str | None:
    """The thought `seal` sealed in `token`; None when this server did not write it."""
    try:
        if isinstance(token, str) and token.startswith(_SEAL):
            sealed = token[len(_SEAL):].encode()
            return base64.b64decode(sealed, altchars=b"-_", validate=True).decode()
    except (binascii.Error, UnicodeDecodeError, ValueError):
        pass
    return None


def unseal(token: object, where: str) -> str:
    """The thought of an `encrypted_content` this server wrote; 400 for any other."""
    thought = opened(token)
    if thought is not None:
        return thought
    raise InvalidRequest(f"'{where}' was not written by this server, which cannot read "
                         "another's encrypted reasoning: send the thought as the item's "
                         "content instead", param=where)
