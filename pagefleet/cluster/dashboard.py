"""`/dashboard` on the HTTP port: every pool and worker, live, in a browser.

Two routes on the OpenAI HTTP server (`openai.server.build_app` adds them):

- `GET /dashboard`: one self-contained HTML page (no external assets). Each
  worker is a block map: one cell per block (or per group of blocks on big
  pools), live blocks first and coloured by tenant, then cached, then free;
  beside it hit rate, running and waiting, preemptions and evictions. Each
  pool shows its live workers against its target and why the target last
  moved (GetStatus `target_workers`, `scale_reason`). The page
  polls the JSON below once a second.
- `GET /dashboard/state`: that JSON, built from the ingress's status (the
  same numbers as gRPC GetStatus) and the workers' latest load reports.

Authentication follows GetStatus: when every tenant has a key, the JSON needs
one (`authorization: Bearer KEY` or `x-api-key`); the page sends the key given
in its URL fragment (`/dashboard#key=KEY`), which browsers never send to the
server or log.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import asdict
from typing import Any

from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from pagefleet.cluster.api import Front, IngressError, api_key_from_metadata
from pagefleet.cluster.config import TenantConfig
from pagefleet.cluster.errors import WIRE_STATUS


def snapshot(ingress: Front, tenant: TenantConfig | None = None) -> dict[str, Any]:
    """The pools `tenant` may see, as JSON: the status GetStatus reports (`PoolStatus`).

    Live blocks are labelled by tenant name, never by salt (a configured salt is
    a secret). When keys are required, a caller sees its own tenant's blocks by
    name and every other tenant's only as one "other tenants" sum.
    """
    names = ingress.tenancy.salt_names()
    own = tenant.name if tenant is not None and ingress.tenancy.auth_required else None
    pools = []
    for pool in ingress.status(tenant=tenant):
        workers = [
            {**asdict(w), "tenant_live_blocks": _label_tenants(w.tenant_live_blocks, names, own)}
            for w in pool.workers
        ]
        pools.append({**asdict(pool), "workers": workers})
    return {"time": time.time(), "pools": pools}


def _label_tenants(
    by_salt: Mapping[str, int], names: Mapping[str, str], own: str | None
) -> dict[str, int]:
    labelled: dict[str, int] = {}
    for salt, blocks in by_salt.items():
        name = names.get(salt, "other tenants")
        if own is not None and name != own:
            name = "other tenants"
        labelled[name] = labelled.get(name, 0) + blocks
    return labelled


def dashboard_routes(ingress: Front) -> list[Route]:
    """The `/dashboard` page and its `/dashboard/state` JSON, for the HTTP server's routes."""

    async def page(request: Request) -> Response:
        return HTMLResponse(PAGE)

    async def state(request: Request) -> Response:
        try:
            tenant = ingress.tenancy.authenticate(api_key_from_metadata(request.headers.items()))
        except IngressError as exc:
            status = WIRE_STATUS[exc.code].http
            return JSONResponse({"error": {"message": exc.message}}, status_code=status)
        return JSONResponse(snapshot(ingress, tenant), headers={"cache-control": "no-store"})

    return [
        Route("/dashboard", page, methods=["GET"]),
        Route("/dashboard/state", state, methods=["GET"]),
    ]


PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>pagefleet dashboard</title>
<style>
  body { font: 14px/1.4 system-ui, sans-serif; margin: 16px; color: #222; background: #fafafa; }
  h1 { font-size: 18px; margin: 0 0 8px; }
  .pool { background: #fff; border: 1px solid #ddd; border-radius: 6px; padding: 10px; margin: 10px 0; }
  .pool h2 { font-size: 15px; margin: 0 0 6px; }
  .scaling { color: #444; margin: 0 0 6px; }
  .worker { display: flex; gap: 12px; align-items: flex-start; margin: 8px 0; }
  .worker .name { font-weight: 600; width: 150px; }
  .worker.dead .name { color: #b00; }
  .stats { font-variant-numeric: tabular-nums; color: #444; width: 300px; }
  canvas { border: 1px solid #ccc; background: #fff; }
  .legend span { display: inline-block; margin-right: 12px; }
  .swatch { display: inline-block; width: 10px; height: 10px; margin-right: 4px; vertical-align: -1px; }
  #error { color: #b00; }
</style>
</head>
<body>
<h1>pagefleet <span id="updated"></span></h1>
<div class="legend" id="legend"></div>
<div id="error"></div>
<div id="pools"></div>
<script>
const FREE = "#e8e8e8", CACHED = "#8fb3d9";
const key = new URLSearchParams(location.hash.slice(1)).get("key");
// Tenant colours: a stable FNV-1a hash of the name into a palette that avoids
// the cached blue and the free grey.
const PALETTE = ["#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#bcbd22", "#111111"];
function tenantColor(name) {
  let h = 2166136261;
  for (const c of name) h = Math.imul(h ^ c.charCodeAt(0), 16777619) >>> 0;
  return PALETTE[h % PALETTE.length];
}
function pct(x) { return (100 * x).toFixed(1) + "%"; }
function el(tag, attrs, text) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}
function drawMap(canvas, w) {
  // Counts, not positions: live blocks (by tenant) first, then cached, then free.
  const total = Math.max(w.total_blocks, 1), cells = Math.min(total, 1024);
  const per = total / cells, cols = 64, size = 7;
  canvas.width = cols * size; canvas.height = Math.ceil(cells / cols) * size;
  const ctx = canvas.getContext("2d");
  const runs = [];
  const tenants = Object.entries(w.tenant_live_blocks).sort();
  let tenantLive = 0;
  for (const [t, n] of tenants) { runs.push([n, tenantColor(t)]); tenantLive += n; }
  if (w.live_blocks > tenantLive) runs.push([w.live_blocks - tenantLive, "#555"]);
  runs.push([w.cached_blocks, CACHED], [w.free_blocks, FREE]);
  let cell = 0, carried = 0;
  for (const [n, color] of runs) {
    carried += n / per;
    ctx.fillStyle = color;
    while (carried >= 0.5 && cell < cells) {
      ctx.fillRect((cell % cols) * size, Math.floor(cell / cols) * size, size - 1, size - 1);
      cell++; carried -= 1;
    }
  }
}
function render(state) {
  const root = document.getElementById("pools");
  root.replaceChildren();
  const seen = new Set();
  for (const p of state.pools) {
    const box = el("div", {class: "pool", "data-pool": p.name});
    box.append(el("h2", {}, `pool ${p.name}: model ${p.model}, router ${p.router_policy}, ` +
      `${p.live_workers}/${p.workers.length} workers live, hit rate ${pct(p.hit_rate)}, ` +
      `running ${p.num_running}, waiting ${p.num_waiting}, ` +
      `preemptions ${p.preemptions}, evictions ${p.evictions}, migrations ${p.migrations}`));
    box.append(el("div", {class: "scaling"},
      `workers: ${p.live_workers} live, target ${p.target_workers}; last moved: ${p.scale_reason}`));
    for (const w of p.workers) {
      const row = el("div", {class: "worker" + (w.alive ? "" : " dead"), "data-worker": w.worker_id});
      row.append(el("div", {class: "name"}, w.worker_id + (w.alive ? "" : w.draining ? " (draining)" : " (down)")));
      const canvas = el("canvas");
      drawMap(canvas, w);
      row.append(canvas);
      const stats = el("div", {class: "stats"});
      stats.innerText = `blocks ${w.total_blocks}: live ${w.live_blocks}, cached ${w.cached_blocks}, ` +
        `free ${w.free_blocks} (peak live ${w.peak_live_blocks})\\n` +
        `hit rate ${pct(w.hit_rate)} of ${w.prefix_query_tokens} prompt tokens\\n` +
        `running ${w.num_running}, waiting ${w.num_waiting}, routed ${w.requests_routed}, ` +
        `migrated out ${w.migrations_out}\\n` +
        `preemptions ${w.preemptions}, evictions ${w.evictions}` +
        (w.resident_adapters.length ? `\nadapters ${w.resident_adapters.join(", ")}` : "");
      row.append(stats);
      box.append(row);
      for (const t of Object.keys(w.tenant_live_blocks)) seen.add(t);
    }
    root.append(box);
  }
  const legend = document.getElementById("legend");
  legend.replaceChildren();
  const items = [...[...seen].sort().map(t => [t + " (live)", tenantColor(t)]),
                 ["cached", CACHED], ["free", FREE]];
  for (const [label, color] of items) {
    const s = el("span");
    s.append(el("span", {class: "swatch", style: `background:${color}`}), label);
    legend.append(s);
  }
  document.getElementById("updated").textContent =
    "updated " + new Date(state.time * 1000).toLocaleTimeString();
}
async function poll() {
  try {
    const headers = key ? {authorization: "Bearer " + key} : {};
    const r = await fetch("/dashboard/state", {headers, cache: "no-store"});
    const body = await r.json();
    if (!r.ok) throw new Error(body.error ? body.error.message : r.status);
    document.getElementById("error").textContent = "";
    render(body);
  } catch (e) {
    document.getElementById("error").textContent = "cannot read the state: " + e.message;
  }
  setTimeout(poll, 1000);
}
poll();
</script>
</body>
</html>
"""
