// lorafleet's live page: polls GET /v1/fleet (train.queue.fleet_view) with the token from the URL's fragment
// (#token=<token>&every=<seconds>) and draws what it answers. Plain DOM and inline SVG: no build step, no CDN.
// Every number drawn also sits, unrounded, in its element's data-value (the curves: data-steps and data-values),
// for whoever checks the page against metrics.jsonl.
"use strict";

const SVG = "http://www.w3.org/2000/svg";
const params = new URLSearchParams(location.hash.slice(1));
const token = params.get("token") || "";
const every = Math.max(1, Number(params.get("every")) || 2) * 1000;

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) node.setAttribute(key, value);
  for (const child of children) node.append(child);
  return node;
}

function svg(tag, attrs = {}) {
  const node = document.createElementNS(SVG, tag);
  for (const [key, value] of Object.entries(attrs)) node.setAttribute(key, value);
  return node;
}

function num(value, digits = 4) {
  return value === null || value === undefined ? "–" : Number(value).toPrecision(digits);
}

function duration(seconds) {
  if (seconds === null || seconds === undefined) return "–";
  const total = Math.max(0, Math.round(seconds));
  if (total >= 3600) return `${Math.floor(total / 3600)}h${String(Math.floor(total / 60) % 60).padStart(2, "0")}m`;
  return `${Math.floor(total / 60)}m${String(total % 60).padStart(2, "0")}s`;
}

// A cell showing `text`, its exact number in data-value.
function cell(field, value, text, cls = "num") {
  const attrs = { "data-field": field, class: cls };
  if (value !== null && value !== undefined) attrs["data-value"] = String(value);
  return el("td", attrs, text);
}

function fact(list, label, field, value, text) {
  const attrs = { "data-field": field };
  if (value !== null && value !== undefined) attrs["data-value"] = String(value);
  list.append(el("dt", {}, label), el("dd", attrs, text));
}

function drawRun(run) {
  const list = document.getElementById("run");
  list.replaceChildren();
  const steps = run.steps === null ? "?" : run.steps;
  fact(list, "steps", "steps-done", run.steps_done, `${run.steps_done} of ${steps}`);
  fact(list, "ETA", "eta", run.eta_s, duration(run.eta_s));
  fact(list, "step time", "mean-step", run.mean_step_s, run.mean_step_s === null ? "–" : `${num(run.mean_step_s, 3)} s`);
  fact(list, "GPU-seconds", "gpu-s", run.gpu_s, num(run.gpu_s));
  fact(list, "model", "model", null, run.model);
  fact(list, "deployment", "deployment", null, run.deployment);
  fact(list, "fleet", "fleet", null, run.fleet);
}

function drawTenants(tenants) {
  const body = document.querySelector("#tenants tbody");
  body.replaceChildren();
  for (const t of tenants) {
    const total = t.steps_total;
    const share = total ? Math.min(1, t.steps_done / total) : 0;
    const fill = el("span");
    fill.style.width = `${(100 * share).toFixed(1)}%`; // through the CSSOM: the page's CSP allows no inline style
    const bar = el("span", { class: "bar" }, fill);
    const progress = el("td", { "data-field": "steps-done", "data-value": String(t.steps_done) }, bar,
      `${t.steps_done} / ${total === null ? "?" : total}`);
    const best = t.best_eval;
    body.append(el("tr", { "data-tenant": t.name },
      el("td", {}, t.name),
      el("td", {}, el("span", { class: "state", "data-state": t.state, "data-field": "state" }, t.state)),
      progress,
      cell("eta", t.eta_s, duration(t.eta_s)),
      cell("loss", t.loss, num(t.loss)),
      cell("best-eval", best ? best[1] : null, best ? `${num(best[1])} (step ${best[0]})` : "–"),
      cell("gpu-s", t.gpu_s, num(t.gpu_s)),
      cell("eval-gpu-s", t.eval_gpu_s, num(t.eval_gpu_s))));
  }
}

// One tenant's curves on shared axes: its training loss (a line) and its evaluations (dots).
function drawCurve(t, lastStep) {
  const W = 300, H = 150, L = 40, R = 8, T = 8, B = 20;
  const train = t.loss_curve, evals = t.eval_curve;
  const values = [...train.values, ...evals.values].filter((v) => v !== null);
  const box = el("div", { class: "curve", "data-tenant": t.name }, el("h3", {}, t.name));
  const chart = svg("svg", { viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": `${t.name} loss` });
  box.append(chart);
  if (!values.length) return box;
  let lo = Math.min(...values), hi = Math.max(...values);
  if (hi - lo < 1e-9) { lo -= 0.5; hi += 0.5; }
  const x = (step) => L + ((W - L - R) * step) / Math.max(1, lastStep);
  const y = (v) => T + ((H - T - B) * (hi - v)) / (hi - lo);
  chart.append(svg("line", { class: "axis", x1: L, y1: H - B, x2: W - R, y2: H - B }),
    svg("line", { class: "axis", x1: L, y1: T, x2: L, y2: H - B }));
  for (const [v, at] of [[hi, T + 8], [lo, H - B]]) {
    const label = svg("text", { class: "label", x: 2, y: at });
    label.textContent = num(v, 3);
    chart.append(label);
  }
  const end = svg("text", { class: "label", x: W - R - 40, y: H - 4 });
  end.textContent = `step ${lastStep}`;
  chart.append(end);
  const points = train.steps.map((s, i) => [s, train.values[i]]).filter(([, v]) => v !== null);
  chart.append(svg("polyline", {
    class: "train", "data-field": "loss-curve",
    "data-steps": train.steps.join(","), "data-values": train.values.map(String).join(","),
    points: points.map(([s, v]) => `${x(s).toFixed(1)},${y(v).toFixed(1)}`).join(" "),
  }));
  evals.steps.forEach((s, i) => {
    if (evals.values[i] === null) return;
    const dot = svg("circle", { class: "eval", "data-field": "eval-point", "data-step": s,
      "data-value": String(evals.values[i]), cx: x(s).toFixed(1), cy: y(evals.values[i]).toFixed(1), r: 3 });
    const title = svg("title");
    title.textContent = `step ${s}: eval loss ${num(evals.values[i])}, accuracy ${num(t.eval_accuracy[i], 3)}`;
    dot.append(title);
    chart.append(dot);
  });
  return box;
}

function drawCurves(tenants, lastStep) {
  document.getElementById("curves").replaceChildren(...tenants.map((t) => drawCurve(t, lastStep)));
}

function drawReplicas(replicas) {
  const body = document.querySelector("#replicas tbody");
  body.replaceChildren(...replicas.map((r) => el("tr", { "data-replica": String(r.replica_id) },
    cell("replica", r.replica_id, String(r.replica_id)),
    el("td", { "data-field": "config" }, r.config),
    el("td", { "data-field": "gpus" }, r.gpus.join(", ")),
    el("td", {}, r.gpu),
    cell("max-tokens", r.max_tokens, r.max_tokens.toLocaleString("en")),
    cell("utilisation", r.utilisation, r.utilisation === null ? "–" : `${(100 * r.utilisation).toFixed(1)} %`))));
}

function drawList(id, items, text) {
  const list = document.getElementById(id);
  list.replaceChildren(...items.map((item) => el("li", { "data-file": typeof item === "string" ? item : item.file },
    ...text(item))));
  if (!items.length) list.append(el("li", { class: "reason" }, "none"));
}

function draw(fleet) {
  drawRun(fleet.run);
  drawTenants(fleet.tenants);
  drawCurves(fleet.tenants, Math.max(1, fleet.run.steps || fleet.run.steps_done));
  drawReplicas(fleet.replicas);
  drawList("pending", fleet.queue.pending, (f) => [f]);
  drawList("rejected", fleet.queue.rejected, (r) => [r.file, " ", el("span", { class: "reason" }, r.reason || "")]);
  drawList("accepted", fleet.queue.accepted, (f) => [f]);
  document.getElementById("fleet").hidden = false;
}

function say(state, text) {
  const status = document.getElementById("status");
  status.dataset.state = state;
  status.textContent = text;
}

async function refresh() {
  let answer;
  try {
    answer = await fetch("v1/fleet", { headers: { Authorization: `Bearer ${token}` }, cache: "no-store" });
  } catch (error) {
    say("error", `the run's server does not answer (${error.message}); it serves while the run trains`);
    return true;
  }
  if (answer.status === 401) {
    document.getElementById("fleet").hidden = true;
    say("error", "no data: a missing or wrong token (open the page as <url>/#token=<the token in <queue>/.http.json>)");
    return false;
  }
  if (!answer.ok) {
    say("error", `the server answered ${answer.status}`);
    return true;
  }
  const fleet = await answer.json();
  draw(fleet);
  say("ok", `updated ${new Date().toLocaleTimeString()}, every ${every / 1000} s`);
  return true;
}

async function poll() {
  if (await refresh()) setTimeout(poll, every);
}

poll();
