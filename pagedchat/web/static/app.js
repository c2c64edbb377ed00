// pagedchat's chat page: a front end of the chat layer the REPL uses (the API under /api, docs/web.md).
// Every text that came from a model or a saved session is put on the page as text (textContent) or through
// markdown-it with raw HTML off: nothing in a message can run.
"use strict";

const $ = (sel, root = document) => root.querySelector(sel);
const $$ = (sel, root = document) => Array.from(root.querySelectorAll(sel));

const state = {
  info: null,            // /api/info
  key: sessionStorage.getItem("pagedchat-key") || null,
  sessions: [],
  session: null,         // the open session's view (/api/sessions/NAME)
  nodes: new Map(),      // id -> node view
  streaming: null,       // {name, columns: Map(index -> element)} while a turn streams
  fork: null,            // node ids shown as side-by-side columns (after a fork, until one is picked)
  paints: [],            // [{server_t, painted_t, chars}] per streamed delta: the page's own latency record
  timings: {},           // open_ms: the last session's open, from the click to the frame that shows it
};
window.__pagedchat = state;   // tests and curious users read the latency record and the state here

let md = null;
function markdown() {
  if (md === null) {
    md = window.markdownit({ html: false, linkify: true, breaks: false });
    const defaultLink = md.renderer.rules.link_open || ((tokens, i, opts, env, self) => self.renderToken(tokens, i, opts));
    md.renderer.rules.link_open = (tokens, i, opts, env, self) => {
      tokens[i].attrSet("target", "_blank");
      tokens[i].attrSet("rel", "noopener noreferrer nofollow");
      return defaultLink(tokens, i, opts, env, self);
    };
  }
  return md;
}

// -- the API ------------------------------------------------------------------------------------------------
class ApiError extends Error {
  constructor(status, message) { super(message); this.status = status; }
}

function headers(json) {
  const h = {};
  if (json) h["Content-Type"] = "application/json";
  if (state.key) h["Authorization"] = "Bearer " + state.key;
  return h;
}

async function api(method, path, body) {
  const res = await fetch("/api" + path, {
    method, headers: headers(body !== undefined), body: body === undefined ? undefined : JSON.stringify(body),
  });
  if (res.status === 401) { await askKey(); return api(method, path, body); }
  const text = await res.text();
  const data = text ? JSON.parse(text) : null;
  if (!res.ok) throw new ApiError(res.status, (data && data.error && data.error.message) || res.statusText);
  return data;
}

// A turn: POST, then read the server-sent events of its answer from the same response.
async function streamTurn(path, body, onEvent) {
  const res = await fetch("/api" + path, { method: "POST", headers: headers(true), body: JSON.stringify(body) });
  if (res.status === 401) { await askKey(); return streamTurn(path, body, onEvent); }
  if (!res.ok) {
    const data = await res.json().catch(() => null);
    throw new ApiError(res.status, (data && data.error && data.error.message) || res.statusText);
  }
  const reader = res.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      let event = "message", data = "";
      for (const line of block.split("\n")) {
        if (line.startsWith("event: ")) event = line.slice(7);
        else if (line.startsWith("data: ")) data += line.slice(6);
      }
      onEvent(event, data ? JSON.parse(data) : null);
    }
  }
}

function askKey() {
  return new Promise((resolve) => {
    const dialog = $("#key-dialog");
    const form = $("#key-form");
    form.onsubmit = () => {
      state.key = form.elements["api-key"].value.trim() || null;
      if (state.key) sessionStorage.setItem("pagedchat-key", state.key);
      dialog.close();
      resolve();
    };
    if (!dialog.open) dialog.showModal();
  });
}

// -- small helpers ------------------------------------------------------------------------------------------
function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "text") node.textContent = v;
    else if (k === "class") node.className = v;
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v === true ? "" : String(v));
  }
  for (const child of children) if (child) node.append(child);
  return node;
}

function notice(message, kind = "info") {
  const box = $("#notice");
  box.textContent = message || "";
  box.className = kind;
  box.hidden = !message;
}

function fail(e) {
  notice(e.message || String(e), "error");
  if (e instanceof ApiError && e.status === 409 && state.session) reloadSession(state.session.name);
}

// Reasoning between <think> and </think> is folded away, as the REPL's /think hide does.
function splitReasoning(text) {
  const open = text.indexOf("<think>"), close = text.indexOf("</think>");
  if (open < 0 && close < 0) return [null, text];
  if (close < 0) return [text.slice(open + 7), text.slice(0, open)];      // still thinking
  const start = open >= 0 && open < close ? open + 7 : 0;
  return [text.slice(start, close), (open > 0 && open < close ? text.slice(0, open) : "") + text.slice(close + 8)];
}

function fillContent(box, text) {
  const [reasoning, answer] = splitReasoning(text);
  box.replaceChildren();
  if (reasoning !== null) {
    box.append(el("details", { class: "reasoning" }, el("summary", { text: "reasoning" }),
      el("div", { class: "reasoning-text", text: reasoning })));
  }
  const body = el("div", { class: "markdown" });
  body.innerHTML = markdown().render(answer);   // html: false: every tag in the text is escaped
  box.append(body);
}

function statsLine(stats) {
  if (!stats) return null;
  const parts = [];
  if (stats.prompt_new !== undefined) parts.push(`prompt ${stats.prompt_new} new + ${stats.prompt_cached} cached`);
  if (stats.ttft_s !== null && stats.ttft_s !== undefined) parts.push(`TTFT ${(stats.ttft_s * 1000).toFixed(0)} ms`);
  if (stats.tokens_per_s) parts.push(`${stats.tokens_per_s.toFixed(1)} tok/s`);
  if (stats.completion_tokens !== undefined) parts.push(`${stats.completion_tokens} tokens`);
  if (stats.blocks_used !== undefined) parts.push(`pool ${stats.blocks_used} blocks used`);
  return el("div", { class: "stats", "data-stats": "", text: parts.join(" · ") });
}

// -- sessions -----------------------------------------------------------------------------------------------
async function loadSessions() {
  const data = await api("GET", "/sessions");
  state.sessions = data.sessions;
  renderSessions();
}

function renderSessions() {
  const nav = $("#sessions");
  nav.replaceChildren(...state.sessions.map((s) => el("a", {
    href: "#session=" + encodeURIComponent(s.name), "data-session": s.name,
    class: (state.session && state.session.name === s.name ? "current " : "") + (s.opens_here ? "" : "other-model"),
    title: s.opens_here ? `${s.messages} messages, ${s.branches} branches` : `recorded with ${s.model}`,
    onclick: (e) => { e.preventDefault(); openSession(s.name); },
  }, el("span", { class: "name", text: s.name }), el("span", { class: "muted small", text: ` ${s.messages} msg` }))));
}

const nextFrame = () => new Promise((resolve) => requestAnimationFrame(() => setTimeout(resolve, 0)));

async function openSession(name) {
  const t0 = performance.now();
  try {
    const view = await api("GET", "/sessions/" + encodeURIComponent(name));
    showSession(view);
    await nextFrame();
    state.timings.open_ms = performance.now() - t0;
    history.replaceState(null, "", "#session=" + encodeURIComponent(name));
    notice("");
  } catch (e) { fail(e); }
}

async function reloadSession(name) {
  try { showSession(await api("GET", "/sessions/" + encodeURIComponent(name))); } catch (e) { notice(e.message, "error"); }
}

async function newSession() {
  const view = await api("POST", "/sessions", {});
  state.fork = null;
  showSession(view);
  history.replaceState(null, "", "#session=" + encodeURIComponent(view.name));
  await loadSessions();
  return view;
}

function showSession(view) {
  state.session = view;
  state.nodes = new Map(view.nodes.map((n) => [n.id, n]));
  if (state.fork && !state.fork.every((id) => state.nodes.has(id))) state.fork = null;
  $("#session-title").textContent = view.name;
  document.title = view.name + " · pagedchat";
  renderMessages();
  renderOutline();
  renderSessions();
}

// -- the current branch ---------------------------------------------------------------------------------------
function siblingNav(node) {
  if (node.siblings < 2) return null;
  const parentChildren = node.parent === null ? state.session.roots : state.nodes.get(node.parent).children;
  const pos = parentChildren.indexOf(node.id);
  const go = (delta) => () => switchTo(parentChildren[(pos + delta + parentChildren.length) % parentChildren.length], true);
  return el("span", { class: "siblings" },
    el("button", { type: "button", "data-action": "prev-sibling", title: "previous version", onclick: go(-1), text: "‹" }),
    el("span", { "data-sibling-pos": "", text: `${pos + 1}/${parentChildren.length}` }),
    el("button", { type: "button", "data-action": "next-sibling", title: "next version", onclick: go(1), text: "›" }));
}

function messageElement(node) {
  const box = el("article", { class: "msg " + node.role, "data-role": node.role, "data-node-id": node.id });
  const tools = el("div", { class: "msg-tools" }, siblingNav(node));
  if (node.role === "user") {
    box.append(el("div", { class: "text", text: node.text }));
    tools.append(el("button", { type: "button", "data-action": "edit", onclick: () => startEdit(box, node), text: "Edit" }));
  } else {
    const content = el("div", { class: "content", "data-content": "" });
    fillContent(content, node.text);
    box.append(content);
    const flags = [];
    if (node.interrupted) flags.push("interrupted");
    else if (node.finish_reason === "length") flags.push("cut at max_tokens");
    if (flags.length) box.append(el("div", { class: "flag", text: flags.join(", ") }));
    box.append(statsLine(node.stats));
    tools.append(el("button", { type: "button", "data-action": "regenerate", onclick: () => regenerate(node.id), text: "Regenerate" }));
    tools.append(el("button", { type: "button", "data-action": "branch-at", onclick: () => startBranch(box, node), text: "Branch at token" }));
  }
  box.prepend(el("div", { class: "who", text: node.role === "user" ? "You" : "Assistant" }, tools));
  return box;
}

function forkColumns(ids) {
  const row = el("div", { class: "fork-columns", "data-fork": "" });
  ids.forEach((id, i) => {
    const node = state.nodes.get(id);
    const content = el("div", { class: "content", "data-content": "" });
    fillContent(content, node.text);
    row.append(el("section", { class: "variant", "data-variant": i + 1, "data-node-id": id, "data-role": "assistant" },
      el("div", { class: "who", text: `Variant ${i + 1}` },
        el("button", { type: "button", "data-action": "pick", onclick: () => pick(id), text: "Continue from this" })),
      content, node.interrupted ? el("div", { class: "flag", text: "interrupted" }) : null, statsLine(node.stats)));
  });
  return row;
}

function renderMessages() {
  const box = $("#messages");
  const s = state.session;
  const path = s.path.map((id) => state.nodes.get(id));
  const items = [];
  if (s.system) items.push(el("div", { class: "system-note muted small", text: "System: " + s.system }));
  for (const node of path) {
    if (node.role === "system") continue;
    if (state.fork && state.fork.includes(node.id)) { items.push(forkColumns(state.fork)); break; }
    items.push(messageElement(node));
  }
  if (!path.length) items.push(el("p", { class: "empty muted", text: "Send a message to start." }));
  box.replaceChildren(...items);
  box.scrollTop = box.scrollHeight;
}

// -- the outline: the whole tree, navigable with the keyboard ------------------------------------------------
function renderOutline() {
  const s = state.session;
  const onPath = new Set(s.path);
  const build = (ids) => ids.map((id) => {
    const node = state.nodes.get(id);
    const label = `#${node.id} ${node.role === "user" ? "You" : node.role === "assistant" ? "AI" : "System"}: ` +
      (node.text.replace(/\s+/g, " ").slice(0, 48) || "(empty)");
    const item = el("li", { role: "treeitem", tabindex: "-1", "data-outline-node": node.id,
      "aria-selected": onPath.has(node.id) ? "true" : "false", class: onPath.has(node.id) ? "on-path" : "" },
      el("span", { class: "label", text: label }));
    if (node.children.length) item.append(el("ul", { role: "group" }, ...build(node.children)));
    return item;
  });
  const tree = $("#outline");
  tree.replaceChildren(...build(s.roots));
  const items = $$("[role=treeitem]", tree);
  const current = items.find((i) => Number(i.dataset.outlineNode) === s.head) || items[0];
  if (current) current.tabIndex = 0;
}

function outlineKeys(e) {
  const items = $$("#outline [role=treeitem]");
  const at = items.indexOf(document.activeElement);
  if (at < 0) return;
  let next = null;
  if (e.key === "ArrowDown") next = items[Math.min(at + 1, items.length - 1)];
  else if (e.key === "ArrowUp") next = items[Math.max(at - 1, 0)];
  else if (e.key === "Home") next = items[0];
  else if (e.key === "End") next = items[items.length - 1];
  else if (e.key === "Enter" || e.key === " ") {
    e.preventDefault();
    switchTo(Number(items[at].dataset.outlineNode), true);
    return;
  } else return;
  e.preventDefault();
  items.forEach((i) => { i.tabIndex = -1; });
  next.tabIndex = 0;
  next.focus();
}

// -- changes ----------------------------------------------------------------------------------------------
function revision() { return state.session ? state.session.revision : null; }

async function change(path, body) {
  try {
    showSession(await api("POST", `/sessions/${encodeURIComponent(state.session.name)}/${path}`, { ...body, revision: revision() }));
    notice("");
  } catch (e) { fail(e); }
}

function switchTo(nodeId, descend) {
  state.fork = null;
  return change("switch", { node_id: nodeId, descend });
}

function pick(nodeId) {
  state.fork = null;
  return change("switch", { node_id: nodeId, descend: false });
}

// -- turns --------------------------------------------------------------------------------------------------
function setStreaming(on) {
  $("[data-action=stop]").hidden = !on;
  $("[data-action=send]").disabled = on;
  $("[data-action=fork]").disabled = on;
}

// Show the reply as it streams: n columns for a fork, else one assistant message after `before`.
function streamTargets(n, userText) {
  const box = $("#messages");
  $$(".empty", box).forEach((e) => e.remove());
  if (userText !== null) {
    box.append(el("article", { class: "msg user pending", "data-role": "user", "data-node-id": "" },
      el("div", { class: "who", text: "You" }), el("div", { class: "text", text: userText })));
  }
  const columns = new Map();
  if (n > 1) {
    const row = el("div", { class: "fork-columns", "data-fork": "" });
    for (let i = 0; i < n; i++) {
      const content = el("div", { class: "content", "data-content": "" });
      row.append(el("section", { class: "variant pending", "data-variant": i + 1, "data-role": "assistant", "data-node-id": "" },
        el("div", { class: "who", text: `Variant ${i + 1}` }), content));
      columns.set(i, { content, text: "" });
    }
    box.append(row);
  } else {
    const content = el("div", { class: "content", "data-content": "" });
    box.append(el("article", { class: "msg assistant pending", "data-role": "assistant", "data-node-id": "" },
      el("div", { class: "who", text: "Assistant" }), content));
    columns.set(0, { content, text: "" });
  }
  box.scrollTop = box.scrollHeight;
  return columns;
}

async function runTurn(path, body, n, userText) {
  if (state.streaming) return;
  state.streaming = { name: null, columns: new Map() };   // taken at once: a second send waits for this turn
  setStreaming(true);
  if (!state.session) {
    try { await newSession(); } catch (e) { state.streaming = null; setStreaming(false); fail(e); return; }
  }
  const name = state.session.name;
  const columns = streamTargets(n, userText);
  state.streaming = { name, columns };
  notice("");
  let dirty = new Set(), pending = [], scheduled = false;
  const paint = () => {
    scheduled = false;
    for (const i of dirty) { const c = columns.get(i); if (c) fillContent(c.content, c.text); }
    dirty = new Set();
    const box = $("#messages");
    box.scrollTop = box.scrollHeight;
    const now = performance.timeOrigin + performance.now();
    const chars = [...columns.values()].reduce((n, c) => n + c.text.length, 0);
    for (const t of pending) state.paints.push({ server_t: t * 1000, painted_t: now, chars });
    pending = [];
  };
  try {
    await streamTurn(`/sessions/${encodeURIComponent(name)}/${path}`, { ...body, revision: revision() }, (event, data) => {
      if (event === "delta") {
        const c = columns.get(data.index);
        if (!c) return;
        c.text = data.replace ? data.text : c.text + data.text;
        dirty.add(data.index);
        pending.push(data.t);
        if (!scheduled) { scheduled = true; requestAnimationFrame(paint); }
      } else if (event === "done") {
        state.fork = data.replies.length > 1 ? data.replies : null;
        showSession(data.session);
        const lines = [...data.notes];
        if (data.save_error) lines.push(data.save_error);
        notice(lines.join(" · "), data.save_error ? "error" : "info");
      } else if (event === "error") {
        notice(data.message, "error");
        reloadSession(name);
      }
    });
  } catch (e) {
    fail(e);
    reloadSession(name);
  } finally {
    state.streaming = null;
    setStreaming(false);
    loadSessions().catch(() => {});
    refreshPool();
  }
}

function send(n) {
  const box = $("textarea[name=message]");
  const text = box.value;
  if (!text.trim()) {
    if (n > 1 && state.session && state.session.head !== null) return regenerate(null, n);   // fork the last reply
    box.focus();
    return;
  }
  box.value = "";
  return runTurn("messages", { text, n }, n, text);
}

function regenerate(nodeId, n = 1) {
  state.fork = null;
  renderMessagesUpTo(nodeId === null ? null : state.nodes.get(nodeId).parent);
  return runTurn("regenerate", { node_id: nodeId, n }, n, null);
}

// Before a regeneration streams, the page shows the branch up to the message being answered.
function renderMessagesUpTo(userId) {
  const box = $("#messages");
  let cut = userId;
  if (cut === null) {
    const head = state.nodes.get(state.session.head);
    cut = head && head.role === "assistant" ? head.parent : state.session.head;
  }
  const kept = $$("#messages > [data-role], #messages > .fork-columns", box);
  let seen = false;
  for (const item of kept) {
    if (seen) item.remove();
    else if (Number(item.dataset.nodeId) === cut) seen = true;
  }
}

function startEdit(box, node) {
  if (state.streaming || $("textarea[name=edit]", box)) return;
  const text = $(".text", box);
  const area = el("textarea", { name: "edit", rows: 3 });
  area.value = node.text;
  const submit = () => {
    const value = area.value;
    if (!value.trim() || value === node.text) return cancel();
    // The edited branch replaces what follows on the page while it streams.
    let after = box.nextElementSibling;
    while (after) { const next = after.nextElementSibling; after.remove(); after = next; }
    box.remove();
    runTurn("edit", { node_id: node.id, text: value }, 1, value);
  };
  const cancel = () => { form.remove(); text.hidden = false; };
  area.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); submit(); }
    if (e.key === "Escape") cancel();
  });
  const form = el("div", { class: "edit" }, area,
    el("div", { class: "row" },
      el("button", { type: "button", "data-action": "save-edit", onclick: submit, text: "Save and answer" }),
      el("button", { type: "button", "data-action": "cancel-edit", onclick: cancel, text: "Cancel" })));
  text.hidden = true;
  text.after(form);
  area.focus();
}

function startBranch(box, node) {
  if (state.streaming || $(".branch-form", box)) return;
  const index = el("input", { name: "branch-index", type: "number", min: 0, max: node.tokens - 1, value: 0, "aria-label": "token index" });
  const token = el("input", { name: "branch-token", type: "text", placeholder: "alternative token", "aria-label": "alternative" });
  const form = el("div", { class: "branch-form row" },
    el("label", { text: `token (0-${node.tokens - 1}) ` }, index), token,
    el("button", { type: "button", "data-action": "save-branch", text: "Branch", onclick: () => {
      form.remove();
      state.fork = null;
      renderMessagesUpTo(node.parent);
      runTurn("branch", { node_id: node.id, index: Number(index.value), token: token.value }, 1, null);
    } }),
    el("button", { type: "button", text: "Cancel", onclick: () => form.remove() }));
  box.append(form);
  token.focus();
}

async function stop() {
  if (!state.streaming) return;
  try { await api("POST", `/sessions/${encodeURIComponent(state.streaming.name)}/stop`, {}); } catch (e) { fail(e); }
}

// -- the pool -----------------------------------------------------------------------------------------------
async function refreshPool() {
  let p;
  try { p = await api("GET", "/pool"); } catch (e) { return; }
  const total = p.num_blocks || 1;
  $("#pool-bar .used").style.width = (100 * (p.used - p.cached) / total).toFixed(1) + "%";
  $("#pool-bar .cached").style.width = (100 * p.cached / total).toFixed(1) + "%";
  const rows = [["blocks used", `${p.used} / ${p.num_blocks}`], ["cached (reusable)", p.cached],
    ["shared (2+ holders)", p.shared], ["prefix hit rate", (100 * p.prefix_hit_rate).toFixed(1) + "%"],
    ["preemptions", p.preemptions]];
  $("#pool-numbers").replaceChildren(...rows.flatMap(([k, v]) => [el("dt", { text: k }), el("dd", { text: String(v) })]));
  const names = Object.keys(p.sessions);
  $("#pool-sessions").replaceChildren(...names.map((name) => {
    const s = p.sessions[name];
    return el("div", { class: "pool-session", "data-pool-session": name,
      text: `${name}: ${s.blocks} blocks held by ${s.pinned_branches} branch${s.pinned_branches === 1 ? "" : "es"}, ${s.shared_blocks} shared` });
  }));
}

// -- exports, system prompt, settings ----------------------------------------------------------------------------
async function exportSession(format) {
  if (!state.session) return;
  const res = await fetch(`/api/sessions/${encodeURIComponent(state.session.name)}/export?format=${format}`, { headers: headers(false) });
  if (!res.ok) { notice("export failed: " + res.statusText, "error"); return; }
  const blob = await res.blob();
  const link = el("a", { href: URL.createObjectURL(blob), download: `${state.session.name}.${format === "json" ? "json" : "md"}` });
  document.body.append(link);
  link.click();
  link.remove();
  setTimeout(() => URL.revokeObjectURL(link.href), 10000);
}

function openDialog(id) {
  const dialog = $(id);
  const form = $("form", dialog);
  if (id === "#system-dialog") form.elements["system"].value = (state.session && state.session.system) || "";
  if (id === "#settings-dialog") {
    for (const k of ["temperature", "max_tokens", "top_p"]) {
      const v = state.session ? state.session.settings[k] : undefined;
      form.elements[k].value = v === undefined ? "" : v;
    }
  }
  dialog.showModal();
}

async function saveSystem() {
  if (!state.session) await newSession();
  const text = $("#system-form").elements["system"].value;
  await change("system", { text: text.trim() ? text : null });
}

async function saveSettings() {
  if (!state.session) await newSession();
  const form = $("#settings-form");
  for (const k of ["temperature", "max_tokens", "top_p"]) {
    const value = form.elements[k].value.trim();
    const old = state.session.settings[k];
    if (value !== "" && String(old) !== value) await change("settings", { key: k, value });
  }
}

// -- start --------------------------------------------------------------------------------------------------
function wire() {
  $("#composer").addEventListener("submit", (e) => { e.preventDefault(); send(1); });
  $("textarea[name=message]").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); send(1); }
  });
  $("[data-action=fork]").addEventListener("click", () => {
    const n = Math.max(2, Math.min(state.info ? state.info.max_fork : 8, Number($("input[name=fork-n]").value) || 2));
    send(n);
  });
  $("[data-action=stop]").addEventListener("click", stop);
  $("[data-action=new-session]").addEventListener("click", () => newSession().catch(fail));
  $("[data-action=export-markdown]").addEventListener("click", () => exportSession("markdown"));
  $("[data-action=export-json]").addEventListener("click", () => exportSession("json"));
  $("[data-action=system]").addEventListener("click", () => openDialog("#system-dialog"));
  $("[data-action=settings]").addEventListener("click", () => openDialog("#settings-dialog"));
  $("#system-form").addEventListener("submit", () => { saveSystem().catch(fail); });
  $("#settings-form").addEventListener("submit", () => { saveSettings().catch(fail); });
  $$("[data-action=close-dialog]").forEach((b) => b.addEventListener("click", () => b.closest("dialog").close()));
  $("#outline").addEventListener("keydown", outlineKeys);
  $("#outline").addEventListener("click", (e) => {
    const item = e.target.closest("[role=treeitem]");
    if (item) switchTo(Number(item.dataset.outlineNode), true);
  });
  document.addEventListener("visibilitychange", () => { if (!document.hidden) refreshPool(); });
  setInterval(() => { if (!document.hidden) refreshPool(); }, 2000);
}

async function start() {
  wire();
  try {
    state.info = await api("GET", "/info");
    $("#model-name").textContent = state.info.model;
    await loadSessions();
    const wanted = decodeURIComponent((location.hash.match(/session=([^&]+)/) || [])[1] || "");
    const first = wanted || (state.sessions.find((s) => s.opens_here) || {}).name;
    if (first) await openSession(first);
    refreshPool();
  } catch (e) { fail(e); }
  document.documentElement.dataset.ready = "true";
}

document.addEventListener("DOMContentLoaded", start);
