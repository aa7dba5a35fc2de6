"""The live chain page: GET / (one self-contained HTML page) and GET /v1/chain (what it polls).

No build step and no outside assets: its script polls /v1/chain once a second. With
`--auth-token`, GET / answers 401 with a Basic challenge (the token as password), and the
browser resends those credentials with each poll, so they pass the same check as /v1.
"""

from __future__ import annotations

import dataclasses

from fastapi import FastAPI
from fastapi.responses import HTMLResponse

from .generation import ServeContext


def add_chain_page(app: FastAPI, ctx: ServeContext) -> None:
    @app.get("/", include_in_schema=False)
    async def page():
        return HTMLResponse(PAGE, headers={"Cache-Control": "no-store"})

    @app.get("/v1/chain")
    async def chain():
        # the raw metric totals stay on /metrics; the page shows the rates and means in `figures`
        stages = [{**dataclasses.asdict(status), "metrics": None} for status in await ctx.backend.status()]
        activity, admission = ctx.activity, ctx.admission
        return {
            "model": ctx.model_names[0],
            "stages": stages,
            "tokens_per_s": round(activity.tokens_per_s(), 1),
            "active": admission.num_active,
            "queued": admission.num_waiting,
            "recent": activity.recent(),
        }


PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>skippy chain</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<link rel="icon" href="data:,">
<style>
 body { font: 14px/1.4 system-ui, sans-serif; margin: 24px; color: #1d2430; background: #f6f7f9; }
 h1 { font-size: 20px; margin: 0 0 4px; } .sub { color: #5b6575; margin-bottom: 18px; }
 .chain { display: flex; align-items: stretch; flex-wrap: wrap; gap: 0; margin-bottom: 22px; }
 .stage { background: #fff; border: 1px solid #d5dae1; border-radius: 8px; padding: 10px 14px; min-width: 180px; }
 .stage h2 { font-size: 15px; margin: 0 0 6px; } .stage .state { font-weight: 600; }
 .arrow { align-self: center; font-size: 22px; color: #8a94a3; padding: 0 8px; }
 .ready { color: #17803d; } .down, .failed { color: #c0262d; } .restarting { color: #b36b00; }
 .kv { display: grid; grid-template-columns: auto auto; gap: 0 12px; color: #3a4453; }
 .kv span:nth-child(odd) { color: #6b7584; }
 .tiles { display: flex; gap: 12px; margin-bottom: 22px; flex-wrap: wrap; }
 .tile { background: #fff; border: 1px solid #d5dae1; border-radius: 8px; padding: 10px 14px; min-width: 130px; }
 .tile b { display: block; font-size: 22px; } .tile span { color: #6b7584; }
 table { border-collapse: collapse; background: #fff; border: 1px solid #d5dae1; }
 th, td { padding: 4px 10px; border-bottom: 1px solid #e6e9ee; text-align: right; } th { color: #5b6575; }
 #error { color: #c0262d; margin-bottom: 10px; }
</style></head>
<body>
<h1>skippy</h1><div class="sub" id="model">connecting...</div>
<div id="error"></div>
<div class="chain" id="chain"></div>
<div class="tiles">
 <div class="tile"><b id="rate">-</b><span>tokens/s now</span></div>
 <div class="tile"><b id="active">-</b><span>generating</span></div>
 <div class="tile"><b id="queued">-</b><span>queued</span></div>
 <div class="tile"><b id="accept">-</b><span>drafts accepted</span></div>
 <div class="tile"><canvas id="spark" width="240" height="44" aria-label="tokens/s, last minute"></canvas>
  <span>tokens/s, last minute</span></div>
</div>
<h2 style="font-size:15px">Recent requests</h2>
<table><thead><tr><th>finished</th><th>outcome</th><th>prompt</th><th>cached</th><th>tokens</th>
<th>TTFT ms</th><th>decode tok/s</th></tr></thead><tbody id="recent"></tbody></table>
<script>
"use strict";
const history = [];
const FIGURES = [  // [label, /v1/stages figure, scale, digits]
  ["tokens/s", "tokens_per_s", 1, 1], ["decode fwd ms", "decode_forward_ms", 1, 2],
  ["prefill tok/s", "prefill_tokens_per_s", 1, 0], ["queue wait ms", "queue_wait_ms", 1, 2],
  ["queue depth", "queue_depth", 1, 0], ["cache hit %", "prefix_cache_hit_rate", 100, 0],
  ["drafts accepted %", "speculative_acceptance", 100, 0], ["KV MiB", "kv_session_bytes", 1 / 1048576, 1]];
const fmt = (v, digits) => (v === null || v === undefined) ? "-" : Number(v).toFixed(digits);
function cell(text) { const td = document.createElement("td"); td.textContent = text; return td; }
function stageBox(stage) {
  const box = document.createElement("div");
  box.className = "stage";
  box.dataset.stage = stage.stage_id;
  const title = document.createElement("h2");
  title.textContent = stage.stage_id;
  box.appendChild(title);
  const kv = document.createElement("div");
  kv.className = "kv";
  const rows = [["layers", stage.layer_start + "-" + (stage.layer_end - 1)], ["endpoint", stage.endpoint],
                ["state", stage.state], ["sessions", stage.active_sessions], ["restarts", stage.restarts]];
  const f = stage.figures || {};
  for (const [label, key, scale, digits] of FIGURES)
    if (key in f) rows.push([label, (f[key] * scale).toFixed(digits)]);
  if (stage.standbys && stage.standbys.length) rows.push(["standbys", stage.standbys.length]);
  for (const [key, value] of rows) {
    const k = document.createElement("span"), v = document.createElement("span");
    k.textContent = key;
    v.textContent = typeof value === "number" && !Number.isInteger(value) ? value.toFixed(2) : String(value);
    if (key === "state") v.className = "state " + value;
    kv.append(k, v);
  }
  box.appendChild(kv);
  return box;
}
function drawSpark() {
  const canvas = document.getElementById("spark"), g = canvas.getContext("2d");
  g.clearRect(0, 0, canvas.width, canvas.height);
  const top = Math.max(1, ...history);
  g.strokeStyle = "#2f6fd6"; g.lineWidth = 2; g.beginPath();
  history.forEach((v, i) => {
    const x = i * canvas.width / 59, y = canvas.height - 2 - v / top * (canvas.height - 4);
    i ? g.lineTo(x, y) : g.moveTo(x, y);
  });
  g.stroke();
}
function render(data) {
  document.getElementById("model").textContent =
    data.model + " on " + data.stages.length + " stage" + (data.stages.length > 1 ? "s" : "");
  const chain = document.getElementById("chain");
  chain.replaceChildren();
  data.stages.forEach((stage, i) => {
    if (i) { const a = document.createElement("div"); a.className = "arrow"; a.textContent = "\\u2192"; chain.appendChild(a); }
    chain.appendChild(stageBox(stage));
  });
  document.getElementById("rate").textContent = fmt(data.tokens_per_s, 1);
  document.getElementById("active").textContent = data.active;
  document.getElementById("queued").textContent = data.queued;
  const accepted = (data.stages[0].figures || {}).speculative_acceptance;
  document.getElementById("accept").textContent = accepted ? fmt(100 * accepted, 0) + "%" : "-";
  history.push(data.tokens_per_s);
  if (history.length > 60) history.shift();
  drawSpark();
  const body = document.getElementById("recent");
  body.replaceChildren();
  for (const r of data.recent) {
    const tr = document.createElement("tr");
    tr.append(cell(new Date(r.finished_at * 1000).toLocaleTimeString()), cell(r.outcome), cell(r.prompt_tokens),
              cell(r.cached_tokens), cell(r.completion_tokens), cell(fmt(r.ttft_ms, 0)), cell(fmt(r.decode_tok_s, 1)));
    body.appendChild(tr);
  }
}
async function poll() {
  try {
    const response = await fetch("/v1/chain", {cache: "no-store"});
    if (!response.ok) throw new Error("GET /v1/chain answered " + response.status);
    render(await response.json());
    document.getElementById("error").textContent = "";
  } catch (error) {
    document.getElementById("error").textContent = "Cannot reach the API: " + error.message;
  }
  setTimeout(poll, 1000);
}
poll();
</script>
</body></html>
"""
