// cmemi dashboard: polls api/state every second and renders it. Plain JS, no library, no build step.
// Every value is also written to a stable id / data-* attribute, so a test (or a script) reads the page
// without parsing pixels: #step[data-step], #workers tr[data-worker][data-state][data-incarnation],
// #events li[data-kind][data-id][data-incarnation], #checkpoints tr[data-step], svg.curve[data-points][data-last-step].
"use strict";

const TOKEN = new URLSearchParams(location.search).get("token");
const POLL_MS = 1000;
const SVG = "http://www.w3.org/2000/svg";
const PALETTE = ["#2864c7", "#c7822b", "#1f9d6b", "#8e44ad", "#c73a2b", "#555"];
const MARKED = { died: "died", fenced: "fenced", restarted: "restarted", aggregator_started: "aggregator",
                 checkpoint_restored: "restored" };  // events drawn as vertical lines on the curves
const MAX_EVENTS_SHOWN = 300;

const held = { metrics: [], mgen: null, events: [], egen: null, polls: 0, eventsDrawn: -1 };

function $(id) { return document.getElementById(id); }

function url(path, params) {
  const q = new URLSearchParams(params);
  if (TOKEN) q.set("token", TOKEN);
  return path + "?" + q.toString();
}

function num(v, digits) {
  if (v === null || v === undefined || !isFinite(v)) return "-";
  const a = Math.abs(v);
  if (a !== 0 && (a < 1e-3 || a >= 1e6)) return Number(v).toExponential(digits - 1);
  return Number(v).toPrecision(digits).replace(/\.?0+$/, "");
}

function age(s) {
  if (s === null || s === undefined) return "-";
  return s < 60 ? s.toFixed(1) + " s" : Math.round(s / 60) + " min";
}

function bytes(n) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
  return (i ? n.toFixed(1) : String(n)) + " " + units[i];
}

function clock(t) {
  const d = new Date(t * 1000);
  const p = (x, n) => String(x).padStart(n || 2, "0");
  return p(d.getHours()) + ":" + p(d.getMinutes()) + ":" + p(d.getSeconds()) + "." + p(d.getMilliseconds(), 3);
}

function setValue(id, attr, value, text) {
  const el = $(id);
  el.setAttribute(attr, value === null || value === undefined ? "" : String(value));
  el.textContent = text;
}

// ---------------------------------------------------------------- the curves
// One point per step; where the step goes back (an aggregator restored a checkpoint) the later points are
// dropped, so a curve shows the run's history as it now stands.
function history(rows, pick) {
  const pts = [];
  for (const r of rows) {
    const v = pick(r);
    if (v === undefined) continue;
    while (pts.length && pts[pts.length - 1][0] >= r.step) pts.pop();
    if (v !== null && isFinite(v)) pts.push([r.step, v, r.t]);
  }
  return pts;
}

// At most two points (the lowest and the highest) per pixel column: a spike stays visible on a long run.
function thin(pts, columns) {
  if (pts.length <= 2 * columns) return pts;
  const out = [];
  const per = pts.length / columns;
  for (let i = 0; i < columns; i += 1) {
    const seg = pts.slice(Math.floor(i * per), Math.floor((i + 1) * per));
    if (!seg.length) continue;
    let lo = seg[0], hi = seg[0];
    for (const p of seg) { if (p[1] < lo[1]) lo = p; if (p[1] > hi[1]) hi = p; }
    if (lo[0] <= hi[0]) out.push(lo, hi); else out.push(hi, lo);
  }
  return out;
}

// The step the run was at time t (from the logged steps' wall times): where an event is marked.
function stepAt(pts, t) {
  let lo = 0, hi = pts.length - 1, found = null;
  while (lo <= hi) {
    const mid = (lo + hi) >> 1;
    if (pts[mid][2] <= t) { found = pts[mid][0]; lo = mid + 1; } else { hi = mid - 1; }
  }
  return found;
}

function node(tag, attrs, text) {
  const el = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, String(v));
  if (text !== undefined) el.textContent = text;
  return el;
}

// Draw `series` ([{pts, color}]) into an inline <svg>; each series on its own y scale unless `shared`.
function draw(svg, series, markers, shared) {
  const w = Math.max(200, Math.round(svg.clientWidth || 600)), h = 200, left = 52, right = 8, top = 8, bottom = 20;
  svg.setAttribute("viewBox", `0 0 ${w} ${h}`);
  svg.replaceChildren();
  const all = series.flatMap((s) => s.pts);
  const main = series.length ? series[0].pts : [];
  svg.dataset.points = String(main.length);
  svg.dataset.lastStep = main.length ? String(main[main.length - 1][0]) : "";
  svg.dataset.lastValue = main.length ? String(main[main.length - 1][1]) : "";
  svg.dataset.markers = "0";
  if (!all.length) {
    svg.append(node("text", { x: w / 2, y: h / 2, "text-anchor": "middle", class: "axis" }, "no data yet"));
    return;
  }
  const x0 = Math.min(...all.map((p) => p[0])), x1 = Math.max(...all.map((p) => p[0]));
  const sx = (x) => left + (x1 > x0 ? (x - x0) / (x1 - x0) : 0.5) * (w - left - right);
  const range = (pts) => {
    let lo = Infinity, hi = -Infinity;
    for (const p of pts) { lo = Math.min(lo, p[1]); hi = Math.max(hi, p[1]); }
    return hi > lo ? [lo, hi] : [lo - 1, hi + 1];
  };
  const sharedRange = range(all);
  for (let i = 0; i <= 4; i += 1) {
    const y = top + (i / 4) * (h - top - bottom);
    svg.append(node("line", { x1: left, x2: w - right, y1: y, y2: y, class: "grid" }));
  }
  const [ylo, yhi] = shared || series.length === 1 ? sharedRange : [null, null];
  if (ylo !== null) {
    svg.append(node("text", { x: left - 4, y: top + 10, "text-anchor": "end", class: "axis" }, num(yhi, 3)));
    svg.append(node("text", { x: left - 4, y: h - bottom, "text-anchor": "end", class: "axis" }, num(ylo, 3)));
  }
  svg.append(node("text", { x: left, y: h - 4, class: "axis" }, "step " + x0));
  svg.append(node("text", { x: w - right, y: h - 4, "text-anchor": "end", class: "axis" }, "step " + x1));
  for (const m of markers) {
    if (m.step === null || m.step < x0 || m.step > x1) continue;  // before the first logged step: not drawn
    svg.dataset.markers = String(Number(svg.dataset.markers) + 1);
    const line = node("line", { x1: sx(m.step), x2: sx(m.step), y1: top, y2: h - bottom, class: "marker" });
    line.append(node("title", {}, m.label));
    svg.append(line);
  }
  for (const s of series) {
    if (!s.pts.length) continue;
    const [lo, hi] = ylo !== null ? [ylo, yhi] : range(s.pts);
    const sy = (y) => top + (1 - (y - lo) / (hi - lo)) * (h - top - bottom);
    const pts = thin(s.pts, w - left - right).map((p) => sx(p[0]).toFixed(1) + "," + sy(p[1]).toFixed(1));
    const attrs = { points: pts.join(" ") };
    if (s.color) attrs.stroke = s.color;  // an attribute: the CSP allows no inline style attribute
    svg.append(node("polyline", attrs));
    if (s.pts.length === 1) {  // one evaluation: a dot, as a polyline of one point draws nothing
      svg.append(node("circle", { cx: sx(s.pts[0][0]), cy: sy(s.pts[0][1]), r: 3, fill: s.color || "currentColor" }));
    }
  }
}

function drawCurves(report) {
  const rows = held.metrics;
  const loss = history(rows, (r) => ("loss" in r ? r.loss : undefined));
  const thr = history(rows, (r) => ("loss" in r ? r.samples_per_s : undefined));
  const markers = held.events.filter((e) => e.kind in MARKED && e.role !== "redis").map((e) => ({
    step: stepAt(loss, e.t), label: `${MARKED[e.kind]} ${e.role || ""} ${e.id || e.worker || ""}`.trim() }));
  draw($("curve-loss"), [{ pts: loss }], markers, true);
  draw($("curve-throughput"), [{ pts: thr }], markers, true);
  const keys = [];
  for (const r of rows) {
    if (r.eval) for (const k of Object.keys(r.eval)) if (typeof r.eval[k] === "number" && !keys.includes(k)) keys.push(k);
  }
  let evals = keys.map((k, i) => ({ key: k, color: PALETTE[i % PALETTE.length],
    pts: history(rows, (r) => (r.eval ? (k in r.eval ? r.eval[k] : null) : undefined)) }));
  if (!evals.length && report && report.eval) {  // no eval.every_steps: the final evaluation (summary.json) alone
    evals = Object.keys(report.eval).filter((k) => k !== "step" && typeof report.eval[k] === "number").map((k, i) => (
      { key: k, color: PALETTE[i % PALETTE.length], pts: [[report.eval.step, report.eval[k], null]] }));
  }
  draw($("curve-eval"), evals, [], false);
  const legend = $("eval-legend");
  legend.replaceChildren(...evals.map((s) => {
    const span = document.createElement("span");
    const last = s.pts.length ? s.pts[s.pts.length - 1] : null;
    span.dataset.key = s.key;
    span.dataset.value = last ? String(last[1]) : "";
    span.style.color = s.color;
    span.textContent = `${s.key} ${last ? num(last[1], 4) + " @ step " + last[0] : "-"}`;
    return span;
  }));
}

// ---------------------------------------------------------------- tables and the timeline
function cells(tr, values) {
  for (const [cls, text] of values) {
    const td = document.createElement("td");
    td.className = cls;
    td.textContent = text === null || text === undefined ? "-" : String(text);
    tr.append(td);
  }
}

function renderWorkers(report) {
  const body = $("workers").tBodies[0];
  body.replaceChildren(...(report ? report.workers || [] : []).map((w) => {
    const tr = document.createElement("tr");
    Object.assign(tr.dataset, { worker: w.id, state: w.state || "", incarnation: w.incarnation ?? "",
      host: w.host || "", pid: w.pid ?? "", heartbeatAge: w.heartbeat_age_s ?? "", microbatches: w.microbatches_done ?? "" });
    cells(tr, [["id", w.id], ["state", w.state], ["incarnation", w.incarnation], ["host", w.host], ["pid", w.pid],
               ["heartbeat", age(w.heartbeat_age_s)], ["microbatches", w.microbatches_done]]);
    return tr;
  }));
  const services = $("services").tBodies[0];
  services.replaceChildren(...Object.values(report ? report.services || {} : {}).map((s) => {
    const tr = document.createElement("tr");
    Object.assign(tr.dataset, { role: s.role, state: s.state || "", incarnation: s.incarnation ?? "" });
    cells(tr, [["role", s.role], ["state", s.state], ["incarnation", s.incarnation], ["host", s.host], ["pid", s.pid],
               ["heartbeat", age(s.heartbeat_age_s)], ["term", s.term]]);
    return tr;
  }));
}

function renderCheckpoints(list, report) {
  const latest = report && report.checkpoint ? report.checkpoint.step : null;
  $("checkpoints").tBodies[0].replaceChildren(...list.slice().reverse().map((c) => {
    const tr = document.createElement("tr");
    Object.assign(tr.dataset, { step: c.step, bytes: c.bytes, latest: String(c.step === latest) });
    cells(tr, [["step", c.step + (c.step === latest ? " (latest)" : "")], ["size", bytes(c.bytes)],
               ["written", clock(c.mtime)]]);
    return tr;
  }));
}

function describe(e) {
  const who = [e.role, e.id || e.worker].filter((x) => x !== undefined && x !== null).join(" ");
  const parts = [e.kind.replace(/_/g, " "), who];
  if (e.incarnation !== undefined && e.incarnation !== null) parts.push("incarnation " + e.incarnation);
  if (e.how) parts.push("(" + e.how + ")");
  if (e.via) parts.push("via " + e.via);
  if (e.host) parts.push("on " + e.host);
  if (e.step !== undefined) parts.push("step " + e.step);
  if (e.bytes) parts.push(bytes(e.bytes));
  if (e.signal) parts.push(e.signal);
  if (e.error) parts.push(e.error);
  return parts.filter(Boolean).join(" ");
}

function renderEvents() {
  if (held.eventsDrawn === held.events.length) return;
  held.eventsDrawn = held.events.length;
  const loss = history(held.metrics, (r) => ("loss" in r ? r.loss : undefined));
  const list = $("events");
  list.dataset.count = String(held.events.length);
  list.replaceChildren(...held.events.slice(-MAX_EVENTS_SHOWN).reverse().map((e) => {
    const li = document.createElement("li");
    li.dataset.kind = e.kind;
    li.dataset.t = String(e.t);
    for (const [k, v] of [["role", e.role], ["id", e.id || e.worker], ["incarnation", e.incarnation],
                          ["step", e.step ?? stepAt(loss, e.t)]]) {
      if (v !== undefined && v !== null) li.dataset[k] = String(v);
    }
    const time = document.createElement("time");
    time.textContent = clock(e.t);
    li.append(time, document.createTextNode(describe(e)));
    return li;
  }));
}

function renderSummary(st) {
  const r = st.report;
  $("note").hidden = !(st.error || (r && (r.note || r.error)));
  $("note").textContent = st.error || (r ? [r.error, r.note].filter(Boolean).join("; ") : "");
  if (!r) return;
  setValue("run-name", "data-run", r.run, r.run || "");
  setValue("state", "data-state", r.state, r.state || "-");
  setValue("step", "data-step", r.step, r.step ?? "-");
  setValue("total", "data-total", r.total, r.total ?? "-");
  setValue("loss", "data-loss", r.loss, num(r.loss, 5));
  setValue("lr", "data-lr", r.lr, num(r.lr, 3));
  setValue("samples-per-s", "data-value", r.samples_per_s, num(r.samples_per_s, 4));
  setValue("live-workers", "data-value", r.live_workers, r.live_workers ?? "-");
  setValue("progress-age", "data-value", r.progress_age_s, age(r.progress_age_s));
  setValue("term", "data-value", r.term, r.term ?? "-");
  if (r.eval) $("eval-last").textContent = "(last at step " + r.eval.step + ")";
}

// ---------------------------------------------------------------- the poll
function merge(kind, genKey, part) {
  held[kind] = part.start === 0 ? part.rows : held[kind].concat(part.rows);
  if (held[genKey] !== part.generation && kind === "events") held.eventsDrawn = -1;
  held[genKey] = part.generation;
}

async function poll() {
  try {
    const res = await fetch(url("api/state", { metrics: held.metrics.length, mgen: held.mgen ?? "",
                                               events: held.events.length, egen: held.egen ?? "" }),
                            { cache: "no-store" });
    if (!res.ok) throw new Error(res.status + " " + (await res.text()).trim());
    const data = await res.json();
    merge("metrics", "mgen", data.metrics);
    merge("events", "egen", data.events);
    renderSummary(data.status);
    renderWorkers(data.status.report);
    renderCheckpoints(data.checkpoints, data.status.report);
    drawCurves(data.status.report);
    renderEvents();
    held.polls += 1;
    document.body.dataset.polls = String(held.polls);
    setValue("connection", "data-ok", true, "live");
    $("updated").textContent = "updated " + clock(data.time);
  } catch (err) {
    setValue("connection", "data-ok", false, "not connected: " + err.message);
  } finally {
    setTimeout(poll, POLL_MS);
  }
}

poll();
