"""The status page served at `GET /`: one HTML document with inline CSS and a small inline
script (no build step) that reads `GET /v1/status` every 2 s and draws it (a running job's
latest preview comes in it as a data URL, so the page needs no image route for it); and, for
a gateway with tokens, the sign-in form `GET /` shows a browser without a session (it sends
the token to `GET /?token=`, which sets the session cookie)."""

from __future__ import annotations

REFRESH_MS = 2000

PAGE_HTML = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>sdfarm status</title>
<style>
  :root { --bg:#f4f5f7; --card:#fff; --ink:#1d2330; --dim:#677085; --line:#dfe3ea;
          --ours:#2f6fdf; --other:#e59a2f; --free:#d9efdc; --busy:#d0342c; --idle:#2e9b4f; }
  * { box-sizing: border-box; }
  body { margin:0; font:14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif;
         background:var(--bg); color:var(--ink); }
  header { display:flex; align-items:baseline; gap:16px; padding:14px 24px;
           background:#1d2330; color:#fff; }
  header h1 { margin:0; font-size:20px; font-weight:600; }
  header .meta { color:#aab3c5; font-size:13px; }
  header .err { color:#ff8a80; font-weight:600; }
  main { display:grid; grid-template-columns: 3fr 2fr; gap:16px; padding:16px 24px; }
  section { background:var(--card); border:1px solid var(--line); border-radius:8px;
            padding:12px 16px; }
  section h2 { margin:0 0 10px; font-size:13px; text-transform:uppercase; letter-spacing:.06em;
               color:var(--dim); }
  .wide { grid-column: 1 / -1; }
  .host { margin-bottom:12px; }
  .host h3 { margin:0 0 6px; font-size:15px; }
  .dev { border-top:1px solid var(--line); padding:8px 0; }
  .dev .name { font-weight:600; }
  .dev .sub { color:var(--dim); font-size:12px; }
  .bar { display:flex; height:16px; border-radius:4px; overflow:hidden; margin:6px 0 4px;
         background:var(--free); border:1px solid var(--line); }
  .bar span { display:block; height:100%; }
  .bar .ours { background:var(--ours); } .bar .other { background:var(--other); }
  .legend { font-size:12px; color:var(--dim); }
  .legend i { display:inline-block; width:10px; height:10px; border-radius:2px;
              margin:0 4px 0 10px; vertical-align:-1px; }
  .legend i:first-child { margin-left:0; }
  .models { margin:6px 0 0; padding:0; list-style:none; }
  .models li { display:inline-block; margin:2px 6px 2px 0; padding:2px 8px; border-radius:10px;
               font-size:12px; color:#fff; }
  .models .busy { background:var(--busy); } .models .idle { background:var(--idle); }
  .pill { display:inline-block; padding:1px 7px; border-radius:9px; font-size:11px;
          background:#e8ebf1; color:var(--ink); margin-left:6px; }
  .pill.off { background:#fde2e0; color:#a32019; }
  table { width:100%; border-collapse:collapse; }
  td, th { text-align:left; padding:4px 6px; border-bottom:1px solid var(--line); }
  th { font-size:12px; color:var(--dim); font-weight:500; }
  table.narrow { width:auto; min-width:60%; }
  td.num, th.num { text-align:right; font-variant-numeric: tabular-nums; }
  .qbar { display:inline-block; height:10px; background:var(--ours); border-radius:2px;
          vertical-align:middle; }
  .prog { width:140px; height:10px; background:#e8ebf1; border-radius:5px; overflow:hidden;
          display:inline-block; vertical-align:middle; }
  .prog span { display:block; height:100%; background:var(--idle); }
  img.preview { width:96px; height:96px; object-fit:contain; border-radius:4px;
                background:#e8ebf1; image-rendering:pixelated; border:1px solid var(--line); }
  code { font:12px ui-monospace, SFMono-Regular, Menlo, monospace; }
  .thumbs { display:grid; grid-template-columns:repeat(8, 1fr); gap:10px; }
  .thumbs figure { margin:0; }
  .thumbs img { width:100%; aspect-ratio:1; object-fit:cover; border-radius:6px;
                background:#e8ebf1; image-rendering:pixelated; border:1px solid var(--line); }
  .thumbs figcaption { font-size:11px; color:var(--dim); white-space:nowrap; overflow:hidden;
                       text-overflow:ellipsis; }
  .empty { color:var(--dim); font-style:italic; }
</style>
</head>
<body>
<div id="sdfarm-status">
<header><h1>sdfarm</h1><span class="meta" id="meta">loading&hellip;</span></header>
<main>
  <section id="devices"><h2>Hosts and devices</h2><div id="hosts"></div></section>
  <section id="queue"><h2>Queue</h2><div id="queues"></div>
    <h2 style="margin-top:14px">Running jobs</h2><div id="running"></div></section>
  <section id="recent" class="wide"><h2>Latest images</h2><div id="thumbs"></div></section>
</main>
</div>
<script>
"use strict";
const REFRESH_MS = __REFRESH_MS__;
const $ = (id) => document.getElementById(id);
const esc = (s) => String(s == null ? "" : s).replace(/[&<>"']/g,
  (c) => ({"&":"&amp;","<":"&lt;",">":"&gt;",'"':"&quot;","'":"&#39;"})[c]);
function bytes(n) {
  if (n == null || isNaN(n)) return "-";
  const u = ["B","KiB","MiB","GiB","TiB"]; let i = 0; n = Number(n);
  while (n >= 1024 && i < u.length - 1) { n /= 1024; i++; }
  return (i ? n.toFixed(1) : n.toFixed(0)) + " " + u[i];
}
function pct(part, total) { return total > 0 ? Math.max(0, Math.min(100, 100 * part / total)) : 0; }
function device(d) {
  const m = d.memory || {}, total = m.total || 0;
  const ours = Math.min(m.ours || 0, total), other = m.other || 0;
  const models = (d.loaded || []).map((x) =>
    `<li class="${x.busy ? "busy" : "idle"}">${esc(x.name)} &middot; ${x.busy ? "busy" :
      "idle " + Math.round(x.idle_s || 0) + " s"} &middot; ${bytes(x.estimate)}</li>`).join("");
  return `<div class="dev"><span class="name">${esc(d.device)}</span>
    <span class="pill">${esc(d.type || "?")}</span>
    <span class="pill ${d.alive ? "" : "off"}">
      ${esc(d.alive ? (d.state || "up") : "offline")}</span>
    <span class="sub">${esc(d.description)}</span>
    <div class="bar" title="ours ${bytes(m.ours)}, other ${bytes(other)}, free ${bytes(m.free)}">
      <span class="ours" style="width:${pct(ours, total)}%"></span>
      <span class="other" style="width:${pct(other, total)}%"></span></div>
    <div class="legend"><i style="background:var(--ours)"></i>engines ${bytes(m.ours)}
      <i style="background:var(--other)"></i>other ${bytes(other)}
      <i style="background:var(--free)"></i>free ${bytes(m.free)} of ${bytes(total)}
      &nbsp;&middot;&nbsp; figure ${bytes(d.figure)}</div>
    <ul class="models">${models || '<span class="empty">no model loaded</span>'}</ul>
  </div>`;
}
function render(s) {
  const byKey = {}; (s.devices || []).forEach((d) => { byKey[d.key] = d; });
  $("hosts").innerHTML = (s.hosts || []).map((h) => `<div class="host"><h3>${esc(h.host)}</h3>
    ${h.devices.map((k) => device(byKey[k])).join("")}</div>`).join("")
    || '<p class="empty">no workers</p>';
  const q = s.queues || {}, qmax = Math.max(1, ...Object.values(q));
  const busy = Object.keys(q).filter((p) => q[p] > 0).sort((a, b) => a - b);
  $("queues").innerHTML = (busy.length ? `<table class="narrow"><tr><th>priority</th>
    <th class="num">waiting</th><th></th></tr>
    ${busy.map((p) => `<tr><td>p${esc(p)}</td>
      <td class="num">${q[p]}</td><td><span class="qbar" style="width:${120 * q[p] / qmax}px">
      </span></td></tr>`).join("")}</table>` : '<p class="empty">empty</p>') + `
    <div class="legend" style="margin-top:4px">pending ${s.pending || 0}</div>`;
  const runs = s.running || [];
  $("running").innerHTML = runs.length ? `<table><tr><th>job</th><th>model</th><th>device</th>
    <th>progress</th><th>preview</th></tr>${runs.map((j) => {
      const p = j.progress || {}, steps = p.steps || 0, step = p.step || 0, v = j.preview;
      return `<tr><td><code>${esc(j.id.slice(0, 8))}</code></td><td>${esc(j.model)}</td>
        <td>${esc(j.device || "-")}</td><td><span class="prog"><span
        style="width:${pct(step, steps)}%"></span></span>
        ${steps ? `step ${step}/${steps}` : esc(j.state)}</td>
        <td>${v ? `<img class="preview" src="${esc(v.url)}" alt="preview at step ${esc(v.step)}"
          title="step ${esc(v.step)}/${esc(v.steps)}">` : ""}</td></tr>`;
    }).join("")}</table>` : '<p class="empty">nothing running</p>';
  const rec = s.recent || [];
  $("thumbs").innerHTML = rec.length ? `<div class="thumbs">${rec.map((r) => `<figure>
    <a href="${esc(r.url)}"><img src="${esc(r.url)}" alt="${esc(r.prompt)}"></a>
    <figcaption title="${esc(r.prompt)}">${esc(r.prompt || r.id.slice(0, 8))}</figcaption>
    </figure>`).join("")}</div>` : '<p class="empty">no images yet</p>';
  $("meta").innerHTML = `${(s.devices || []).filter((d) => d.alive).length} devices up
    &middot; scheduler ${esc(s.leader || "none")}
    &middot; ${new Date(s.time * 1000).toLocaleTimeString()}`;
}
async function tick() {
  try {
    const r = await fetch("v1/status", {cache: "no-store"});
    if (r.status === 401) { location.reload(); return; }  // the session expired: sign in
    if (!r.ok) throw new Error("HTTP " + r.status);
    render(await r.json());
  } catch (e) {
    $("meta").innerHTML = `<span class="err">status unavailable: ${esc(e.message)}</span>`;
  }
  setTimeout(tick, REFRESH_MS);
}
tick();
</script>
</body>
</html>
""".replace("__REFRESH_MS__", str(REFRESH_MS))

LOGIN_HTML = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>sdfarm: sign in</title>
<style>
  body { margin:0; font:14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif;
         background:#f4f5f7; color:#1d2330; display:grid; place-items:center; height:100vh; }
  form { background:#fff; border:1px solid #dfe3ea; border-radius:8px; padding:20px 24px; }
  h1 { margin:0 0 12px; font-size:18px; }
  input { font:inherit; padding:6px 8px; width:22em; margin-right:6px; }
</style>
</head>
<body>
<form method="get" action="./">
  <h1>sdfarm status</h1>
  <p>This gateway needs a token.</p>
  <input type="password" name="token" placeholder="token" autocomplete="current-password"
         autofocus required><button type="submit">Sign in</button>
</form>
</body>
</html>
"""
