// cmemi dashboard: the curves (loss, throughput, evaluation) as inline SVG, drawn by plain JS (no library).
// Loaded before app.js, which calls drawCurves(report) after each poll; num() and held come from app.js.
"use strict";

const SVG = "http://www.w3.org/2000/svg";
const PALETTE = ["#2864c7", "#c7822b", "#1f9d6b", "#8e44ad", "#c73a2b", "#555"];
const MARKED = { died: "died", fenced: "fenced", restarted: "restarted", aggregator_started: "aggregator",
                 checkpoint_restored: "restored" };  // events drawn as vertical lines on the curves

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
