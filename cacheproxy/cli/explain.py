"""`cacheproxy explain REQUEST.json`: why a request misses, from the command line.

The request is parsed and keyed as the serving runner would (the same model, `--sampling`,
`--cache-scope` tenant via `--api-key`), then service/explain.py looks it up: nothing is
generated or written. Exit 0 when it is stored, 1 when it misses.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any, TextIO

from cacheproxy.cli.settings import Settings
from cacheproxy.edge.apis import PARSERS
from cacheproxy.edge.auth import identity_of
from cacheproxy.errors import ProxyError
from cacheproxy.keys.canonical import Route
from cacheproxy.keys.fields import decode_body
from cacheproxy.runners.base import Runner
from cacheproxy.service.cassette import open_store
from cacheproxy.service.explain import explain, report


async def run(runner: Runner, settings: Settings, request_file: Path, *, api: Route,
              api_key: str, scan: int, as_json: bool, out: TextIO | None = None) -> int:
    """Explain the request in `request_file` against `settings.store`."""
    out = out or sys.stdout
    raw = await asyncio.to_thread(request_file.read_bytes)
    try:
        parsed = PARSERS[api].parse(decode_body(raw), runner.defaults(), settings.sampling,
                                    max_tokens_cap=settings.max_tokens_cap,
                                    max_answer_tokens=settings.max_answer_tokens)
    except ProxyError as exc:  # what the server would answer: the same refusal
        print(f"cacheproxy: error: the server would refuse this request ({exc.status} "
              f"{exc.code}): {exc.message}", file=sys.stderr)
        return 2
    scope = identity_of(api_key.encode()) if api_key else ""
    store = await open_store(settings.store, replay=True)  # read only
    try:
        found = await explain(store, parsed.request, runner.fingerprint().digest,
                              scope=scope, scan=scan)
    finally:
        await store.aclose()
    data = report(found)
    print(json.dumps(data, indent=2) if as_json else _text(data), file=out)
    return 0 if found.stored else 1


def _text(data: dict[str, Any]) -> str:
    lines = [f"key {data['key']}: " + ("stored (a HIT)" if data["stored"] else "not stored")]
    for other in data["elsewhere"]:
        lines.append(f"  the same request is stored under namespace {other['namespace']} "
                     f"({other['state']}): the producer changed since")
    for near in data["nearest"]:
        what = ", ".join(near["differences"]) or "nothing (another cache scope?)"
        lines.append(f"  nearest {near['key']}: differs in {what}")
    if not data["stored"] and not data["nearest"]:
        lines.append("  no entry of this namespace to compare with")
    if not data["complete"]:
        lines.append(f"  (the first {data['scanned']} entries of the namespace were compared: "
                     "--scan N reads more)")
    return "\n".join(lines)
