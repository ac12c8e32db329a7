// One run's live page (coordinator/web): fetches /api/runs/{id}, redraws it whenever the
// server-sent event stream /runs/{id}/events announces a ledger event. No reloads, no CDN.
"use strict";

const RUN_ID = decodeURIComponent(location.pathname.split("/")[2] || "");
const SVG = "http://www.w3.org/2000/svg";
const STATE_COLORS = {waiting: "#9aa5b1", receiving: "#f0a202", training: "#2f80ed", sending: "#9b51e0",
                      done: "#27ae60", skipped: "#c8ccd0", failed: "#eb5757"};
const TRANSFER_COLORS = {planned: "#c3cad1", sent: "#f0a202", received: "#f0a202", done: "#27ae60",
                         disputed: "#eb5757"};
const SITE_COLORS = ["#2f80ed", "#eb5757", "#27ae60", "#9b51e0", "#f2994a", "#00a3a3", "#d6409f", "#6b7280",
                     "#b7950b", "#1e3a8a"];

let source = null, timer = null, inflight = false, again = false, charts = {};

function node(tag, attrs = {}, text = null, ns = null) {
  const e = ns ? document.createElementNS(ns, tag) : document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) if (v !== null && v !== undefined) e.setAttribute(k, v);
  if (text !== null) e.textContent = text;
  return e;
}
const svg = (tag, attrs, text) => node(tag, attrs, text, SVG);
const when = t => t ? new Date(t * 1000).toLocaleTimeString() : "";
const bytes = n => n == null ? "" : n.toLocaleString("en-US");
const transferName = t => t.purpose === "chain" ? `hop ${t.index}` : t.purpose === "upload" ? `upload ${t.index}` : "final copy";

function setLive(text) { document.getElementById("live").textContent = text; }

// ---- the summary line ----------------------------------------------------------------------
function drawSummary(d) {
  document.title = `${d.run_id} · ${d.status} · fedrelay`;
  document.getElementById("run-id").textContent = d.run_id;
  const st = document.getElementById("run-status");
  st.textContent = d.status;
  st.className = "status status-" + d.status;
  st.dataset.status = d.status;
  const items = [
    ["strategy", d.strategy + (d.rounds > 1 ? ` × ${d.rounds} rounds` : "")],
    ["sites", d.order.length],
    ["model", d.arch],
    ["M", d.model_bytes ? bytes(d.model_bytes) + " B" : "–"],
    ["bytes sent", bytes(d.transfers.reduce((a, t) => a + (t.payload_bytes || 0), 0)) + " B"],
    ["transfers", `${d.transfers.filter(t => t.status === "done").length} / ${d.transfers.length} done`],
    ["started", when(d.created)],
    ["ended", d.ended ? when(d.ended) : "–"],
    ["global accuracy", d.final && d.final.accuracy != null ? d.final.accuracy.toFixed(4) : "–"],
  ];
  if (d.privacy) items.push(["differential privacy", d.privacy]);
  if (d.insecure) items.push(["transport", "insecure (plaintext)"]);
  const dl = document.getElementById("summary");
  dl.replaceChildren(...items.map(([k, v]) => {
    const div = node("div", {"data-key": k});
    div.append(node("dt", {}, k), node("dd", {}, String(v)));
    return div;
  }));
  const err = document.getElementById("run-error");
  err.hidden = !d.error;
  err.textContent = d.error || "";
}

// ---- the plan as a graph -------------------------------------------------------------------
function drawGraph(d) {
  const g = document.getElementById("graph");
  const names = d.order, n = names.length;
  const W = Math.max(600, n * 140), H = 250, Y = 115, R = 30;
  g.setAttribute("viewBox", `0 0 ${W} ${H}`);
  g.replaceChildren();
  const defs = svg("defs");
  for (const [status, color] of Object.entries(TRANSFER_COLORS)) {
    const m = svg("marker", {id: "arrow-" + status, viewBox: "0 0 10 10", refX: 9, refY: 5, markerWidth: 7,
                             markerHeight: 7, orient: "auto-start-reverse"});
    m.appendChild(svg("path", {d: "M0,0 L10,5 L0,10 z", fill: color}));
    defs.appendChild(m);
  }
  g.appendChild(defs);
  const pos = {};
  names.forEach((s, i) => { pos[s] = {x: n === 1 ? W / 2 : 70 + i * (W - 140) / (n - 1), y: Y}; });
  const arrows = svg("g", {class: "transfers"});
  for (const t of d.transfers) {
    const a = pos[t.sender], b = pos[t.receiver];
    if (!a || !b || a === b) continue;
    const dx = b.x - a.x, above = t.purpose !== "final";
    const bend = (above ? -1 : 1) * (22 + Math.abs(dx) * 0.18) * (1 + 0.35 * ((t.round || 1) - 1));
    const c = {x: (a.x + b.x) / 2, y: Y + bend};
    const edge = (p, q) => { const l = Math.hypot(q.x - p.x, q.y - p.y) || 1; return {x: p.x + (q.x - p.x) * (R + 3) / l, y: p.y + (q.y - p.y) * (R + 3) / l}; };
    const s = edge(a, c), e = edge(b, c);
    const color = TRANSFER_COLORS[t.status] || TRANSFER_COLORS.planned;
    const path = svg("path", {d: `M${s.x},${s.y} Q${c.x},${c.y} ${e.x},${e.y}`, stroke: color,
                              class: `transfer purpose-${t.purpose} st-${t.status}`, "data-hop": t.key,
                              "data-status": t.status, "marker-end": `url(#arrow-${t.status in TRANSFER_COLORS ? t.status : "planned"})`});
    path.appendChild(svg("title", {}, `${transferName(t)}: ${t.sender} → ${t.receiver}, ${t.status}` +
                                      (t.payload_bytes ? `, ${bytes(t.payload_bytes)} bytes` : "")));
    arrows.appendChild(path);
    if (t.purpose !== "final") {
      const mid = {x: (s.x + 2 * c.x + e.x) / 4, y: (s.y + 2 * c.y + e.y) / 4};
      arrows.appendChild(svg("text", {x: mid.x, y: mid.y - 4, class: "hop-label"},
                             t.purpose === "chain" ? `hop ${t.index}` : `up ${t.index}`));
    }
  }
  g.appendChild(arrows);
  for (const name of names) {
    const s = d.sites[name], p = pos[name];
    const site = svg("g", {class: `site state-${s.state}`, "data-site": name, "data-state": s.state,
                           "data-label": s.label});
    site.appendChild(svg("title", {}, `${name}: ${s.label}${s.detail ? " — " + s.detail : ""}`));
    site.appendChild(svg("circle", {cx: p.x, cy: p.y, r: R, fill: STATE_COLORS[s.state] || STATE_COLORS.waiting}));
    site.appendChild(svg("text", {x: p.x, y: p.y + 4, class: "name"}, name));
    const role = name === d.aggregator ? "aggregator" : (name === d.final_site ? "final model" : "");
    if (role) site.appendChild(svg("text", {x: p.x, y: p.y - R - 6, class: "role"}, role));
    const [first, second] = splitLabel(s);
    site.appendChild(svg("text", {x: p.x, y: p.y + R + 14, class: "label"}, first));
    if (second) site.appendChild(svg("text", {x: p.x, y: p.y + R + 27, class: "label"}, second));
    if (s.accuracy != null) site.appendChild(svg("text", {x: p.x, y: p.y + R + (second ? 40 : 27), class: "acc"},
                                                 `acc ${s.accuracy.toFixed(3)}`));
    g.appendChild(site);
  }
  const legend = document.getElementById("legend");
  legend.replaceChildren(...Object.entries(STATE_COLORS).map(([k, c]) => {
    const e = node("span", {style: `--c: ${c}`}, k);
    return e;
  }), node("span", {style: `--c: ${TRANSFER_COLORS.done}`}, "transfer done (both ends agree)"),
      node("span", {style: `--c: ${TRANSFER_COLORS.planned}`}, "planned"),
      node("span", {style: `--c: ${TRANSFER_COLORS.sent}`}, "one end reported"));
  document.getElementById("plan-note").textContent = d.aggregator ? `(star around ${d.aggregator}; dashed: final copies)`
                                                                    : "(chain in plan order; dashed: final copies)";
}

function splitLabel(s) {
  if (s.state === "training" && s.epoch) {
    const stage = s.stage === "pool" ? `pool model ${s.model}` : s.stage === "warmup" ? "warm-up" : (s.stage || "");
    return ["training", `${stage} · epoch ${s.epoch}/${s.epochs}`];
  }
  return [s.state, ""];
}

// ---- the transfer table --------------------------------------------------------------------
function drawTransfers(d) {
  const body = document.querySelector("#transfers tbody");
  body.replaceChildren(...d.transfers.map(t => {
    const tr = node("tr", {"data-hop": t.key, "data-status": t.status});
    const td = (text, cls, title) => tr.appendChild(node("td", {class: cls, title}, text));
    td(t.purpose === "chain" ? "hop" : t.purpose);
    td(t.purpose === "final" ? "" : String(t.index), "num");
    td(String(t.round), "num");
    td(`${t.sender} → ${t.receiver}` + (t.route === "relayed" ? " (via the relay, sealed)" : ""));
    td(bytes(t.payload_bytes), "num");
    td(t.sha256 ? t.sha256.slice(0, 10) : "", "sha", t.sha256 || null);
    td(t.attempts ? String(t.attempts) : "", "num");
    td(t.seconds == null ? "" : t.seconds.toFixed(2), "num");
    const st = node("td", {class: "st"});
    st.appendChild(node("span", {class: "st-" + t.status}, t.status));
    tr.appendChild(st);
    return tr;
  }));
}

// ---- the timeline --------------------------------------------------------------------------
function drawTimeline(d) {
  const g = document.getElementById("timeline");
  const names = d.order, left = 80, W = 600, rowH = 22, top = 6;
  const H = top + names.length * rowH + 20;
  g.setAttribute("viewBox", `0 0 ${W} ${H}`);
  g.replaceChildren();
  const t0 = d.created, t1 = Math.max(d.ended || d.now, t0 + 1);
  const x = t => left + (W - left - 8) * (Math.min(Math.max(t, t0), t1) - t0) / (t1 - t0);
  names.forEach((name, i) => {
    const y = top + i * rowH;
    g.appendChild(svg("text", {x: 0, y: y + 14}, name));
    g.appendChild(svg("line", {x1: left, x2: W - 8, y1: y + rowH - 2, y2: y + rowH - 2, stroke: "#e4e7eb"}));
  });
  for (const s of d.timeline) {
    const i = names.indexOf(s.site);
    if (i < 0) continue;
    const y = top + i * rowH, a = x(s.start), b = x(s.end || d.now);
    const transfer = s.kind === "transfer";
    const r = svg("rect", {x: a, width: Math.max(1.5, b - a), y: transfer ? y + 13 : y + 2, height: transfer ? 6 : 16,
                           fill: transfer ? "#102a43" : (STATE_COLORS[s.kind] || "#ccc"), rx: 2,
                           "data-site": s.site, "data-kind": s.kind, "data-hop": s.key || null});
    r.appendChild(svg("title", {}, `${s.site}: ${s.kind}${s.detail ? " (" + s.detail + ")" : ""}, ` +
                                   `${when(s.start)} – ${s.end ? when(s.end) : "now"}`));
    g.appendChild(r);
  }
  const span = t1 - t0, y = top + names.length * rowH + 14;
  for (let k = 0; k <= 5; k++) {
    const t = t0 + span * k / 5;
    g.appendChild(svg("text", {x: x(t) - (k === 5 ? 30 : 0), y, class: "tick"}, `+${(span * k / 5).toFixed(span < 20 ? 1 : 0)} s`));
  }
}

// ---- learning curves (uPlot) ---------------------------------------------------------------
function drawCurves(d) {
  const sites = d.order.filter(s => d.metrics.some(m => m.site === s));
  document.getElementById("no-curves").hidden = sites.length > 0;
  if (!window.uPlot || !sites.length) return;
  const per = Object.fromEntries(sites.map(s => [s, d.metrics.filter(m => m.site === s)]));
  const len = Math.max(...sites.map(s => per[s].length));
  const xs = Array.from({length: len}, (_, i) => i + 1);
  const series = key => sites.map(s => xs.map((_, i) => per[s][i] && per[s][i][key] != null ? per[s][i][key] : null));
  for (const [id, key, title] of [["curve-acc", "val_accuracy", "validation accuracy"],
                                  ["curve-loss", "train_loss", "training loss"]]) {
    const data = [xs, ...series(key)];
    const names = sites.join(",");
    const box = document.getElementById(id);
    if (charts[id] && charts[id].names === names) {
      charts[id].plot.setData(data);
      continue;
    }
    if (charts[id]) charts[id].plot.destroy();
    const opts = {
      title, width: Math.max(240, box.clientWidth || 280), height: 200,
      scales: {x: {time: false}}, legend: {show: true, live: false},
      axes: [{label: "epoch at the site", size: 36, incrs: [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000]}, {size: 46}],
      series: [{label: "epoch"}, ...sites.map((s, i) => ({label: s, stroke: SITE_COLORS[d.order.indexOf(s) % SITE_COLORS.length],
                                                         width: 2, spanGaps: true, points: {size: 4}}))],
    };
    box.dataset.sites = names;
    charts[id] = {names, plot: new uPlot(opts, data, box)};
  }
}

// ---- final metrics and events ----------------------------------------------------------------
// The table comes from the server (views.final_table): accuracy, the other built-in metrics,
// then the task's own, per site and globally.
function drawFinal(d) {
  const t = d.final_table;
  const num = v => v == null ? "–" : v.toFixed(4);
  const head = node("tr");
  head.append(node("th", {}, "site"), ...t.columns.map(([key, label]) => node("th", {class: "num", "data-metric": key}, label)),
              node("th", {class: "num"}, "test samples"));
  if (t.privacy) head.append(node("th", {"data-metric": "privacy"}, "privacy spent (DP-SGD)"));
  document.querySelector("#final thead").replaceChildren(head);
  const cells = (tag, r) => [...t.columns.map(([key]) => node(tag, {class: "num", "data-metric": key}, num(r.values[key]))),
                             node(tag, {class: "num"}, r.test_samples == null ? "" : String(r.test_samples)),
                             ...(t.privacy ? [node(tag, {"data-metric": "privacy"}, r.privacy || "")] : [])];
  const rows = t.rows.map(r => {
    const tr = node("tr", {"data-site": r.site});
    tr.append(node("td", {}, r.site), ...cells("td", r));
    return tr;
  });
  const all = node("tr", {"data-site": "", class: "global"});
  all.append(node("th", {}, "global"), ...(t.global ? cells("th", t.global)
                                                    : cells("th", {values: {}, test_samples: null})));
  document.querySelector("#final tbody").replaceChildren(...rows, all);
}

function drawEvents(d) {
  const list = document.getElementById("events");
  list.replaceChildren(...d.events.slice().reverse().map(e => {
    const li = node("li", {"data-seq": e.seq, "data-kind": e.kind});
    li.append(node("span", {class: "t"}, when(e.time)), node("span", {class: "k"}, e.kind), document.createTextNode(e.message));
    return li;
  }));
}

function render(d) {
  drawSummary(d);
  drawGraph(d);
  drawTransfers(d);
  drawTimeline(d);
  drawCurves(d);
  drawFinal(d);
  drawEvents(d);
  document.body.dataset.lastSeq = d.last_seq;
}

// ---- keeping it live -------------------------------------------------------------------------
async function refresh() {
  if (inflight) { again = true; return null; }
  inflight = true;
  try {
    const r = await fetch("/api/runs/" + encodeURIComponent(RUN_ID), {cache: "no-store"});
    const d = await r.json();
    if (!r.ok) { setLive(d.error || r.statusText); return null; }
    render(d);
    return d;
  } catch (e) {
    setLive("coordinator not reachable: " + e);
    return null;
  } finally {
    inflight = false;
    if (again) { again = false; schedule(); }
  }
}

function schedule() {
  if (timer === null) timer = setTimeout(() => { timer = null; refresh(); }, 150);
}

function follow(after) {
  source = new EventSource(`/runs/${encodeURIComponent(RUN_ID)}/events?after=${after}`);
  source.onopen = () => setLive("live");
  source.onmessage = () => { setLive("live · " + new Date().toLocaleTimeString()); schedule(); };
  source.addEventListener("end", () => { source.close(); setLive("run ended"); schedule(); });
  source.onerror = () => { if (source.readyState !== EventSource.CLOSED) setLive("reconnecting…"); };
}

refresh().then(d => {
  if (d && d.status === "running") follow(d.last_seq);
  else if (d) setLive("run ended");
});
