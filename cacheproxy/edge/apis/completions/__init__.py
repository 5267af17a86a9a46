"""The (legacy) text completions API (`POST /v1/completions`) as one unit: `parse` (a body
as its canonical request, a prompt instead of messages) and `render` (the `text_completion`
object and its stream of chunks). Its ids are `cmpl-` and its errors OpenAI's shape."""

from __future__ import annotations

from cacheproxy.keys.canonical import Parsed, RunnerDefaults
from cacheproxy.keys.canonical import parse as _parse
from policies.sampling import SamplingMode


def parse(body: object, defaults: RunnerDefaults, mode: SamplingMode, *,
          max_tokens_cap: int | None = None, max_answer_tokens: int | None = None) -> Parsed:
    """A text completions body -> its canonical request."""
    return _parse(body, "completions", defaults, mode, max_tokens_cap=max_tokens_cap,
                  max_answer_tokens=max_answer_tokens)
