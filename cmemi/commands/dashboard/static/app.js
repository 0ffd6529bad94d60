// cmemi dashboard: polls api/state every second and renders it (the curves: curves.js). Plain JS, no library,
// no build step.
// Every value is also written to a stable id / data-* attribute, so a test (or a script) reads the page
// without parsing pixels: #step[data-step], #workers tr[data-worker][data-state][data-incarnation],
// #events li[data-kind][data-id][data-incarnation], #checkpoints tr[data-step], svg.curve[data-points][data-last-step].
"use strict";

const TOKEN = new URLSearchParams(location.search).get("token");
const POLL_MS = 1000;
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

function renderSummary(st, now) {
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
  // the report may be older than this answer (one from a finished run's files is kept): age it to now
  const progressAge = r.progress_age_s === null || r.progress_age_s === undefined ? null
    : r.progress_age_s + Math.max(0, now - r.time);
  setValue("progress-age", "data-value", progressAge, age(progressAge));
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
    renderSummary(data.status, data.time);
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
