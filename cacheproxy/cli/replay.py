"""The engine of `cacheproxy verify` and `cacheproxy compare`: replay stored entries on a runner
and say, per entry, whether the answer came out the same and where it first changed.

The replay goes through the runner's own lane with the stored canonical request (already the
determinism rewrite's), one entry at a time, and the store is opened read-only: nothing is
written. `verify` replays on the runner that serves the namespace (anything but 100 % exact is
a reproducibility failure); `compare` on a candidate producer (another quantization, another
runtime), where it is a measurement.
"""

from __future__ import annotations

import random
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from backends import listing
from backends.base import Backend
from cacheproxy.cli.meaning import Extractor, same_meaning
from cacheproxy.errors import ProxyError
from cacheproxy.keys import codec
from cacheproxy.keys.canonical import CanonicalRequest
from cacheproxy.keys.margin import Margin, from_provenance
from cacheproxy.runners.base import Runner
from cacheproxy.service.cassette import open_store


@dataclass(frozen=True, slots=True)
class Difference:
    """What differs first between a stored answer and its replay, and at which token."""

    reason: str
    first_divergence: int | None = None


@dataclass(frozen=True, slots=True)
class EntryResult:
    """One replayed entry."""

    key: str
    exact: bool
    difference: Difference | None
    parsed_equal: bool
    compared_by: str  # how `parsed_equal` was decided (`meaning.Meaning.how`)
    margin: Margin | None  # the stored answer's (None: not recorded)
    stored_text: str
    candidate_text: str
    token_ids: bool  # both sides had token ids (an upstream's answers have none)
    # What a rewrite needs (not reported): the stored request and the candidate's answer.
    request: Mapping[str, Any] | None = None
    candidate_output: codec.Output | None = None
    candidate_ms: float = 0.0

    @property
    def first_divergence(self) -> int | None:
        """Token index of the first difference (None: equal, or not known by token)."""
        return None if self.difference is None else self.difference.first_divergence


@dataclass(frozen=True, slots=True)
class Replayed:
    """Every replayed entry of a namespace, and the fields of the fingerprint that made them."""

    namespace: str
    stored_fields: Mapping[str, Any]
    results: tuple[EntryResult, ...]


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token, or None when the sequences are equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def difference(stored: codec.Output, replayed: codec.Output, *,
               logprobs: bool) -> Difference | None:
    """The first of: token ids, text, reasoning, tool calls, finish reason and (with
    `logprobs`, when stored) log-probabilities with their top alternatives that differs;
    None when all are identical."""
    # Entries generated through mlx_lm.server carry no token ids: compare their text.
    if stored.token_ids and replayed.token_ids:
        position = first_divergence(stored.token_ids, replayed.token_ids)
        if position is not None:
            return Difference("tokens differ", position)
    for reason, a, b in (("text differs", stored.text, replayed.text),
                         ("reasoning differs", stored.reasoning, replayed.reasoning),
                         ("tool calls differ", stored.tool_calls, replayed.tool_calls),
                         ("finish reason differs", stored.finish_reason,
                          replayed.finish_reason)):
        if a != b:
            return Difference(reason)
    # Each token's log-probability and its top alternatives (ids, texts, log-probabilities).
    lp_a = [(lp.logprob, lp.top) for c in stored.chunks for lp in c.logprobs]
    lp_b = [(lp.logprob, lp.top) for c in replayed.chunks for lp in c.logprobs]
    if logprobs and lp_a and lp_a != lp_b:
        where = next((i for i, (x, y) in enumerate(zip(lp_a, lp_b, strict=False)) if x != y),
                     min(len(lp_a), len(lp_b)))
        return Difference("logprobs differ", where)
    return None


async def replay(runner: Runner, url: str, *, namespace: str, sample: int | None,
                 logprobs: bool, extractor: Extractor | None = None, progress: bool = True,
                 desc: str = "replay") -> Replayed:
    """Replay the entries of `namespace` (all, or `sample` random ones) on `runner`."""
    store = await open_store(url, replay=True)  # read only
    results: list[EntryResult] = []
    fields: Mapping[str, Any] = {}
    try:
        # A sample lists only the pages it takes its keys from (at 1M entries, listing
        # them all costs ~1000 pages).
        keys = await listing.keys(store, namespace + "/") if sample is None else \
            await listing.sample(store, namespace + "/", sample, random.Random())
        from tqdm import tqdm

        for key in tqdm(keys, desc=desc, unit="entry", disable=not progress):
            found = await _entry(runner, store, key, logprobs, extractor)
            if found is not None:
                result, record = found
                results.append(result)
                if not fields and record is not None:
                    fields = record.provenance.get("fingerprint_fields") or {}
    finally:
        await store.aclose()
    return Replayed(namespace, fields, tuple(results))


async def _entry(runner: Runner, store: Backend, key: str, logprobs: bool,
                 extractor: Extractor | None
                 ) -> tuple[EntryResult, codec.Record | None] | None:
    data = await store.get(key)
    if data is None:
        return None  # purged or expired meanwhile
    try:
        record = codec.decode(data)
    except codec.CorruptRecord as exc:
        return _failed(key, f"undecodable: {exc}", None), None
    request = CanonicalRequest.from_wire(record.request)
    if (refused := refusal(request, runner)) is not None:
        return _failed(key, f"not replayed: {refused}", record), record
    started = time.monotonic()
    try:
        output = await generate(runner, request)
    except ProxyError as exc:  # the candidate refuses it (e.g. an upstream: tool_choice)
        return _failed(key, f"candidate failed: {exc}", record), record
    json_answer = bool(record.request.get("response_format"))
    meaning = same_meaning(record.output, output, json_answer=json_answer,
                           extractor=extractor)
    diff = difference(record.output, output, logprobs=logprobs)
    return EntryResult(key, diff is None, diff, meaning.equal, meaning.how,
                       from_provenance(record.provenance), shown(record.output), shown(output),
                       bool(record.output.token_ids and output.token_ids), record.request,
                       output, (time.monotonic() - started) * 1000), record


def refusal(request: CanonicalRequest, runner: Runner) -> str | None:
    """Why the runner cannot answer a stored request as it was answered (the edge refuses
    such a request up front; a replay skips the edge), or None."""
    constrained = bool(request.response_format) or any(t.strict for t in request.tools)
    if constrained and not runner.defaults().grammar_engine:
        return ("the candidate cannot constrain decoding (mlx_lm.server ignores "
                "response_format and strict tools)")
    return None


def shown(output: codec.Output) -> str:
    """An answer as a report shows it: its text, then its tool calls as name(arguments)."""
    calls = [f"{call.name}({call.arguments})" for call in output.tool_calls]
    return "\n".join([output.text, *calls]) if output.text else "\n".join(calls)


def _failed(key: str, reason: str, record: codec.Record | None) -> EntryResult:
    stored = shown(record.output) if record is not None else ""
    margin = from_provenance(record.provenance) if record is not None else None
    return EntryResult(key, False, Difference(reason), False, "none", margin, stored, "",
                       False)


async def generate(runner: Runner, request: CanonicalRequest) -> codec.Output:
    """One generation on the runner's lane, to its end."""
    generation = runner.generate(request)
    async for _ in generation.chunks():
        pass
    if generation.output is None:
        raise RuntimeError("replay ended without output")
    return generation.output
