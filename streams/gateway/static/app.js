"use strict";
// The memstream trace page: ask a question as a user, follow its trace over server-sent events (stages, plan
// revisions), then show the answer, its evidence and the memory-graph neighbourhood the evidence came from.
// Plain DOM code, no framework and nothing fetched from elsewhere: the page must work on an offline machine.

const $ = (selector) => document.querySelector(selector);
const SVG = "http://www.w3.org/2000/svg";

const KEY_STORE = "memstream.key";
const state = {
  source: null, queryId: null, userId: null, asOf: null, seen: new Set(), subs: new Map(), answered: false,
  streamed: "",
};
// What arrived, in order, with the page's clock: the browser test checks that stages came before the answer.
window.memstreamEvents = [];

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) node.setAttribute(name, value);
  for (const child of children) node.append(child);
  return node;
}

function svg(tag, attrs = {}, text = null) {
  const node = document.createElementNS(SVG, tag);
  for (const [name, value] of Object.entries(attrs)) node.setAttribute(name, value);
  if (text !== null) node.textContent = text;
  return node;
}

function short(text, n) {
  return text.length > n ? text.slice(0, n - 1) + "…" : text;
}

function setStatus(stateName, text) {
  const status = $("#status");
  status.dataset.state = stateName;
  status.textContent = text;
}

function record(kind, extra = {}) {
  window.memstreamEvents.push({ kind, at: performance.now(), ...extra });
}

// -- the API key: kept in this tab's sessionStorage only, sent as a bearer token with every request --------------

function apiKey() {
  return sessionStorage.getItem(KEY_STORE) || "";
}

function api(path, options = {}) {
  const headers = { ...(options.headers || {}), authorization: `Bearer ${apiKey()}` };
  return fetch(path, { ...options, headers });
}

// Server-sent events over fetch: EventSource cannot send an Authorization header, and a key in the URL would land
// in logs and history. Calls onEvent(name, data) per event, resumes after a broken connection with Last-Event-ID.
function streamEvents(path, onEvent) {
  const controller = new AbortController();
  let lastId = null;
  let tries = 0;
  async function run() {
    while (!controller.signal.aborted) {
      try {
        const headers = lastId === null ? {} : { "last-event-id": lastId };
        const response = await api(path, { headers, signal: controller.signal });
        if (!response.ok) {
          onEvent("refused", { status: response.status });
          return;
        }
        record("open");
        const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
        let buffer = "";
        let event = { name: "message", data: "" };
        for (;;) {
          const { value, done } = await reader.read();
          if (done) break;
          buffer += value;
          let cut;
          while ((cut = buffer.indexOf("\n")) >= 0) {
            const line = buffer.slice(0, cut).replace(/\r$/, "");
            buffer = buffer.slice(cut + 1);
            if (line === "") {
              if (event.data) onEvent(event.name, JSON.parse(event.data));
              event = { name: "message", data: "" };
            } else if (line.startsWith("event:")) event.name = line.slice(6).trim();
            else if (line.startsWith("data:")) event.data += line.slice(5).trim();
            else if (line.startsWith("id:")) lastId = line.slice(3).trim();
          }
        }
        return; // the server ended the stream (after end, timeout or unavailable)
      } catch (error) {
        if (controller.signal.aborted || ++tries > 5) return;
        await new Promise((resolve) => setTimeout(resolve, 1000 * tries)); // back off, then resume
      }
    }
  }
  run();
  return { close: () => controller.abort() };
}

// -- stages ---------------------------------------------------------------------------------------------------------

async function loadStages() {
  const response = await api("/v1/stages");
  if (!response.ok) {
    setStatus("error", response.status === 401 ? "enter an API key" : `stages unavailable (${response.status})`);
    return false;
  }
  const stages = await response.json();
  $("#stages").replaceChildren(
    ...stages.map((s) =>
      el("li", { class: "stage", "data-stage": s.stage, "data-name": s.name, "data-count": "0" },
        el("span", { class: "num" }, String(s.stage)),
        el("span", { class: "name" }, s.name),
        el("span", { class: "count" }, ""),
        el("span", { class: "ms" }, ""))),
  );
  return true;
}

function where(run) {
  const parts = [run.sub_question_id, run.step_id, run.clue_query_id].filter(Boolean);
  return parts.length ? parts[parts.length - 1] : "query";
}

function onStage(run) {
  if (state.seen.has(run.seq)) return;
  state.seen.add(run.seq);
  record("stage", { stage: run.stage, name: run.stage_name });
  if (!state.answered) setStatus("running", `stage ${run.stage}: ${run.stage_name}`);

  const tile = document.querySelector(`.stage[data-stage="${run.stage}"]`);
  if (tile) {
    const count = Number(tile.dataset.count) + 1;
    const ms = Number(tile.dataset.ms || 0) + run.duration_ms;
    tile.dataset.count = String(count);
    tile.dataset.ms = String(ms);
    tile.querySelector(".count").textContent = `×${count}`;
    tile.querySelector(".ms").textContent = `${ms.toFixed(ms < 10 ? 1 : 0)} ms`;
    // an error anywhere in the stage keeps the tile red; otherwise it shows the latest run's status
    const status = tile.classList.contains("error") ? "error" : run.status;
    tile.classList.remove("ok", "empty", "skipped", "error");
    tile.classList.add("seen", status, "flash");
    setTimeout(() => tile.classList.remove("flash"), 400);
  }

  const facts = [`${run.duration_ms.toFixed(1)} ms`];
  if (run.llm_calls) facts.push(`${run.llm_calls} LLM call${run.llm_calls > 1 ? "s" : ""}`);
  if (run.vertices) facts.push(`${run.vertices} vertices`);
  if (run.triplets) facts.push(`${run.triplets} triplets`);
  $("#timeline").append(
    el("li", { "data-seq": run.seq },
      el("span", { class: `badge ${run.status}` }, run.status), " ",
      `#${run.stage} ${run.stage_name} `,
      el("span", { class: "where" }, `${where(run)} · ${facts.join(" · ")}`)),
  );
  $("#timeline").lastElementChild.scrollIntoView({ block: "nearest" });
  onPlanStage(run);
}

// -- plan -----------------------------------------------------------------------------------------------------------

function subQuestion(id) {
  if (!state.subs.has(id)) {
    if (!state.subs.size) $("#plan").replaceChildren();
    const title = el("span", { class: "title" }, id);
    const badge = el("span", { class: "badge" }, "searching");
    const revisions = el("div", { class: "revisions" });
    const box = el("div", { class: "subq", "data-id": id }, title, " ", badge, revisions);
    $("#plan").append(box);
    state.subs.set(id, { box, title, badge, revisions, done: [], current: null });
  }
  return state.subs.get(id);
}

function stepItems(sub) {
  const latest = sub.revisions.lastElementChild;
  return latest ? [...latest.querySelectorAll("li")] : [];
}

function onPlanStage(run) {
  const detail = run.detail || {};
  if (run.stage === 1 && Array.isArray(detail.sub_questions)) {
    detail.sub_questions.forEach((text, i) => { subQuestion(`sq${i + 1}`).title.textContent = text; });
    return;
  }
  if (!run.sub_question_id) return;
  const sub = subQuestion(run.sub_question_id);
  const steps = Array.isArray(detail.steps) ? detail.steps : null;
  if (steps && (run.stage === 2 || (run.stage === 10 && detail.changed === true))) {
    const revision = sub.revisions.children.length;
    for (const old of sub.revisions.children) old.classList.remove("latest");
    sub.current?.classList.replace("current", "done"); // searched; the new revision lists it as done
    sub.current = null;
    const label = revision === 0 ? "initial plan" : `revision ${revision}, after: ${short(sub.done.at(-1) || "", 60)}`;
    const items = [
      ...sub.done.map((text) => el("li", { class: "done" }, text)),
      ...steps.map((text) => el("li", {}, text)),
    ];
    sub.revisions.append(
      el("div", { class: "revision latest", "data-revision": revision },
        el("span", { class: "label" }, label), el("ol", {}, ...items)),
    );
  } else if (run.stage === 11 && typeof detail.step === "string") {
    for (const item of stepItems(sub)) {
      if (item.classList.contains("current")) item.classList.replace("current", "done");
    }
    const item = stepItems(sub).find((li) => !li.classList.contains("done") && li.firstChild.textContent === detail.step);
    if (item) item.classList.add("current");
    sub.current = item || null;
    sub.done.push(detail.step);
  } else if (run.stage === 8 && !run.clue_query_id && typeof detail.answer === "string" && sub.current) {
    sub.current.append(el("span", { class: "step-answer" }, `→ ${short(detail.answer, 120)}`));
  } else if (run.stage === 9 && detail.sufficient === true) {
    sub.current?.classList.replace("current", "done");
    sub.badge.className = "badge answered";
    sub.badge.textContent = "answered";
  } else if (run.stage === 12) {
    sub.current?.classList.replace("current", "done");
    sub.badge.className = "badge no_answer";
    sub.badge.textContent = `no answer (${detail.reason || "step limit"})`;
  }
}

// -- answer, evidence, graph ----------------------------------------------------------------------------------------

// The answer as the model writes it: shown growing until the answer event replaces it.
function onText(data) {
  if (state.answered) return;
  record("text", { chars: data.text.length }); // what the page showed, when: the browser test reads these
  state.streamed = data.text;
  const box = $("#answer");
  box.classList.remove("hint");
  box.dataset.status = "writing";
  box.replaceChildren(el("span", { class: "badge running" }, "writing"), " ", el("span", { class: "text" }, data.text));
}

function onAnswer(answer) {
  if (state.answered) return;
  state.answered = true;
  record("answer", { status: answer.status });
  setStatus(answer.status, answer.status.replace("_", " "));
  const failed = answer.status === "error" || answer.status === "cancelled";
  const text = failed ? answer.error || answer.status : answer.answer;
  const meta = `${answer.llm_calls} LLM call${answer.llm_calls === 1 ? "" : "s"} · ${answer.duration_ms.toFixed(0)} ms`;
  const box = $("#answer");
  box.classList.remove("hint");
  box.dataset.status = answer.status;
  box.replaceChildren(
    el("span", { class: `badge ${answer.status}` }, answer.status), " ",
    el("span", { class: "text" }, text), el("div", { class: "hint" }, meta),
  );
  // several edges can carry one statement (each entity -> the same thesis): list each text once
  const texts = new Map();
  for (const e of answer.evidence) texts.set(e.text, [...(texts.get(e.text) || []), e.id]);
  $("#evidence").replaceChildren(
    ...[...texts].map(([text, ids]) => el("li", { "data-ids": ids.join(" "), title: ids.join(" ") }, text)),
  );
  loadGraph(answer.evidence.map((e) => e.id));
}

async function loadGraph(ids) {
  const graph = $("#graph");
  if (!ids.length) {
    graph.replaceChildren(svg("text", { x: 20, y: 30 }, "no evidence, so no neighbourhood to show"));
    return;
  }
  const params = new URLSearchParams({ per_vertex: "6" });
  ids.slice(0, 100).forEach((id) => params.append("ids", id));
  // the neighbourhood as the question saw memory: what held at its as_of (the API's default: now)
  if (state.asOf) params.set("as_of", state.asOf);
  $("#graph-as-of").textContent = state.asOf ? `as it held at ${state.asOf}` : "as it holds now";
  const response = await api(`/v1/graph/${encodeURIComponent(state.userId)}/neighbourhood?${params}`);
  if (!response.ok) {
    graph.replaceChildren(svg("text", { x: 20, y: 30 }, `graph unavailable (${response.status})`));
    return;
  }
  drawGraph(await response.json());
}

// A small force layout: nodes repel, edges pull to a rest length, everything drifts to the centre.
function layout(nodes, edges, width, height) {
  const index = new Map(nodes.map((n, i) => [n.id, i]));
  nodes.forEach((n, i) => {
    const angle = (2 * Math.PI * i) / nodes.length;
    const radius = n.focus ? 0.15 : 0.38;
    n.x = width / 2 + Math.cos(angle) * width * radius;
    n.y = height / 2 + Math.sin(angle) * height * radius;
  });
  const links = edges.map((e) => [index.get(e.source), index.get(e.target)]).filter(([a, b]) => a !== undefined && b !== undefined);
  const rounds = 250;
  for (let round = 0; round < rounds; round++) {
    const step = 0.9 * (1 - round / rounds) + 0.05;
    const fx = new Float64Array(nodes.length);
    const fy = new Float64Array(nodes.length);
    for (let i = 0; i < nodes.length; i++) {
      for (let j = i + 1; j < nodes.length; j++) {
        const dx = nodes[i].x - nodes[j].x;
        const dy = nodes[i].y - nodes[j].y;
        const d2 = Math.max(dx * dx + dy * dy, 30);
        const f = 7000 / d2;
        fx[i] += dx * f / Math.sqrt(d2); fy[i] += dy * f / Math.sqrt(d2);
        fx[j] -= dx * f / Math.sqrt(d2); fy[j] -= dy * f / Math.sqrt(d2);
      }
    }
    for (const [a, b] of links) {
      const dx = nodes[b].x - nodes[a].x;
      const dy = nodes[b].y - nodes[a].y;
      const d = Math.max(Math.hypot(dx, dy), 1);
      const f = (d - 100) * 0.04;
      fx[a] += (dx / d) * f; fy[a] += (dy / d) * f;
      fx[b] -= (dx / d) * f; fy[b] -= (dy / d) * f;
    }
    nodes.forEach((n, i) => {
      fx[i] += (width / 2 - n.x) * 0.01;
      fy[i] += (height / 2 - n.y) * 0.01;
      n.x = Math.min(width - 30, Math.max(30, n.x + Math.max(-20, Math.min(20, fx[i])) * step));
      n.y = Math.min(height - 15, Math.max(15, n.y + Math.max(-20, Math.min(20, fy[i])) * step));
    });
  }
}

function drawGraph(graph) {
  const root = $("#graph");
  const [width, height] = [600, 420];
  const nodes = graph.nodes.map((n) => ({ ...n }));
  const byId = new Map(nodes.map((n) => [n.id, n]));
  const edges = graph.edges.filter((e) => byId.has(e.source) && byId.has(e.target));
  layout(nodes, edges, width, height);
  const parts = [];
  for (const e of edges) {
    const [a, b] = [byId.get(e.source), byId.get(e.target)];
    const line = svg("line", { x1: a.x, y1: a.y, x2: b.x, y2: b.y, class: e.focus ? "focus" : "", "data-id": e.id });
    line.append(svg("title", {}, e.relation));
    parts.push(line);
    if (e.focus && e.kind === "relation" && edges.length <= 15) { // on a busy graph, the tooltip tells
      parts.push(svg("text", { x: (a.x + b.x) / 2, y: (a.y + b.y) / 2 - 3, class: "relation" }, short(e.relation, 24)));
    }
  }
  for (const n of nodes) {
    const circle = svg("circle", { cx: n.x, cy: n.y, r: n.focus ? 9 : 6, class: `${n.kind}${n.focus ? " focus" : ""}`, "data-id": n.id });
    circle.append(svg("title", {}, n.name));
    parts.push(circle);
    if (n.focus || n.kind === "object") {
      const name = n.name.replace(/^\[[^\]]*\]\s*/, ""); // a thesis's date is in its tooltip
      parts.push(svg("text", { x: n.x + 11, y: n.y + 4 }, short(name, n.focus ? 32 : 22)));
    }
  }
  root.replaceChildren(...parts);
  root.dataset.nodes = String(nodes.length);
  root.dataset.edges = String(edges.length);
  record("graph", { nodes: nodes.length, edges: edges.length });
}

// -- the stream -----------------------------------------------------------------------------------------------------

function onEnd(trace) {
  if (trace) {
    if (trace.as_of && !state.answered) state.asOf = trace.as_of;
    for (const run of trace.timeline) onStage(run); // whatever the live stream missed
    if (trace.answer) onAnswer(trace.answer);
  }
  if (!state.subs.size) {
    $("#plan").replaceChildren(
      el("p", { class: "hint" }, "No plan: this QA engine answered straight from the retrieved memory."),
    );
  }
  record("end");
}

function reset() {
  state.seen.clear();
  state.subs.clear();
  state.answered = false;
  state.streamed = "";
  window.memstreamEvents = [];
  for (const tile of document.querySelectorAll(".stage")) {
    tile.className = "stage";
    tile.dataset.count = "0";
    tile.dataset.ms = "0";
    tile.querySelector(".count").textContent = "";
    tile.querySelector(".ms").textContent = "";
  }
  $("#timeline").replaceChildren();
  $("#plan").replaceChildren(el("p", { class: "hint" }, "Waiting for the pipeline…"));
  const answer = $("#answer");
  answer.className = "hint";
  delete answer.dataset.status;
  answer.textContent = "Waiting for the answer…";
  $("#evidence").replaceChildren();
  $("#graph").replaceChildren();
}

// A datetime-local value ("2024-03-01T09:30") as the UTC time the API takes; empty: none (now).
function asOfValue(value) {
  if (!value) return null;
  return new Date(`${value.length === 16 ? value + ":00" : value}Z`).toISOString();
}

function follow(queryId, userId, asOf = null) {
  if (state.source) state.source.close();
  state.queryId = queryId;
  state.userId = userId;
  state.asOf = asOf;
  const url = `/v1/traces/${encodeURIComponent(queryId)}/stream?user_id=${encodeURIComponent(userId)}`;
  const handlers = {
    // a trace followed from its link: the question's own as_of is what its graph must show
    query: (data) => { if (data && data.as_of) state.asOf = data.as_of; record("query"); },
    stage: onStage,
    text: onText,
    answer: onAnswer,
    end: (data) => { source.close(); onEnd(data); },
    timeout: () => { source.close(); setStatus("timeout", "no answer in time"); },
    unavailable: () => { source.close(); setStatus("error", "no such query for this user"); },
    refused: (data) => setStatus("error", data.status === 401 ? "the API key was refused" : `refused (${data.status})`),
  };
  const source = streamEvents(url, (name, data) => handlers[name] && handlers[name](data));
  state.source = source;
}

async function ask(event) {
  event.preventDefault();
  const userId = $("#user").value.trim();
  const question = $("#question").value.trim();
  const asOf = asOfValue($("#as-of").value);
  const key = $("#key").value.trim();
  if (key) sessionStorage.setItem(KEY_STORE, key);
  reset();
  $("#ask").disabled = true;
  setStatus("running", "asking…");
  try {
    if (!document.querySelector("#stages .stage") && !(await loadStages())) return;
    const response = await api("/v1/questions", {
      method: "POST",
      headers: { "content-type": "application/json" },
      body: JSON.stringify(asOf ? { user_id: userId, question, as_of: asOf } : { user_id: userId, question }),
    });
    const body = await response.json();
    if (!response.ok) {
      setStatus("error", typeof body.detail === "string" ? body.detail : response.statusText);
      return;
    }
    record("asked", { queryId: body.query_id });
    const params = new URLSearchParams({ user: userId, query: body.query_id });
    history.replaceState(null, "", `?${params}`);
    follow(body.query_id, userId, asOf);
  } catch (error) {
    setStatus("error", String(error));
  } finally {
    $("#ask").disabled = false;
  }
}

function start() {
  const params = new URLSearchParams(location.search);
  $("#user").value = params.get("user") || "";
  $("#question").value = params.get("q") || "";
  $("#key").value = apiKey();
  $("#ask-form").addEventListener("submit", ask);
  // Ready only once the stage list is drawn: a question asked earlier would have no stages to light up.
  loadStages().then((loaded) => {
    window.memstreamReady = true;
    if (loaded && params.get("query") && params.get("user")) follow(params.get("query"), params.get("user"));
  });
}

start();
