// The chat page of `tessera serve`: plain JS, no build step.
// Talks to the same OpenAI API as any client (POST /v1/chat/completions with
// stream: true) and polls GET /v1/tessera/stats for the placement.
"use strict";

const $ = (id) => document.getElementById(id);
const state = { model: null, history: [], busy: false, abort: null, lastStats: null };

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = localStorage.getItem("tessera-api-key");
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

function addMessage(role, text) {
  const div = document.createElement("div");
  div.className = "msg " + role;
  div.textContent = text;
  $("messages").appendChild(div);
  div.scrollIntoView({ block: "end" });
  return div;
}

function setMeta(div, text) {
  let meta = div.querySelector(".meta");
  if (!meta) {
    meta = document.createElement("span");
    meta.className = "meta";
    div.appendChild(meta);
  }
  meta.textContent = text;
}

async function apiError(resp) {
  try {
    const body = await resp.json();
    if (body && body.error) return body.error.message + " (HTTP " + resp.status + ")";
  } catch (e) { /* not JSON */ }
  return "HTTP " + resp.status;
}

// Split an SSE byte stream into `data:` payloads.
async function* sseEvents(body) {
  const reader = body.getReader();
  const decoder = new TextDecoder("utf-8");
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buf += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buf.indexOf("\n\n")) >= 0) {
      const event = buf.slice(0, cut);
      buf = buf.slice(cut + 2);
      for (const line of event.split("\n")) {
        if (line.startsWith("data: ")) yield line.slice(6);
      }
    }
  }
}

async function ensureModel() {
  if (state.model) return;
  const resp = await fetch("/v1/models", { headers: headers() });
  if (!resp.ok) throw new Error(await apiError(resp));
  state.model = (await resp.json()).data[0].id;
  $("model").textContent = state.model;
}

async function send(text) {
  if (state.busy || !text.trim()) return;
  state.busy = true;
  $("send").disabled = true;
  $("stop").disabled = false;
  state.history.push({ role: "user", content: text });
  addMessage("user", text);
  const div = addMessage("assistant streaming", "");
  const textNode = document.createTextNode("");
  div.appendChild(textNode);
  const body = {
    model: state.model, messages: state.history, stream: true,
    stream_options: { include_usage: true, continuous_usage_stats: true },
    max_tokens: parseInt($("max-tokens").value, 10) || 128,
    temperature: parseFloat($("temperature").value) || 0,
  };
  const t0 = performance.now();
  let tFirst = null, tokens = 0, reply = "", finish = null;
  state.abort = new AbortController();
  try {
    await ensureModel();
    body.model = state.model;
    const resp = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(body), signal: state.abort.signal,
    });
    if (resp.status === 401) $("key-row").hidden = false;
    if (!resp.ok) throw new Error(await apiError(resp));
    for await (const data of sseEvents(resp.body)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) tokens = chunk.usage.completion_tokens;
      const choice = chunk.choices && chunk.choices[0];
      if (!choice) continue;
      const piece = (choice.delta && choice.delta.content) || "";
      if (piece) {
        if (tFirst === null) {
          tFirst = performance.now();
          $("ttft").textContent = ((tFirst - t0) / 1000).toFixed(2) + " s";
        }
        reply += piece;
        textNode.data = reply;
        div.scrollIntoView({ block: "end" });
      }
      if (choice.finish_reason) finish = choice.finish_reason;
      if (tFirst !== null && tokens > 1) {
        const secs = (performance.now() - tFirst) / 1000;
        if (secs > 0) $("tps").textContent = ((tokens - 1) / secs).toFixed(1);
      }
    }
    state.history.push({ role: "assistant", content: reply });
    setMeta(div, tokens + " tokens, " + ((performance.now() - t0) / 1000).toFixed(2) + " s, finish: " + (finish || "?"));
  } catch (e) {
    if (e.name === "AbortError") {
      state.history.push({ role: "assistant", content: reply });
      setMeta(div, "stopped after " + tokens + " tokens");
    } else {
      state.history.pop();            // the turn failed: do not keep it in the conversation
      div.className = "msg error";
      div.textContent = e.message;
    }
  } finally {
    div.classList.remove("streaming");
    div.dataset.done = "true";
    state.busy = false;
    state.abort = null;
    $("send").disabled = false;
    $("stop").disabled = true;
  }
}

function fmtBytes(n) {
  if (n === undefined || n === null) return "-";
  const units = ["B", "KiB", "MiB", "GiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return (i ? n.toFixed(1) : n) + " " + units[i];
}

function renderStats(s) {
  const e = s.engine || {};
  const p = e.placement || {};
  $("plan").textContent = e.plan ?? "-";
  $("switches").textContent = e.plan_switches ?? "-";
  $("bytes").textContent = fmtBytes(e.bytes_moved_per_step ?? p.bytes_per_step);
  $("steps").textContent = e.steps ?? "-";
  $("slots").textContent = (e.slots_in_use ?? "-") + " / " + (e.slots_total ?? "-");
  $("queue").textContent = e.queue_depth ?? "-";
  // one row per device of the plan (names may repeat, e.g. two "cpu" devices): by position
  const devs = e.devices && e.devices.length ? e.devices
    : (p.devices || []).map((name, i) => ({ name, kernels: (p.kernels_per_device || [])[i] }));
  const tbody = $("placement").querySelector("tbody");
  tbody.replaceChildren();
  devs.forEach((d, i) => {
    const kernels = (p.kernels_per_device || [])[i] ?? d.kernels ?? "-";
    const tr = document.createElement("tr");
    for (const v of [i + ": " + d.name, kernels]) {
      const td = document.createElement("td");
      td.textContent = v;
      tr.appendChild(td);
    }
    const td = document.createElement("td");
    const busy = typeof d.busy_recent === "number" ? d.busy_recent : d.busy_fraction;   // the last 10 s
    if (typeof busy === "number") {
      const bar = document.createElement("span");
      bar.className = "bar";
      bar.style.width = Math.round(busy * 40) + "px";
      td.append(bar, (busy * 100).toFixed(0) + "%");
    } else {
      td.textContent = "-";
    }
    tr.appendChild(td);
    tbody.appendChild(tr);
  });
  showHealth(s.health || {});
  const prev = state.lastStats;
  if (prev && s.server.time > prev.server.time) {
    const rate = (s.server.generated_tokens - prev.server.generated_tokens) / (s.server.time - prev.server.time);
    $("server-tps").textContent = rate.toFixed(1);
  }
  state.lastStats = s;
}

function showHealth(h) {
  const pill = $("health");
  if (h.ok) {
    pill.textContent = "healthy";
    pill.className = "pill ok";
  } else if (h.status === "starting") {
    pill.textContent = "starting: " + (h.buckets_placed || 0) + "/" + (h.buckets || "?") + " placed";
    pill.className = "pill wait";
  } else {
    pill.textContent = (h.lost || []).length ? "node lost: " + h.lost.join(", ") : "unhealthy";
    pill.className = "pill bad";
  }
}

function needKey() {
  $("key-row").hidden = false;
  $("model").textContent = "API key needed";
  $("health").textContent = "locked";
  $("health").className = "pill wait";
}

async function pollStats() {
  clearTimeout(state.poll);
  try {
    const resp = await fetch("/v1/tessera/stats", { headers: headers() });
    if (resp.status === 401) needKey();
    if (resp.ok) {
      $("key-row").hidden = true;
      const s = await resp.json();
      if (!state.model) {
        state.model = s.model;
        $("model").textContent = s.model;
      }
      renderStats(s);
    }
  } catch (e) {
    $("health").textContent = "server unreachable";
    $("health").className = "pill bad";
  }
  state.poll = setTimeout(pollStats, 1000);
}

$("composer").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const text = $("prompt").value;
  $("prompt").value = "";
  send(text);
});
$("prompt").addEventListener("keydown", (ev) => {
  if (ev.key === "Enter" && !ev.shiftKey) {
    ev.preventDefault();
    $("composer").requestSubmit();
  }
});
$("stop").addEventListener("click", () => state.abort && state.abort.abort());
$("new-chat").addEventListener("click", () => {
  if (state.busy) return;
  state.history = [];
  $("messages").replaceChildren();
});
$("api-key").value = localStorage.getItem("tessera-api-key") || "";
function useKey() {
  localStorage.setItem("tessera-api-key", $("api-key").value);
  state.model = null;
  pollStats();
}
$("api-key").addEventListener("change", useKey);
$("api-key").addEventListener("keydown", (ev) => { if (ev.key === "Enter") { ev.preventDefault(); useKey(); } });
$("key-save").addEventListener("click", useKey);
pollStats();
