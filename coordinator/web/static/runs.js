// The list of runs (coordinator/web): /api/runs, refreshed every few seconds.
"use strict";

function cell(row, text, cls) {
  const td = document.createElement("td");
  td.textContent = text;
  if (cls) td.className = cls;
  row.appendChild(td);
  return td;
}

function when(t) { return t ? new Date(t * 1000).toLocaleString() : ""; }

async function refresh() {
  const live = document.getElementById("live");
  try {
    const r = await fetch("/api/runs", {cache: "no-store"});
    const runs = await r.json();
    const body = document.querySelector("#runs tbody");
    body.replaceChildren();
    for (const run of runs) {
      const tr = document.createElement("tr");
      tr.dataset.run = run.run_id;
      tr.dataset.status = run.status;
      const a = document.createElement("a");
      a.href = "/runs/" + encodeURIComponent(run.run_id);
      a.textContent = run.run_id;
      cell(tr, "").appendChild(a);
      cell(tr, run.strategy + (run.rounds > 1 ? ` ×${run.rounds}` : ""));
      const st = cell(tr, "");
      const badge = document.createElement("span");
      badge.className = "status status-" + run.status;
      badge.textContent = run.status;
      st.appendChild(badge);
      cell(tr, when(run.created));
      cell(tr, when(run.ended));
      cell(tr, run.sites.join(", "));
      cell(tr, run.accuracy == null ? "" : run.accuracy.toFixed(4), "num");
      body.appendChild(tr);
    }
    document.getElementById("no-runs").hidden = runs.length > 0;
    live.textContent = "updated " + new Date().toLocaleTimeString();
  } catch (e) {
    live.textContent = "coordinator not reachable: " + e;
  }
}

refresh();
setInterval(refresh, 3000);
