"""The chat completions API (`POST /v1/chat/completions`) as one unit: `parse` (a body as
its canonical request: keys.canonical, which the other APIs' requests translate into) and
`render` (the `chat.completion` object and its stream of chunks). Its ids are `chatcmpl-`
and its errors OpenAI's shape (the table's defaults)."""

from __future__ import annotations

from cacheproxy.keys.canonical import Parsed, RunnerDefaults
from cacheproxy.keys.canonical import parse as _parse
from policies.sampling import SamplingMode


def parse(body: object, defaults: RunnerDefaults, mode: SamplingMode, *,
          max_tokens_cap: int | None = None, max_answer_tokens: int | None = None) -> Parsed:
    """A chat completions body -> its canonical request."""
    return _parse(body, "chat", defaults, mode, max_tokens_cap=max_tokens_cap,
                  max_answer_tokens=max_answer_tokens)
