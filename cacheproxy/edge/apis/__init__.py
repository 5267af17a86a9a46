"""The table of the APIs this server speaks: for each, its routes, how its body becomes the
canonical request, how an answer is rendered (whole, streamed live, streamed from the
store), its response ids and its error shape.

Adding an API is a sub-package (its `__init__` with its parse, and its error shape if not
OpenAI's; its `render`: as `chat/`) and one line in `APIS` (README: "Adding an API"); the
routes in the table are POSTed to the shared answer path (`answers`), and an API's other
routes (such as count_tokens) are listed beside it in `app`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from cacheproxy.edge.apis import chat, completions
from cacheproxy.edge.apis.chat import render as chat_render
from cacheproxy.edge.apis.completions import render as completions_render
from cacheproxy.edge.apis.frame import Frame
from cacheproxy.edge.apis.messages import errors as messages_errors
from cacheproxy.edge.apis.messages import render as messages_render
from cacheproxy.edge.apis.messages.request import SCHEMA_FIELDS as MESSAGES_SCHEMAS
from cacheproxy.edge.apis.messages.request import parse_messages
from cacheproxy.edge.apis.responses import render as responses_render
from cacheproxy.edge.apis.responses.request import parse_responses
from cacheproxy.errors import ProxyError
from cacheproxy.keys.budget import SchemaFields
from cacheproxy.keys.canonical import Route
from cacheproxy.keys.codec import Chunk, Output
from cacheproxy.service.memos import BodyParser, Parse


class Stream(Protocol):
    """The events of one streamed answer in its API (ChatStream, ResponsesStream...)."""

    done: bytes

    def start(self) -> bytes: ...
    def chunk(self, chunk: Chunk) -> bytes: ...
    def error(self, error: ProxyError) -> bytes: ...
    def end(self, output: Output) -> bytes: ...


def replay(stream: Stream, output: Output) -> bytes:
    """Every event of a stream at once: a streamed HIT replays the stored chunk boundaries."""
    return stream.start() + b"".join(map(stream.chunk, output.chunks)) + stream.end(output) + \
        stream.done


def _openai_error(error: ProxyError) -> dict[str, object]:
    return error.body()


@dataclass(frozen=True, slots=True)
class Api:
    """One API: what the shared answer path needs to know of it."""

    paths: tuple[str, ...]  # POST routes answered through the cache
    id_head: str  # of its response ids
    parse: Parse
    schema_fields: SchemaFields  # of its bodies: what may carry schemas (keys/budget.py)
    body: Callable[[Frame, Output], dict[str, Any]]
    stream: Callable[[Frame], Stream]
    error: Callable[[ProxyError], dict[str, object]] = _openai_error
    key_header: str = ""  # a header that carries the API key besides `Authorization: Bearer`


_CHAT_SCHEMAS = ("tools", "functions", "response_format")
APIS: Mapping[Route, Api] = {
    "chat": Api(("/v1/chat/completions",), "chatcmpl-", chat.parse, _CHAT_SCHEMAS,
                chat_render.body, chat_render.ChatStream),
    "completions": Api(("/v1/completions",), "cmpl-", completions.parse, _CHAT_SCHEMAS,
                       completions_render.body, completions_render.CompletionStream),
    "responses": Api(("/v1/responses",), "resp_", parse_responses, ("tools", "text"),
                     responses_render.response, responses_render.ResponsesStream,
                     responses_render.error_body),
    "messages": Api(("/v1/messages",), "msg_", parse_messages, MESSAGES_SCHEMAS,
                    messages_render.body, messages_render.MessagesStream,
                    messages_errors.error_body, "x-api-key"),
}
PARSERS: Mapping[Route, BodyParser] = {name: BodyParser(api.parse, api.schema_fields)
                                       for name, api in APIS.items()}
"""What the service parses each API's bodies with (and which of their fields it counts)."""
ID_HEADS: Mapping[Route, str] = {name: api.id_head for name, api in APIS.items()}
