// mlxhost's web page: a chat over /v1/chat/completions (over /v1/responses when MCP servers are switched on)
// and a dashboard over /v1/models, /v1/status, /v1/cache/stats, /v1/batches and /metrics. No framework, no build step;
// model output and tool output are only ever set as text.
"use strict";

const $ = (sel) => document.querySelector(sel);
const KEY_STORE = "mlxhost.apiKey";
const POLL_MS = 2000;
const BATCH_RUNNING = new Set(["validating", "in_progress", "finalizing"]);  // what Cancel applies to
const BUDGET_PARTS = [  // /v1/status `budget` fields, in bar order
  ["weights", "weights"], ["activations", "activations"], ["kv", "KV cache"],
  ["prefix_cache", "prefix cache"], ["vision_cache", "vision cache"], ["free_for_others", "free"],
];

const state = { history: [], image: null, controller: null, poll: null, lastTokens: null };

// ---- HTTP ---------------------------------------------------------------------------------------
function authHeaders() {
  const key = localStorage.getItem(KEY_STORE);
  return key ? { Authorization: "Bearer " + key } : {};
}

async function api(path, opts = {}) {
  const headers = { ...authHeaders(), ...(opts.body ? { "Content-Type": "application/json" } : {}) };
  const r = await fetch(path, { ...opts, headers });
  if (r.status === 401) {
    notice("This server needs an API key: type it at the top right and press Save.");
    $("#key").focus();
  }
  if (!r.ok) {
    let message = `${r.status} ${r.statusText}`;
    try {
      const body = await r.json();
      message = body.error?.message || body.detail || message;
    } catch { /* not JSON */ }
    throw new Error(message);
  }
  return r;
}

const getJSON = async (path) => (await api(path)).json();

function notice(text) {
  const el = $("#notice");
  el.textContent = text || "";
  el.hidden = !text;
}

// Server-sent events of a fetch body: yields each `data:` payload parsed, stops at [DONE].
async function* sseData(body) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buf += value.replace(/\r/g, "");
    let end;
    while ((end = buf.indexOf("\n\n")) >= 0) {
      const event = buf.slice(0, end);
      buf = buf.slice(end + 2);
      const data = event.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trim()).join("\n");
      if (data === "[DONE]") return;
      if (data) yield JSON.parse(data);
    }
  }
}

// ---- small DOM helpers --------------------------------------------------------------------------
function el(tag, props = {}, ...children) {
  const node = Object.assign(document.createElement(tag), props);
  for (const c of children) if (c != null) node.append(c);
  return node;
}

function fmtBytes(n) {
  if (n == null) return "–";
  const units = ["B", "KB", "MB", "GB", "TB"];
  let i = 0;
  while (Math.abs(n) >= 1000 && i < units.length - 1) { n /= 1000; i++; }
  return `${n.toFixed(i && n < 10 ? 1 : 0)} ${units[i]}`;
}

const pct = (x) => (x == null || isNaN(x) ? "–" : `${(100 * x).toFixed(1)}%`);

// ---- tabs ---------------------------------------------------------------------------------------
function showTab(name) {
  for (const [tab, panel] of [["#tab-chat", "#chat"], ["#tab-dash", "#dash"]]) {
    const on = panel === "#" + name;
    $(tab).setAttribute("aria-selected", String(on));
    $(tab).tabIndex = on ? 0 : -1;
    $(panel).hidden = !on;
  }
  clearInterval(state.poll);
  state.poll = null;
  if (name === "dash") {
    refreshDashboard();
    state.poll = setInterval(() => { if (!document.hidden) refreshDashboard(); }, POLL_MS);
  }
}

// ---- chat ---------------------------------------------------------------------------------------
async function loadModels() {
  const select = $("#model");
  const previous = select.value;
  try {
    const { data } = await getJSON("/v1/models");
    select.replaceChildren(...data.map((m) => el("option", { value: m.id, textContent: `${m.id} (${m.status || "loaded"})` })));
    if (data.some((m) => m.id === previous)) select.value = previous;
    notice("");
  } catch (e) {
    select.replaceChildren(el("option", { value: "", textContent: "no models (" + e.message + ")" }));
  }
}

function addMessage(role, text, image) {
  const content = el("div", { className: "content", textContent: text });
  const msg = el("div", { className: `msg ${role}` }, el("div", { className: "role", textContent: role }),
    image ? el("img", { src: image, alt: "attached image", className: "thumb" }) : null, content);
  $("#log").append(msg);
  msg.scrollIntoView({ block: "end" });
  return msg;
}

// One MCP call as the transcript shows it: server and tool, its arguments, then its output or error.
function mcpCallView(item) {
  const failed = item.error != null;
  return el("div", { className: "mcp-call" + (failed ? " failed" : "") },
    el("span", { className: "badge" + (failed ? " bad" : ""), textContent: failed ? "MCP call failed" : "MCP call" }), " ",
    el("code", { className: "mcp-tool", textContent: `${item.server_label} · ${item.name}` }),
    el("pre", { className: "mcp-arguments", textContent: item.arguments }),
    failed ? el("div", { className: "error mcp-error", textContent: String(item.error) })
      : el("pre", { className: "mcp-output", textContent: item.output ?? "" }));
}

// A call the server's config says needs approval: Approve / Decline continue the response.
function approvalView(item, decide) {
  const buttons = [["Approve", true], ["Decline", false]].map(([text, approve]) => {
    const button = el("button", { type: "button", textContent: text });
    button.setAttribute("aria-label", `${text} ${item.server_label} ${item.name}`);
    button.onclick = () => {
      for (const b of buttons) b.disabled = true;
      decide(item, approve);
    };
    return button;
  });
  return el("div", { className: "mcp-call approval" },
    el("span", { className: "badge", textContent: "MCP approval" }), " ",
    el("code", { className: "mcp-tool", textContent: `${item.server_label} · ${item.name}` }),
    el("pre", { className: "mcp-arguments", textContent: item.arguments }), el("div", { className: "actions" }, ...buttons));
}

// The assistant's reply as it streams: MCP calls, reasoning (collapsed), text or JSON, tool calls, then stats.
function replyView() {
  const msg = addMessage("assistant", "");
  const calls = el("div", { className: "mcp-calls" });
  const reasoning = el("details", { className: "reasoning", hidden: true },
    el("summary", { textContent: "Reasoning" }), el("div", { className: "reasoning-text" }));
  const tools = el("div", { className: "tool-calls" });
  const stats = el("div", { className: "stats" });
  msg.querySelector(".content").before(calls, reasoning);
  msg.append(tools, stats);
  return {
    update(reply) {
      if (calls.childElementCount !== reply.mcpCalls.length) calls.replaceChildren(...reply.mcpCalls.map(mcpCallView));
      reasoning.hidden = !reply.reasoning;
      reasoning.querySelector(".reasoning-text").textContent = reply.reasoning;
      msg.querySelector(".content").textContent = reply.content;
      tools.replaceChildren(...reply.toolCalls.map((c) => el("div", { className: "tool-call" },
        el("span", { className: "badge", textContent: "tool call" }), " ",
        el("code", { textContent: c.name || "…" }), el("pre", { textContent: c.arguments }))));
      msg.scrollIntoView({ block: "end" });
    },
    approvals(items, decide) { tools.append(...items.map((item) => approvalView(item, decide))); },
    asJSON(text) {
      const content = msg.querySelector(".content");
      let shown = text, valid = true;
      try { shown = JSON.stringify(JSON.parse(text), null, 2); } catch { valid = false; }
      content.replaceWith(el("div", { className: "content" },
        el("span", { className: "badge" + (valid ? "" : " bad"), textContent: valid ? "JSON" : "JSON (incomplete)" }),
        el("pre", { className: "json", textContent: shown })));
    },
    error(text) { msg.append(el("div", { className: "error", textContent: text })); },
    stats(text) { stats.textContent = text; },
  };
}

// ---- MCP servers ------------------------------------------------------------------------------
// The servers the server has configured (GET /v1/mcp/servers), one toggle each; none: the section stays hidden.
async function loadMcpServers() {
  let data = [];
  try { ({ data } = await getJSON("/v1/mcp/servers")); } catch { /* no key yet, or an older server */ }
  const on = new Set(mcpServersOn());
  $("#mcp-servers").replaceChildren(...data.map((s) => {
    const box = el("input", { type: "checkbox", checked: on.has(s.label) });
    box.dataset.server = s.label;
    const detail = `${s.num_tools} tool${s.num_tools === 1 ? "" : "s"}, ${s.state}` +
      (s.require_approval === "always" ? ", asks approval" : "");
    return el("label", { className: "check" }, box, ` ${s.label} `, el("small", { textContent: `(${detail})` }));
  }));
  $("#mcp").hidden = !data.length;
}

const mcpServersOn = () => [...document.querySelectorAll("#mcp-servers input:checked")].map((b) => b.dataset.server);

// ---- requests -------------------------------------------------------------------------------------
// History entries are chat messages; an assistant message may carry `mcp`, the MCP calls made for it
// (Responses mcp_call items), which only the Responses request sends back.
const chatMessage = ({ mcp, ...message }) => message;

function settings() {
  return {
    system: $("#system").value.trim(),
    maxTokens: parseInt($("#max-tokens").value, 10) || undefined,
    temperature: parseFloat($("#temperature").value),
    json: $("#json-mode").checked,
    tools: $("#tools").value.trim() ? JSON.parse($("#tools").value) : null,  // a parse error is shown by send()
  };
}

function chatRequest(s) {
  const body = {
    model: $("#model").value,
    messages: [...(s.system ? [{ role: "system", content: s.system }] : []), ...state.history.map(chatMessage)],
    stream: true,
    stream_options: { include_usage: true },
    max_tokens: s.maxTokens,
    temperature: s.temperature,
  };
  if (isNaN(body.temperature)) delete body.temperature;
  if (s.json) body.response_format = { type: "json_object" };
  if (s.tools) body.tools = s.tools;
  return { path: "/v1/chat/completions", body, json: s.json };
}

// The conversation as Responses input items: messages, the client's tool calls, earlier MCP calls.
function responsesInput() {
  const items = [];
  for (const m of state.history) {
    if (m.role === "user") {
      items.push({ role: "user", content: typeof m.content === "string" ? m.content : m.content.map((p) =>
        p.type === "image_url" ? { type: "input_image", image_url: p.image_url.url } : { type: "input_text", text: p.text }) });
      continue;
    }
    for (const call of m.mcp || []) {
      items.push({ type: "mcp_call", id: call.id, server_label: call.server_label, name: call.name,
        arguments: call.arguments, output: call.output, error: call.error });
    }
    if (m.content) items.push({ role: "assistant", content: m.content });
    for (const c of m.tool_calls || []) {
      items.push({ type: "function_call", call_id: c.id, name: c.function.name, arguments: c.function.arguments });
    }
  }
  return items;
}

// With MCP servers on, the Responses API runs their tools between the model's rounds and streams each call.
function responsesRequest(s, servers, continuing) {
  const tools = servers.map((label) => ({ type: "mcp", server_label: label, require_approval: "never" }));
  for (const t of s.tools || []) {  // chat-style function tools, as Responses writes them
    tools.push(t.type === "function" && t.function ? { type: "function", ...t.function } : t);
  }
  const body = { model: $("#model").value, input: continuing ? continuing.input : responsesInput(), tools,
    stream: true, max_output_tokens: s.maxTokens, temperature: s.temperature };
  if (continuing) body.previous_response_id = continuing.previous;
  if (s.system) body.instructions = s.system;
  if (isNaN(body.temperature)) delete body.temperature;
  if (s.json) body.text = { format: { type: "json_object" } };
  return { path: "/v1/responses", body, json: s.json, servers };
}

// ---- streams -------------------------------------------------------------------------------------
// Each reader folds one streamed event into `reply`; it returns true when the event carried output.
function readChatChunk(chunk, reply) {
  if (chunk.error) throw new Error(chunk.error.message);
  if (chunk.usage) {
    const u = chunk.usage;
    reply.usage = { output: u.completion_tokens, cached: u.prompt_tokens_details?.cached_tokens };
  }
  let output = false;
  for (const choice of chunk.choices || []) {
    const d = choice.delta || {};
    output ||= Boolean(d.content || d.reasoning_content || d.tool_calls);
    reply.content += d.content || "";
    reply.reasoning += d.reasoning_content || "";
    for (const tc of d.tool_calls || []) {
      const call = (reply.toolCalls[tc.index ?? 0] ??= { id: "", name: "", arguments: "" });
      call.id = tc.id || call.id;
      call.name += tc.function?.name || "";
      call.arguments += tc.function?.arguments || "";
    }
    reply.finish = choice.finish_reason || reply.finish;
  }
  return output;
}

function readResponseEvent(event, reply) {
  switch (event.type) {
    case "response.created":
      reply.responseId = event.response.id;
      return false;
    case "response.output_text.delta":
      reply.content += event.delta;
      return true;
    case "response.reasoning_text.delta":
      reply.reasoning += event.delta;
      return true;
    case "response.output_item.done": {
      const item = event.item;
      if (item.type === "mcp_call") reply.mcpCalls.push(item);
      else if (item.type === "mcp_approval_request") reply.approvals.push(item);
      else if (item.type === "function_call") reply.toolCalls.push({ id: item.call_id, name: item.name, arguments: item.arguments });
      else return false;
      return true;
    }
    case "response.completed":
    case "response.incomplete": {
      const r = event.response, u = r.usage || {};
      reply.usage = { output: u.output_tokens, cached: u.input_tokens_details?.cached_tokens };
      reply.finish = r.status === "incomplete" ? "length" : reply.approvals.length ? "awaiting approval" : "stop";
      return false;
    }
    case "response.failed":
      throw new Error(event.response?.error?.message || "the response failed");
    case "error":
      throw new Error(event.message || event.error?.message || "the response failed");
    default:
      return false;
  }
}

async function send(ev) {
  ev.preventDefault();
  const text = $("#prompt").value.trim();
  if ((!text && !state.image) || state.controller) return;
  const content = state.image ? [{ type: "text", text }, { type: "image_url", image_url: { url: state.image } }] : text;
  state.history.push({ role: "user", content });
  let request;
  try {
    const s = settings(), servers = mcpServersOn();
    request = servers.length ? responsesRequest(s, servers) : chatRequest(s);
  } catch (e) {
    state.history.pop();
    notice("Tools must be a JSON array: " + e.message);
    return;
  }
  addMessage("user", text, state.image);
  $("#prompt").value = "";
  setImage(null);
  await streamReply(request);
}

// A call needing approval ended the response: the answer (approve or not) continues it in a new reply.
async function decide(reply, request, item, approve) {
  if (state.controller) return;
  let s;
  try { s = settings(); } catch (e) { notice("Tools must be a JSON array: " + e.message); return; }
  await streamReply(responsesRequest(s, request.servers, { previous: reply.responseId,
    input: [{ type: "mcp_approval_response", approval_request_id: item.id, approve }] }));
}

async function streamReply(request) {
  const view = replyView();
  const reply = { content: "", reasoning: "", toolCalls: [], mcpCalls: [], approvals: [], usage: null, finish: null,
    responseId: null };
  const read = request.path === "/v1/responses" ? readResponseEvent : readChatChunk;
  const controller = (state.controller = new AbortController());
  setBusy(true);
  const t0 = performance.now();
  let tFirst = null;
  try {
    const r = await api(request.path, { method: "POST", body: JSON.stringify(request.body), signal: controller.signal });
    for await (const event of sseData(r.body)) {
      if (read(event, reply)) tFirst ??= performance.now();
      view.update(reply);
    }
  } catch (e) {
    if (e.name === "AbortError") reply.finish = "stopped";
    else view.error(e.message);
  } finally {
    state.controller = null;
    setBusy(false);
  }
  if (request.json && reply.content) view.asJSON(reply.content);
  if (reply.approvals.length) view.approvals(reply.approvals, (item, approve) => decide(reply, request, item, approve));
  const tEnd = performance.now();
  const n = reply.usage?.output;
  const parts = [];
  if (tFirst != null) parts.push(`TTFT ${Math.round(tFirst - t0)} ms`);
  if (n > 1 && tEnd > tFirst) parts.push(`${((n - 1) / ((tEnd - tFirst) / 1000)).toFixed(1)} tok/s`);
  if (n != null) parts.push(`${n} tokens`);
  if (reply.usage?.cached) parts.push(`${reply.usage.cached} prompt tokens cached`);
  if (reply.mcpCalls.length) parts.push(`${reply.mcpCalls.length} MCP call${reply.mcpCalls.length === 1 ? "" : "s"}`);
  if (reply.finish) parts.push(reply.finish);
  view.stats(parts.join(" · "));
  const message = { role: "assistant", content: reply.content };
  if (reply.toolCalls.length) {
    message.tool_calls = reply.toolCalls.map((c) => ({ id: c.id, type: "function", function: { name: c.name, arguments: c.arguments } }));
  }
  if (reply.mcpCalls.length) message.mcp = reply.mcpCalls;
  state.history.push(message);
}

function setBusy(busy) {
  $("#send").disabled = busy;
  $("#stop").disabled = !busy;
}

function setImage(dataURL) {
  state.image = dataURL;
  $("#attachment").hidden = !dataURL;
  $("#attachment-img").src = dataURL || "";
  if (!dataURL) $("#image").value = "";
}

// ---- dashboard ----------------------------------------------------------------------------------
// /v1/status and /v1/cache/stats answer one model's object, or {models: {name: object}} for several.
function perModel(answer, names) {
  if (answer && answer.models && typeof answer.models === "object" && !Array.isArray(answer.models)) return answer.models;
  return { [answer?.model || names[0] || "model"]: answer };
}

function parseMetrics(text) {
  const out = {};
  for (const line of text.split("\n")) {
    const m = /^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)$/.exec(line);
    if (m) out[m[1]] = (out[m[1]] || 0) + parseFloat(m[3]);  // labelled series summed
  }
  return out;
}

async function refreshDashboard() {
  const [models, status, cache, metrics, batches] = await Promise.allSettled([
    getJSON("/v1/models"), getJSON("/v1/status"), getJSON("/v1/cache/stats"), api("/metrics").then((r) => r.text()),
    batchList(),
  ]);
  const list = models.status === "fulfilled" ? models.value.data : [];
  const names = list.map((m) => m.id);
  renderModels(list);
  if (status.status === "fulfilled") {
    renderBudgets(perModel(status.value, names));
    renderRequests(perModel(status.value, names));
  }
  if (cache.status === "fulfilled") renderCaches(perModel(cache.value, names));
  if (metrics.status === "fulfilled") renderLive(parseMetrics(metrics.value));
  renderBatches(batches.status === "fulfilled" ? batches.value : []);
  const failed = [models, status, cache, metrics].find((r) => r.status === "rejected");
  notice(failed ? "Dashboard: " + failed.reason.message : "");
}

function renderModels(list) {
  $("#models-table tbody").replaceChildren(...list.map((m) => {
    const action = m.status === "loaded" ? "unload" : m.status === "not_loaded" ? "load" : null;
    const button = el("button", { type: "button", textContent: action ? action[0].toUpperCase() + action.slice(1) : "…",
      disabled: !action, onclick: () => modelAction(m.id, action) });
    button.setAttribute("aria-label", `${action || "busy"} ${m.id}`);
    return el("tr", {},
      el("td", {}, el("strong", { textContent: m.id }), m.pinned ? el("small", { textContent: " pinned" }) : null),
      el("td", {}, el("span", { className: `state ${m.status}`, textContent: m.status.replace("_", " ") }),
        m.error ? el("div", { className: "error", textContent: m.error }) : null),
      el("td", { textContent: fmtBytes(m.weight_bytes) }),
      el("td", { textContent: m.max_model_len ? `${m.max_model_len} tokens` : "–" }),
      el("td", {}, button));
  }));
}

async function modelAction(name, action) {
  try {
    await api(`/v1/models/${encodeURIComponent(name)}/${action}`, { method: "POST", body: "{}" });
  } catch (e) {
    notice(`${action} ${name}: ${e.message}`);
  }
  refreshDashboard();
  loadModels();
}

// Each request the engine holds (/v1/status `requests`): a long prompt's prefill progress while it runs.
function renderRequests(byModel) {
  const rows = Object.entries(byModel).flatMap(([name, s]) => (s?.requests || []).map((r) => {
    const pct = r.prefill_tokens ? Math.floor((100 * r.prefilled_tokens) / r.prefill_tokens) : 100;
    return el("tr", {},
      el("td", { textContent: name }),
      el("td", { textContent: r.id.slice(0, 12) }),
      el("td", { textContent: r.state }),
      el("td", { textContent: `${r.prefilled_tokens} / ${r.prefill_tokens} (${pct}%)` }),
      el("td", { textContent: String(r.cached_tokens) }),
      el("td", { textContent: r.prefill_tokens_per_s == null ? "-" : r.prefill_tokens_per_s.toFixed(1) }),
      el("td", { textContent: String(r.output_tokens) }));
  }).concat(s?.num_waiting_unlisted ? [el("tr", {},  // a long queue lists its first requests only
    el("td", { textContent: name }),
    el("td", { colSpan: 6, className: "muted", textContent: `and ${s.num_waiting_unlisted} more waiting` }))] : []));
  $("#requests-table tbody").replaceChildren(...(rows.length ? rows
    : [el("tr", {}, el("td", { colSpan: 7, className: "muted", textContent: "none running or waiting" }))]));
}

// The caller's batches (GET /v1/batches, newest first). A server without a batch store answers 404, or 503
// when its folder is unusable: no panel then, and no notice, as for a server without batches.
async function batchList() {
  const r = await fetch("/v1/batches?limit=100", { headers: authHeaders() });
  return r.ok ? (await r.json()).data : [];
}

function renderBatches(list) {
  $("#batches").hidden = !list.length;
  $("#batches-table tbody").replaceChildren(...list.map((b) => {
    const { total, completed, failed } = b.request_counts;
    const done = completed + failed;
    const bar = el("div", { className: "bar progress" }, el("div", { className: "seg done" }));
    bar.firstChild.style.width = `${total ? (100 * done) / total : 0}%`;
    bar.setAttribute("role", "progressbar");
    bar.setAttribute("aria-valuemin", "0");
    bar.setAttribute("aria-valuemax", String(total));
    bar.setAttribute("aria-valuenow", String(done));
    bar.setAttribute("aria-label", `${b.id} progress`);
    const counts = `${done} / ${total}` + (failed ? ` (${failed} failed)` : "");
    let action = null;
    if (BATCH_RUNNING.has(b.status)) {
      action = el("button", { type: "button", textContent: "Cancel", onclick: () => cancelBatch(b.id, action) });
      action.setAttribute("aria-label", `Cancel ${b.id}`);
    }
    return el("tr", {},
      el("td", {}, el("code", { textContent: b.id })),
      el("td", { textContent: b.endpoint }),
      el("td", {}, el("span", { className: `state ${b.status}`, textContent: b.status.replace("_", " ") })),
      el("td", { className: "progress-cell" }, bar, el("small", { className: "counts", textContent: counts })),
      el("td", { textContent: new Date(b.created_at * 1000).toLocaleString() }),
      el("td", {}, action));
  }));
}

async function cancelBatch(id, button) {
  button.disabled = true;
  try {
    await api(`/v1/batches/${encodeURIComponent(id)}/cancel`, { method: "POST", body: "{}" });
  } catch (e) {
    notice(`cancel ${id}: ${e.message}`);
  }
  refreshDashboard();
}

function renderBudgets(byModel) {
  $("#budgets").replaceChildren(...Object.entries(byModel).map(([name, s]) => {
    const b = s?.budget;
    const title = el("h3", { textContent: name });
    if (!b) return el("div", { className: "budget" }, title, el("p", { className: "muted", textContent: s?.status ? `not loaded (${s.status.replace("_", " ")})` : "no memory budget (none could be computed)" }));
    const total = BUDGET_PARTS.reduce((sum, [k]) => sum + (b[k] || 0), 0) || 1;
    const bar = el("div", { className: "bar" });
    bar.setAttribute("role", "img");
    bar.setAttribute("aria-label", BUDGET_PARTS.map(([k, label]) => `${label} ${fmtBytes(b[k] || 0)}`).join(", "));
    const legend = el("ul", { className: "legend" });
    for (const [k, label] of BUDGET_PARTS) {
      const seg = el("div", { className: `seg ${k}`, title: `${label}: ${fmtBytes(b[k] || 0)}` });
      seg.style.width = `${(100 * (b[k] || 0)) / total}%`;
      bar.append(seg);
      legend.append(el("li", {}, el("span", { className: `swatch ${k}` }), `${label} ${fmtBytes(b[k] || 0)}`));
    }
    const mem = s.memory || {};
    const note = el("p", { className: "muted", textContent: `ceiling ${fmtBytes(b.ceiling)} (${s.memory_mode || ""}) · KV capacity ${s.kv_capacity_tokens?.toLocaleString() ?? "–"} tokens · process RSS ${fmtBytes(mem.process_rss)} · MLX active ${fmtBytes(mem.mlx_active)}` });
    return el("div", { className: "budget" }, title, bar, legend, note);
  }));
}

function renderCaches(byModel) {
  $("#caches").replaceChildren(...Object.entries(byModel).map(([name, c]) => {
    const rows = [];
    if (c?.enabled) {
      rows.push(["prefix hit rate", pct(c.hit_tokens / (c.queried_tokens || NaN))],
        ["prefix blocks", `${c.num_cached_blocks} of ${c.max_cached_blocks}`],
        ["prefix memory", `${fmtBytes(c.memory_bytes)} of ${fmtBytes(c.budget_bytes)}`]);
      if (c.ssd) rows.push(["SSD tier", fmtBytes(c.ssd.bytes ?? c.ssd.size_bytes)]);
    } else rows.push(["prefix cache", c?.status ? "model not loaded" : "off"]);
    if (c?.vision) {
      const v = c.vision;
      rows.push(["vision hit rate", pct(v.hits / (v.hits + v.misses || NaN))], ["vision memory", `${fmtBytes(v.bytes)} of ${fmtBytes(v.max_bytes)}`]);
    }
    return el("div", {}, el("h3", { textContent: name }), statsList(rows));
  }));
}

function statsList(rows) {
  const dl = el("dl", { className: "stats-grid" });
  for (const [k, v] of rows) dl.append(el("dt", { textContent: k }), el("dd", { textContent: v }));
  return dl;
}

function renderLive(m) {
  const now = performance.now(), tokens = m.mlxhost_completion_tokens_total ?? 0;
  let rate = "–";
  if (state.lastTokens) rate = ((tokens - state.lastTokens.tokens) / ((now - state.lastTokens.t) / 1000)).toFixed(1);
  state.lastTokens = { tokens, t: now };
  $("#live").replaceChildren(...statsList([
    ["running", m.mlxhost_num_requests_running ?? "–"], ["waiting", m.mlxhost_num_requests_waiting ?? "–"],
    ["tok/s now", rate], ["tokens generated", tokens], ["prompt tokens", m.mlxhost_prompt_tokens_total ?? "–"],
  ]).childNodes);
}

// ---- wiring -------------------------------------------------------------------------------------
function init() {
  $("#key").value = localStorage.getItem(KEY_STORE) || "";
  $("#key-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const key = $("#key").value.trim();
    if (key) localStorage.setItem(KEY_STORE, key); else localStorage.removeItem(KEY_STORE);
    notice("");
    loadModels();
    loadMcpServers();
  });
  $("#tab-chat").addEventListener("click", () => showTab("chat"));
  $("#tab-dash").addEventListener("click", () => showTab("dash"));
  $("nav").addEventListener("keydown", (ev) => {  // arrow keys move between tabs (WAI-ARIA tabs pattern)
    if (ev.key !== "ArrowLeft" && ev.key !== "ArrowRight") return;
    const next = $("#tab-chat").getAttribute("aria-selected") === "true" ? "dash" : "chat";
    showTab(next);
    $(next === "dash" ? "#tab-dash" : "#tab-chat").focus();
  });
  $("#composer").addEventListener("submit", send);
  $("#prompt").addEventListener("keydown", (ev) => {
    if (ev.key !== "Enter" || ev.shiftKey || ev.isComposing) return;
    ev.preventDefault();
    $("#composer").requestSubmit();
  });
  $("#stop").addEventListener("click", () => state.controller?.abort());
  $("#clear").addEventListener("click", () => { state.history = []; $("#log").replaceChildren(); });
  $("#image").addEventListener("change", () => {
    const file = $("#image").files[0];
    if (!file) return;
    const reader = new FileReader();
    reader.onload = () => setImage(reader.result);
    reader.readAsDataURL(file);
  });
  $("#attachment-remove").addEventListener("click", () => setImage(null));
  loadModels();
  loadMcpServers();
}

init();
