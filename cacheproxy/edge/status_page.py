"""GET /: a status page in plain HTML and a little JS, reading /status.json."""

from __future__ import annotations

from aiohttp import web

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
 &middot; generations <span id="generations">-</span></p>
<table><thead><tr><th>minute</th><th>HIT</th><th>MISS</th><th>COALESCED</th><th>BYPASS</th>
</tr></thead><tbody id="minutes"></tbody></table>
<script>
async function refresh() {
  const s = await (await fetch("/status.json")).json();
  const total = Object.values(s.requests).reduce((a, b) => a + b, 0);
  const set = (id, text) => { document.getElementById(id).textContent = text; };
  set("hit-rate", s.hit_rate === null ? "-" : (100 * s.hit_rate).toFixed(1) + " %");
  set("requests", total);
  set("entries", s.store.entries ?? "-");
  set("bytes", s.store.bytes === undefined ? "" : s.store.bytes + " bytes");
  set("saved-tokens", s.saved_tokens);
  set("saved-s", s.saved_generation_s + " s of generation");
  set("fingerprint", s.fingerprint);
  set("lane", `${s.lane.busy ? "busy" : "idle"}, ${s.lane.queued} queued`);
  set("generations", s.generations);
  const rows = s.per_minute.map(m => `<tr><td>${new Date(m.minute * 1000)
    .toISOString().slice(11, 16)}</td><td>${m.HIT || 0}</td><td>${m.MISS || 0}</td>
    <td>${m.COALESCED || 0}</td><td>${m.BYPASS || 0}</td></tr>`);
  document.getElementById("minutes").innerHTML = rows.join("");
  document.body.dataset.loaded = "1";
}
refresh(); setInterval(refresh, 2000);
</script>
</body></html>
"""


async def status_page(request: web.Request) -> web.Response:
    """The page itself; its numbers come from /status.json."""
    return web.Response(text=PAGE, content_type="text/html")
