"""What operators look at: the shared snapshot, GET /status.json, GET / and GET /metrics."""

from __future__ import annotations

import time
from typing import Any

from aiohttp import web

from backends.base import BackendError, StoreStats
from backends.tiered import TieredBackend
from cacheproxy.edge.info import model_states
from cacheproxy.edge.route import json_response
from cacheproxy.edge.state import CONNECTIONS, INVALIDATOR, METRICS, OPTIONS, PROXY, STARTED
from cacheproxy.service.namespaces import cache_entries
from policies.status import CacheStatus, Reason


async def snapshot(app: web.Application) -> dict[str, Any]:
    """Everything an operator looks at, as plain data (no prompts, no keys)."""
    proxy, tally = app[PROXY], app[METRICS].tally
    store: dict[str, Any] = {"url": app[OPTIONS].store_label}
    if isinstance(proxy.store, StoreStats):
        try:
            s = await proxy.store.stats()
            store.update(entries=await cache_entries(proxy.store, s.entries), keys=s.entries,
                         bytes=s.bytes, max_bytes=s.max_bytes)
        except BackendError as exc:
            store["error"] = str(exc)
    if isinstance(proxy.store, TieredBackend):
        store.update(l1=proxy.store.coherence, l1_invalidations=proxy.store.invalidations,
                     l1_tracking_restarts=proxy.store.restarts)
    figures = tally.totals()
    totals = figures.by_cache
    served = sum(totals.get(status, 0) for status in
                 (CacheStatus.HIT, CacheStatus.MISS, CacheStatus.COALESCED))
    fingerprint = proxy.runner.fingerprint()
    return {
        "uptime_s": round(time.time() - app[STARTED], 1),
        "requests": totals,
        "hit_rate": round(totals.get(CacheStatus.HIT, 0) / served, 4) if served else None,
        "per_minute": figures.per_minute,
        "saved_tokens": figures.saved_tokens,
        "saved_generation_s": round(figures.saved_seconds, 3),
        "prefill": {"tokens": figures.prefill_tokens, "reused": figures.prefill_reused},
        "store": store,
        "fingerprint": fingerprint.digest,
        "fingerprint_fields": fingerprint.fields(),
        "lane": proxy.runner.lane_state(),
        "generations": proxy.runner.generations,
        "fills_in_progress": len(proxy.flights),
        "store_breaker": proxy.breaker.state,
        "counters": {**proxy.counters, **app[INVALIDATOR].counters},
        # (Evicted waiting connections, refused ones, answers cut unread: `cacheproxy serve`.)
        "connections": app.get(CONNECTIONS, {}),
        "models": model_states(app),  # the fields above are the default (first) model's
    }


async def public_stats(request: web.Request) -> web.Response:
    """GET /status.json: the aggregate numbers of the status page (no keys, no prompts)."""
    data = await snapshot(request.app)
    data.pop("fingerprint_fields", None)
    return json_response(data)


# The lane's figures /metrics shows as cacheproxy_lane{figure=...}.
LANE_FIGURES = ("slots", "slots_in_use", "waiting", "prefilling", "decode_tokens_per_s",
                "batch_occupancy", "queued_behind", "prefill_restarts")
# The service's counters of answers the store refused, by the reason their X-Cache shows.
REFUSED = {"store_full": Reason.STORE_FULL.value, "store_read_only": Reason.STORE_READ_ONLY.value}


async def metrics(request: web.Request) -> web.Response:
    """GET /metrics: Prometheus exposition."""
    data = await snapshot(request.app)
    counters = data["counters"]
    gauges = {"store_errors": counters.get("store_errors", 0),
              "refused": {reason: counters.get(name, 0) for name, reason in REFUSED.items()},
              "breaker": data["store_breaker"],
              "entries": data["store"].get("entries"), "bytes": data["store"].get("bytes"),
              "l1": data["store"].get("l1"),
              "l1_invalidations": data["store"].get("l1_invalidations"),
              "l1_tracking_restarts": data["store"].get("l1_tracking_restarts"),
              "queued": data["lane"].get("queued", 0),
              "lane": {k: data["lane"][k] for k in LANE_FIGURES if k in data["lane"]},
              "prefix_entries": data["lane"].get("prefix_entries", 0),
              "prefix_bytes": data["lane"].get("prefix_bytes", 0),
              "invalidation": {k: v for k, v in counters.items()
                               if k not in ("store_errors", "corrupt_records", *REFUSED)}}
    body = request.app[METRICS].render(gauges)
    return web.Response(body=body, content_type="text/plain", charset="utf-8",
                        headers={"X-Content-Type-Options": "nosniff"})


PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>cacheproxy status</title>
<style>
 body { font: 14px system-ui, sans-serif; margin: 2em; color: #222; }
 h1 { font-size: 20px; } .grid { display: grid; grid-template-columns: repeat(4, 1fr); gap: 1em; }
 .card { border: 1px solid #ccc; border-radius: 6px; padding: .8em; }
 .card b { display: block; font-size: 22px; } code { font-size: 12px; }
 table { border-collapse: collapse; margin-top: 1em; } td, th { padding: .2em .8em; }
 th { text-align: left; border-bottom: 1px solid #ccc; }
</style></head>
<body>
<h1>cacheproxy</h1>
<div class="grid">
 <div class="card">hit rate<b id="hit-rate">-</b></div>
 <div class="card">requests<b id="requests">-</b></div>
 <div class="card">entries<b id="entries">-</b><span id="bytes"></span></div>
 <div class="card">tokens saved<b id="saved-tokens">-</b><span id="saved-s"></span></div>
</div>
<p>fingerprint <code id="fingerprint">-</code> &middot; lane <span id="lane">-</span>
 &middot; generations <span id="generations">-</span>
 &middot; prefill <span id="prefill">-</span></p>
<table><thead><tr><th>model</th><th>fingerprint</th><th>lane</th><th>generations</th>
<th>reloads</th></tr></thead><tbody id="models"></tbody></table>
<table><thead><tr><th>minute</th><th>HIT</th><th>MISS</th><th>COALESCED</th><th>BYPASS</th>
</tr></thead><tbody id="minutes"></tbody></table>
<script>
// Behind a token (--status-access): open the page as /#token=... (a fragment never leaves
// the browser, so the token is in no log); it is sent as a bearer token.
const token = new URLSearchParams(location.hash.slice(1)).get("token");
async function refresh() {
  const reply = await fetch("/status.json",
    token ? {headers: {"Authorization": `Bearer ${token}`}} : {});
  if (reply.status === 401) {
    document.getElementById("fingerprint").textContent = "needs a token: open /#token=...";
    document.body.dataset.loaded = "1";
    return;
  }
  const s = await reply.json();
  const total = Object.values(s.requests).reduce((a, b) => a + b, 0);
  const set = (id, text) => { document.getElementById(id).textContent = text; };
  const lane = l => `${l.busy ? "busy" : "idle"}, ${l.queued} queued` + (l.slots > 1
    ? `; ${l.slots_in_use} of ${l.slots} slots, ${l.prefilling} prefilling, `
      + `${l.decode_tokens_per_s} tokens/s, occupancy ${(100 * l.batch_occupancy).toFixed(0)} %`
      + (l.prefill_restarts ? `, prefill process restarted ${l.prefill_restarts}x` : "")
    : l.queued_behind ? `; ${l.queued_behind} misses queued behind one slot` : "");
  set("hit-rate", s.hit_rate === null ? "-" : (100 * s.hit_rate).toFixed(1) + " %");
  set("requests", total);
  set("entries", s.store.entries ?? "-");
  set("bytes", s.store.bytes === undefined ? "" : s.store.bytes + " bytes");
  set("saved-tokens", s.saved_tokens);
  set("saved-s", s.saved_generation_s + " s of generation");
  set("fingerprint", s.fingerprint);
  set("lane", lane(s.lane));
  set("generations", s.generations);
  const saved = s.lane.prefix_entries === undefined ? "prefix reuse off"
    : `${s.lane.prefix_entries} saved chunks, ${s.lane.prefix_bytes} bytes`;
  set("prefill", `${s.prefill.reused} of ${s.prefill.tokens} tokens reused; ${saved}`);
  const rows = s.per_minute.map(m => `<tr><td>${new Date(m.minute * 1000)
    .toISOString().slice(11, 16)}</td><td>${m.HIT || 0}</td><td>${m.MISS || 0}</td>
    <td>${m.COALESCED || 0}</td><td>${m.BYPASS || 0}</td></tr>`);
  document.getElementById("minutes").innerHTML = rows.join("");
  const cell = text => { const td = document.createElement("td"); td.textContent = text;
    return td; };
  document.getElementById("models").replaceChildren(...s.models.map(m => {
    const tr = document.createElement("tr");
    tr.append(cell(m.id), cell(m.fingerprint),
      cell(lane(m.lane)),
      cell(m.generations), cell(m.counters.reloads));
    return tr;
  }));
  document.body.dataset.loaded = "1";
}
refresh(); setInterval(refresh, 2000);
</script>
</body></html>
"""


async def status_page(request: web.Request) -> web.Response:
    """GET /: the page itself; its numbers come from /status.json."""
    return web.Response(text=PAGE, content_type="text/html")
