// mtp-serve's web page: a playground (streamed chat), live charts from GET /v1/stats, and a
// side-by-side run of one prompt greedy with MTP off and on. Plain JS, no build step.
//
// The API key (when the server has one) is asked for once, kept in localStorage and sent
// as "Authorization: Bearer" on every fetch; the page's own files are served without it.
"use strict";

const $ = (id) => document.getElementById(id);
const params = new URLSearchParams(location.search);
const POLL_MS = Math.max(100, Number(params.get("poll")) || 1000);
const KEY_STORE = "mtp-serve-api-key";

const state = {
  model: null,
  history: [],        // the conversation sent with each turn
  abort: null,        // AbortController of the reply streaming now
  lastStats: null,
  prevStats: null,
  polls: 0,
  depthCap: 0,
};

// ------------------------------------------------------------------ fetch with the key

class HTTPError extends Error {
  constructor(status, message) { super(message); this.status = status; }
}

function headers(extra = {}) {
  const key = localStorage.getItem(KEY_STORE);
  return Object.assign(key ? {Authorization: `Bearer ${key}`} : {}, extra);
}

async function api(path, opts = {}) {
  const res = await fetch(path, Object.assign({}, opts, {headers: headers(opts.headers || {})}));
  if (res.status === 401) {
    askForKey("the server wants its API key");
  }
  if (!res.ok) {
    let message = `${res.status} ${res.statusText}`;
    try {
      const body = await res.json();
      message = (body.error && body.error.message) || message;
    } catch (e) { /* not JSON */ }
    throw new HTTPError(res.status, message);
  }
  return res;
}

function askForKey(why) {
  const form = $("key-form");
  form.hidden = false;
  setConn(why, "bad");
}

$("key-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const key = $("key").value.trim();
  if (key) localStorage.setItem(KEY_STORE, key); else localStorage.removeItem(KEY_STORE);
  $("key").value = "";
  $("key-form").hidden = true;
  connect();
});

function setConn(text, cls) {
  const el = $("conn");
  el.textContent = text;
  el.className = "pill " + (cls || "");
}

// ------------------------------------------------------------------ live charts

const bytesFmt = (v) => v >= 1 << 30 ? (v / (1 << 30)).toFixed(2) + " GiB" : v >= 1 << 20 ? (v / (1 << 20)).toFixed(1) + " MiB"
  : v >= 1024 ? (v / 1024).toFixed(0) + " KiB" : v.toFixed(0) + " B";
const charts = {
  tokS: new LineChart($("chart-tok-s")),
  perPass: new LineChart($("chart-per-pass")),
  acceptance: new LineChart($("chart-acceptance"), {max: 1}),
  sources: new LineChart($("chart-sources")),
  depth: new LineChart($("chart-depth"), {step: true, format: (v) => v.toFixed(0)}),
  batch: new LineChart($("chart-batch"), {step: true, format: (v) => v.toFixed(0)}),
  cacheBytes: new LineChart($("chart-cache-bytes"), {format: bytesFmt}),
  cacheHits: new LineChart($("chart-cache-hits")),
  completion: new LineChart($("chart-completion")),
};

const sum = (o) => Object.values(o || {}).reduce((a, b) => a + b, 0);
const named = (prefix, arr, from = 1) => Object.fromEntries((arr || []).map((v, i) => [`${prefix}${i + from}`, v]));

function rate(now, prev, get) {
  if (!prev) return null;
  const dt = now.time - prev.time;
  return dt > 0 ? Math.max(0, get(now) - get(prev)) / dt : null;
}

function onStats(s) {
  const prev = state.lastStats;
  state.prevStats = prev;
  state.lastStats = s;
  state.polls++;
  const t = s.time * 1000;
  const running = s.engine.running_sequences;
  charts.tokS.push(t, {"all rows": s.decode.tokens_per_second});
  const dPasses = prev ? s.totals.backbone_passes - prev.totals.backbone_passes : 0;
  const dTokens = prev ? s.totals.completion_tokens - prev.totals.completion_tokens : 0;
  charts.perPass.push(t, {
    "running rows": running ? s.decode.tokens_per_pass : null,
    "finished requests": dPasses > 0 ? dTokens / dPasses : null,
  });
  charts.acceptance.push(t, named("pos ", s.policy.acceptance_per_position));
  charts.sources.push(t, Object.fromEntries(Object.keys(s.totals.accepted_by_source || {}).map(
    (k) => [k === "mtp" ? "MTP head" : k === "copy" ? "copied" : "grammar-forced", rate(s, prev, (x) => x.totals.accepted_by_source[k])])));
  const depths = {};
  for (let r = 0; r < s.engine.batch_capacity; r++) depths[`row ${r}`] = s.decode.row_depths[r] ?? null;
  // only rows that ever ran get a series
  for (const k of Object.keys(depths)) if (depths[k] === null && !charts.depth.series.has(k)) delete depths[k];
  charts.depth.push(t, depths);
  charts.batch.opts.max = Math.max(1, s.engine.batch_capacity);
  charts.batch.push(t, {running: running, prefilling: s.engine.active_sequences - running, waiting: s.engine.queue_depth});
  const pc = s.prompt_cache;
  if (pc.enabled) {
    charts.cacheBytes.push(t, Object.fromEntries(Object.entries(pc.bytes).map(([k, v]) => [k, v])));
    charts.cacheHits.push(t, {
      "hits": sum(pc.hits),
      "misses": pc.misses,
      "reused tokens /s": rate(s, prev, (x) => sum(x.prompt_cache.reused_tokens)),
    });
  } else {
    charts.cacheBytes.push(t, {});
    charts.cacheHits.push(t, {});
  }
  charts.completion.push(t, {
    "completion tok/s": rate(s, prev, (x) => x.totals.completion_tokens),
    "prompt tok/s": rate(s, prev, (x) => x.totals.prompt_tokens - x.totals.cached_prompt_tokens),
    "cached prompt tok/s": rate(s, prev, (x) => x.totals.cached_prompt_tokens),
  });
  renderTotals(s);
  state.depthCap = s.mtp.depth_cap;
  $("mtp-status").textContent = s.mtp.depth_cap > 0 ? `MTP up to depth ${s.mtp.depth_cap}` : (s.mtp.status || "MTP off");
  $("depth").max = String(Math.max(1, s.mtp.depth_cap));
  $("stats-age").textContent = `every ${POLL_MS} ms · ${state.polls} polls`;
}

function renderTotals(s) {
  const tot = s.totals, pc = s.prompt_cache;
  const acc = tot.drafted_per_position.map((d, i) => d ? (tot.accepted_per_position[i] / d).toFixed(3) : "-").join(" / ");
  const rows = [
    ["requests (generation and refused)", tot.requests],
    ["completion tokens", tot.completion_tokens],
    ["prompt tokens (of them from the cache)", `${tot.prompt_tokens} (${tot.cached_prompt_tokens})`],
    ["backbone passes / tokens per pass", `${tot.backbone_passes} / ${tot.backbone_passes ? (tot.completion_tokens / tot.backbone_passes).toFixed(2) : "-"}`],
    ["acceptance per draft position (finished requests)", acc || "-"],
    ["drafted / accepted by source: head, copied, grammar-forced",
     ["mtp", "copy", "forced"].map((k) => `${(tot.drafted_by_source || {})[k] ?? 0} / ${(tot.accepted_by_source || {})[k] ?? 0}`).join(", ")],
    ["decode rounds", s.engine.decode_rounds],
  ];
  if (pc.enabled) {
    const tiers = Object.keys(pc.bytes);
    rows.push(["prompt cache bytes / budget", tiers.map((t) => `${t} ${bytesFmt(pc.bytes[t])} / ${bytesFmt(pc.budget_bytes[t])}`).join(", ")]);
    rows.push(["prompt cache snapshots, hits, reused tokens", tiers.map((t) => `${t} ${pc.snapshots[t]}, ${pc.hits[t]}, ${pc.reused_tokens[t]}`).join("; ")]);
  } else {
    rows.push(["prompt cache", pc.off_reason ? `off: ${pc.off_reason}` : "off"]);
  }
  const table = $("totals");
  table.replaceChildren(...rows.map(([k, v]) => {
    const tr = document.createElement("tr");
    const a = document.createElement("td"), b = document.createElement("td");
    a.textContent = k; b.textContent = String(v);
    tr.append(a, b);
    return tr;
  }));
}

let pollTimer = null;
async function poll() {
  clearTimeout(pollTimer);
  try {
    const res = await api("/v1/stats");
    onStats(await res.json());
    setConn("live", "ok");
  } catch (e) {
    if (e.status === 401) return; // waits for the key form
    setConn("no connection", "bad");
  }
  pollTimer = setTimeout(poll, POLL_MS);
}

async function connect() {
  try {
    const res = await api("/v1/models");
    const body = await res.json();
    state.model = body.data[0].id;
    $("model").textContent = state.model;
    poll();
  } catch (e) {
    if (e.status !== 401) setConn("no connection", "bad");
  }
}

// ------------------------------------------------------------------ streaming chat

function sampling() {
  const num = (id) => { const v = $(id).value; return v === "" ? null : Number(v); };
  const body = {
    temperature: num("temperature"), top_p: num("top_p"), top_k: num("top_k"), min_p: num("min_p"),
    max_tokens: num("max_tokens"),
    mtp_depth: $("mtp-on").checked ? Math.max(1, num("depth") || 1) : 0,
    chat_template_kwargs: {enable_thinking: $("thinking").checked},
  };
  if (num("seed") !== null) body.seed = num("seed");
  const tools = $("tools").value.trim();
  if (tools) body.tools = JSON.parse(tools);
  return body;
}

// Streams one chat completion; `on` gets {reasoning, content, toolCall} pieces as they arrive.
// Returns the whole reply with its usage and timings.
async function streamChat(messages, body, on = {}, signal = undefined) {
  const t0 = performance.now();
  const res = await api("/v1/chat/completions", {
    method: "POST", signal,
    headers: {"Content-Type": "application/json"},
    body: JSON.stringify(Object.assign({model: state.model, messages, stream: true,
                                        stream_options: {include_usage: true}}, body)),
  });
  const reply = {content: "", reasoning: "", toolCalls: [], usage: null, finish: null, ttft: null, t0, tEnd: null};
  let tFirst = null, tLast = null;
  const reader = res.body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  for (;;) {
    const {value, done} = await reader.read();
    if (done) break;
    buf += decoder.decode(value, {stream: true});
    let cut;
    while ((cut = buf.indexOf("\n")) >= 0) {
      const line = buf.slice(0, cut).replace(/\r$/, "");
      buf = buf.slice(cut + 1);
      if (!line.startsWith("data:")) continue;
      const data = line.slice(5).trim();
      if (data === "[DONE]") continue;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message || "stream error");
      if (chunk.usage) reply.usage = chunk.usage;
      for (const choice of chunk.choices || []) {
        const d = choice.delta || {};
        const now = performance.now();
        if (d.reasoning_content || d.content || d.tool_calls) {
          if (tFirst === null) tFirst = now;
          tLast = now;
        }
        if (d.reasoning_content) { reply.reasoning += d.reasoning_content; on.reasoning && on.reasoning(d.reasoning_content); }
        if (d.content) { reply.content += d.content; on.content && on.content(d.content); }
        for (const tc of d.tool_calls || []) {
          const call = reply.toolCalls[tc.index] || (reply.toolCalls[tc.index] = {id: "", type: "function", function: {name: "", arguments: ""}});
          if (tc.id) call.id = tc.id;
          if (tc.function && tc.function.name) call.function.name = tc.function.name;
          if (tc.function && tc.function.arguments) call.function.arguments += tc.function.arguments;
          on.toolCall && on.toolCall(tc.index, call);
        }
        if (choice.finish_reason) reply.finish = choice.finish_reason;
      }
    }
  }
  reply.tEnd = performance.now();
  reply.ttft = tFirst === null ? null : (tFirst - t0) / 1000;
  const n = reply.usage ? reply.usage.completion_tokens : 0;
  // Decode speed: the tokens after the first over the time from the first to the last.
  reply.decodeTokS = tFirst !== null && tLast > tFirst && n > 1 ? (n - 1) / ((tLast - tFirst) / 1000) : null;
  reply.wallTokS = n / ((reply.tEnd - t0) / 1000);
  return reply;
}

function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text;
  return e;
}

function scrollDown() { const m = $("messages"); m.scrollTop = m.scrollHeight; }

function usageLine(reply) {
  const u = reply.usage, box = el("div", "usage");
  const item = (label, value) => { const s = el("span"); s.append(label + " ", el("b", "", value)); box.append(s); };
  if (!u) { item("usage", "none"); return box; }
  const sp = u.speculative || {};
  item("tokens", String(u.completion_tokens));
  item("decode tok/s", reply.decodeTokS ? reply.decodeTokS.toFixed(1) : "-");
  item("first token", reply.ttft !== null ? `${(reply.ttft * 1000).toFixed(0)} ms` : "-");
  item("depth", String(sp.depth ?? 0));
  item("tokens/pass", sp.tokens_per_pass ? sp.tokens_per_pass.toFixed(2) : "-");
  const per = (sp.drafted_per_position || []).map((d, i) => d ? (sp.accepted_per_position[i] / d).toFixed(2) : "-");
  item("acceptance by position", per.length ? per.join(" / ") : "-");
  const cached = (u.prompt_tokens_details || {}).cached_tokens || 0;
  item("cached prompt", `${cached} of ${u.prompt_tokens}`);
  box.dataset.completionTokens = String(u.completion_tokens);
  return box;
}

function toolCallBox(call) {
  const box = el("div", "tool-call");
  box.append(el("span", "name", call.function.name || "…"), "(" + call.function.arguments + ")");
  return box;
}

async function send(text) {
  const system = $("system").value.trim();
  let body;
  try { body = sampling(); } catch (e) { return showError(`tools: ${e.message}`); }
  state.history.push({role: "user", content: text});
  $("messages").append(el("div", "msg user", text));
  const bubble = el("div", "msg assistant");
  const reasoning = el("details", "reasoning");
  reasoning.open = true;
  reasoning.append(el("summary", "", "reasoning"));
  const reasoningText = el("span");
  reasoning.append(reasoningText);
  reasoning.hidden = true;
  const content = el("div", "content");
  const calls = el("div", "calls");
  bubble.append(reasoning, content, calls);
  $("messages").append(bubble);
  scrollDown();
  const messages = (system ? [{role: "system", content: system}] : []).concat(state.history);
  state.abort = new AbortController();
  setBusy(true);
  const seen = [];
  let deltas = 0;  // content pieces as they streamed in (the tests read it)
  try {
    const reply = await streamChat(messages, body, {
      reasoning: (t) => { reasoning.hidden = false; reasoningText.textContent += t; scrollDown(); },
      content: (t) => { content.textContent += t; bubble.dataset.deltas = String(++deltas); scrollDown(); },
      toolCall: (i, call) => { seen[i] = call; calls.replaceChildren(...seen.filter(Boolean).map(toolCallBox)); scrollDown(); },
    }, state.abort.signal);
    calls.replaceChildren(...reply.toolCalls.filter(Boolean).map(toolCallBox));
    if (reasoning.hidden === false) reasoning.open = false;
    bubble.append(usageLine(reply));
    bubble.dataset.done = "true";
    const msg = {role: "assistant", content: reply.content};
    if (reply.toolCalls.length) msg.tool_calls = reply.toolCalls.filter(Boolean);
    state.history.push(msg);
  } catch (e) {
    bubble.classList.add("error");
    content.textContent += (content.textContent ? "\n" : "") + (e.name === "AbortError" ? "(stopped)" : e.message);
    bubble.dataset.done = "true";
    state.history.pop();
  } finally {
    setBusy(false);
    state.abort = null;
    scrollDown();
  }
}

function showError(message) {
  const b = el("div", "msg assistant error", message);
  $("messages").append(b);
  scrollDown();
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("compare").disabled = busy;
  $("stop").disabled = !busy;
}

$("chat-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || state.abort) return;
  $("prompt").value = "";
  send(text);
});
$("prompt").addEventListener("keydown", (ev) => {
  if (ev.key === "Enter" && !ev.shiftKey) { ev.preventDefault(); $("chat-form").requestSubmit(); }
});
$("stop").addEventListener("click", () => state.abort && state.abort.abort());
$("clear").addEventListener("click", () => { state.history = []; $("messages").replaceChildren(); });

// ------------------------------------------------------------------ side by side

function firstDifference(a, b) {
  const n = Math.min(a.length, b.length);
  for (let i = 0; i < n; i++) if (a[i] !== b[i]) return i;
  return a.length === b.length ? -1 : n;
}

const COMPARE_RUNS = 2;
const replyText = (r) => r.reasoning + "\u0000" + r.content + "\u0000" + JSON.stringify(r.toolCalls);

async function compare() {
  const user = [...state.history].reverse().find((m) => m.role === "user");
  const text = $("prompt").value.trim() || (user && user.content) || "def fibonacci(n):";
  const system = $("system").value.trim();
  const messages = (system ? [{role: "system", content: system}] : []).concat([{role: "user", content: text}]);
  let body;
  try { body = sampling(); } catch (e) { return showError(`tools: ${e.message}`); }
  // Greedy both times; only the depth differs.
  Object.assign(body, {temperature: 0, top_p: 1, top_k: -1, min_p: 0});
  delete body.seed;
  const depth = Math.max(1, Number($("depth").value) || 1);
  const out = $("compare-result");
  out.hidden = false;
  out.dataset.state = "running";
  out.replaceChildren(el("div", "verdict", `running "${text.slice(0, 60)}" greedy, MTP off and MTP depth ${depth} in turn …`));
  setBusy(true);
  state.abort = new AbortController();
  try {
    // Alternating runs, the fastest of each kept: other work on the machine only ever adds time.
    const runs = {off: [], on: []};
    for (let r = 0; r < COMPARE_RUNS; r++) {
      runs.off.push(await streamChat(messages, Object.assign({}, body, {mtp_depth: 0}), {}, state.abort.signal));
      runs.on.push(await streamChat(messages, Object.assign({}, body, {mtp_depth: depth}), {}, state.abort.signal));
    }
    const fastest = (rs) => rs.reduce((a, b) => ((b.decodeTokS || 0) > (a.decodeTokS || 0) ? b : a));
    const off = fastest(runs.off), on = fastest(runs.on);
    const a = replyText(runs.off[0]);
    const other = [...runs.off, ...runs.on].map(replyText).find((t) => t !== a);
    const at = other === undefined ? -1 : firstDifference(a, other);
    const same = at < 0;
    const speed = (r) => r.decodeTokS ? `${r.decodeTokS.toFixed(1)} tok/s` : "-";
    const ratio = off.decodeTokS && on.decodeTokS ? on.decodeTokS / off.decodeTokS : null;
    const verdict = el("div", "verdict " + (same ? "same" : "differ"),
      (same ? "identical texts" : `texts differ at character ${at}`) +
      (ratio ? ` · MTP ${ratio.toFixed(2)}x the speed without it` : "") + ` (fastest of ${COMPARE_RUNS} alternating runs each)`);
    const col = (title, r) => {
      const c = el("div");
      const sp = (r.usage && r.usage.speculative) || {};
      c.append(el("div", "", `${title}: ${speed(r)}, ${r.usage ? r.usage.completion_tokens : 0} tokens` +
        (sp.tokens_per_pass ? `, ${sp.tokens_per_pass.toFixed(2)} tokens/pass` : "")));
      c.append(el("pre", "", (r.reasoning ? r.reasoning + "\n---\n" : "") + r.content +
        (r.toolCalls.length ? "\n" + JSON.stringify(r.toolCalls) : "")));
      return c;
    };
    const cols = el("div", "cols");
    cols.append(col("MTP off", off), col(`MTP depth ${depth}`, on));
    out.replaceChildren(verdict, cols);
    out.dataset.identical = String(same);
    out.dataset.speedup = ratio ? ratio.toFixed(3) : "";
    out.dataset.state = "done";
  } catch (e) {
    out.replaceChildren(el("div", "verdict differ", e.name === "AbortError" ? "stopped" : e.message));
    out.dataset.state = "error";
  } finally {
    setBusy(false);
    state.abort = null;
  }
}
$("compare").addEventListener("click", compare);
$("mtp-on").addEventListener("change", () => { $("depth").disabled = !$("mtp-on").checked; });

window.mtpPage = {state, charts};
window.addEventListener("resize", () => Object.values(charts).forEach((c) => c.draw()));
connect();
