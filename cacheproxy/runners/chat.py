"""A chat request as the model sees it, and the model's text as an answer: mlx-lm's own parts.

The prompt is the tokenizer's chat template (mlx-lm's `TokenizerWrapper`) rendered with the
canonical messages, tools and template kwargs. How tool_choice is enforced:
- "auto": the tools are rendered; the model decides.
- "none": the request's canonical form has no tools (they are never rendered) and tool-call
  markers in the text stay text.
- "required": the assistant turn is prefilled with the template's tool-call opening (the text
  the template renders before a call, up to and including mlx-lm's `tool_call_start`), so
  the model writes a call; which function is its choice.
- a named function: prefilled further, up to where the template renders that call's
  arguments, so the model writes only the arguments of that function.
The prefill is found by rendering the conversation with one more assistant turn that calls
the function with placeholder arguments and cutting that text before them; a template that
renders no such opening cannot be forced (400).

The output is split into answer text, reasoning and tool calls by mlx-lm's
`TextStateMachine` (built by `make_text_state_machine`, the markers inferred from the
tokenizer exactly as mlx_lm.server infers them), and each call is parsed by the tool parser
mlx-lm infers from the chat template. A call that does not parse, or whose arguments are not
a JSON object, stays in the answer as the text the model wrote, markers included.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import orjson

from cacheproxy.errors import Unsupported
from cacheproxy.keys.canonical import CanonicalRequest
from cacheproxy.keys.codec import ToolCallOut

PLACEHOLDER = "cacheproxy-arguments-go-here"


def thinking_kwarg(tokenizer: Any) -> str:
    """The name the template knows the thinking switch by (mlx-lm's inference of it)."""
    return str(getattr(tokenizer, "_thinking_kwarg", "enable_thinking"))


def template_defaults(tokenizer: Any) -> dict[str, Any]:
    """What mlx-lm's TokenizerWrapper passes the chat template when a request sets nothing:
    the thinking switch, on when the model has a thinking marker."""
    return {thinking_kwarg(tokenizer): bool(tokenizer.has_thinking)}


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    """Token ids to prefill, the text of a prefilled assistant opening (fed to the splitter
    before the first generated token) and the state the answer starts in."""

    ids: list[int]
    opening: str = ""
    initial_state: str = "normal"


def template_inputs(request: CanonicalRequest) -> tuple[list[dict[str, Any]],
                                                      list[dict[str, Any]] | None,
                                                      dict[str, Any]]:
    """Messages, tools and template kwargs as the chat template receives them."""
    messages = [m.for_template() for m in request.messages]
    tools = [t.for_template() for t in request.tools] or None
    return messages, tools, orjson.loads(request.template_kwargs)


def chat_prompt(tokenizer: Any, request: CanonicalRequest) -> ChatPrompt:
    """The prompt of a chat request (see the module docstring for tool_choice)."""
    messages, tools, kwargs = template_inputs(request)
    if request.tool_choice in ("required", "function"):
        return _forced(tokenizer, request, messages, tools, kwargs)
    ids = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                        tokenize=True, **kwargs)
    ids = list(ids["input_ids"] if isinstance(ids, dict) else ids)
    thinking = tokenizer.has_thinking and \
        tokenizer.rfind_think_start(ids) > tokenizer.rfind_think_end(ids)
    # As mlx_lm.server: a model whose response format names an initial state starts there.
    initial = tokenizer.response_initial_state or ("reasoning" if thinking else "normal")
    return ChatPrompt(ids, "", initial)


def prompt_length(tokenizer: Any, request: CanonicalRequest) -> int:
    """The tokens of the prompt `request` is generated from (chat or text completion)."""
    if request.endpoint == "chat":
        return len(chat_prompt(tokenizer, request).ids)
    return len(tokenizer.encode(request.prompt, add_special_tokens=True))


def _forced(tokenizer: Any, request: CanonicalRequest, messages: list[dict[str, Any]],
            tools: list[dict[str, Any]] | None, kwargs: dict[str, Any]) -> ChatPrompt:
    name = request.tool_name or request.tools[0].name
    call = {"id": "call_0", "type": "function",
            "function": {"name": name, "arguments": {PLACEHOLDER: 0}}}
    turn = {"role": "assistant", "content": "", "tool_calls": [call]}
    text = tokenizer.apply_chat_template([*messages, turn], tools=tools,
                                         add_generation_prompt=False, tokenize=False, **kwargs)
    start = tokenizer.tool_call_start
    if request.tool_choice == "function":
        placeholder = text.rfind(f'"{PLACEHOLDER}"')
        cut = text.rfind("{", 0, placeholder) if placeholder >= 0 else -1
        while cut > 0 and text[cut - 1].isspace():
            cut -= 1  # before the space: it belongs to the next token in BPE vocabularies
    else:
        cut = text.rfind(start) + len(start) if start and start in text else -1
    opening = text.rfind(start, 0, cut) if start and cut > 0 else -1
    if opening < 0:
        raise Unsupported("this model's chat template renders no tool-call opening to "
                          "prefill, so tool_choice cannot force a call", param="tool_choice")
    ids = tokenizer.encode(text[:cut], add_special_tokens=False)
    return ChatPrompt(list(ids), text[opening:cut], "normal")


@dataclass(slots=True)
class Pieces:
    """What one piece of generated text became."""

    content: str = ""
    reasoning: str = ""
    calls: tuple[ToolCallOut, ...] = ()


class _WithoutTools:
    """The tokenizer as mlx-lm's state machine builder sees it, minus tool calling."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer

    has_tool_calling = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)


class ChatSplit:
    """Generated text -> answer text, reasoning and parsed tool calls, as it arrives."""

    def __init__(self, tokenizer: Any, request: CanonicalRequest, prompt: ChatPrompt) -> None:
        from mlx_lm.generate import make_text_state_machine

        tools_on = bool(request.tools) and tokenizer.has_tool_calling
        machine = make_text_state_machine(  # type: ignore[no-untyped-call]
            tokenizer if tools_on else _WithoutTools(tokenizer))
        self._state = machine.make_state(prompt.initial_state)
        self._parse = tokenizer.tool_parser
        self._tools = [t.for_template() for t in request.tools] or None
        self._start, self._end = tokenizer.tool_call_start or "", tokenizer.tool_call_end or ""
        self._one_call = not request.parallel_tool_calls
        self._in_call = False
        self._tool_text = ""
        self._calls = 0
        self.done = False  # parallel_tool_calls false and the one call is made: stop here
        if prompt.opening:
            self.feed(prompt.opening)

    def feed(self, text: str) -> Pieces:
        """Split one decoded segment."""
        from mlx_lm.generate import TextStateMachine

        self._state, segments = TextStateMachine.split(  # type: ignore[no-untyped-call]
            self._state, text)
        return self._take(segments)

    def end(self, *, eos: bool) -> Pieces:
        """The end of generation: a partial marker is dropped at end-of-sequence (as
        mlx_lm.server does) and kept as text when max_tokens cut it; a call still open is
        parsed if it can be."""
        from mlx_lm.generate import TextStateMachine

        if eos:
            self._state, state = TextStateMachine.discard(  # type: ignore[no-untyped-call]
                self._state)
            pieces = self._take([(state, "")])
        else:
            self._state, flushed, state = TextStateMachine.flush(  # type: ignore[no-untyped-call]
                self._state)
            pieces = self._take([(state, flushed)])
        if self._in_call:
            self._close_call(pieces, complete=False)
        return pieces

    def _take(self, segments: list[tuple[str | None, str]]) -> Pieces:
        pieces = Pieces()
        for state, text in segments:
            if state == "tool":
                self._in_call = True
                self._tool_text += text
                continue
            if self._in_call:
                self._close_call(pieces, complete=True)
            if state == "reasoning":
                pieces.reasoning += text
            else:
                pieces.content += text
        return pieces

    def _close_call(self, pieces: Pieces, *, complete: bool) -> None:
        text, self._tool_text, self._in_call = self._tool_text, "", False
        calls = self._parsed(text)
        if calls is None:  # what the model wrote, as it wrote it
            pieces.content += self._start + text + (self._end if complete else "")
            return
        for name, arguments in calls:
            pieces.calls += (ToolCallOut(self._calls, name, arguments),)
            self._calls += 1
        if self._one_call and self._calls:
            self.done = True

    def _parsed(self, text: str) -> list[tuple[str, str]] | None:
        if self._parse is None:
            return None
        try:
            parsed = self._parse(text, self._tools)
        except (ValueError, KeyError, TypeError, IndexError):
            return None
        out = []
        for call in parsed if isinstance(parsed, list) else [parsed]:
            if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                return None
            arguments = _arguments(call.get("arguments", {}))
            if arguments is None:
                return None
            out.append((call["name"], arguments))
        return out


def _arguments(value: object) -> str | None:
    """A call's arguments as JSON text, None unless they are an object: a tool's input is
    one (Anthropic's tool_use.input must be, OpenAI's parameters schemas are), so a call
    with a list, a number or a string of anything else is text the model wrote."""
    if isinstance(value, str):  # arguments written as JSON text: kept as written
        try:
            decoded = json.loads(value)
        except ValueError:
            return None
        return value if isinstance(decoded, dict) else None
    if isinstance(value, dict):  # as mlx_lm.server formats them
        return json.dumps(value, ensure_ascii=False)
    return None
