// The chat page: settings, conversation state, composer (keys, attachments), and rendering of WS events.
import { Connection } from "./connection.js";
import { renderMarkdown } from "./markdown.js";
import { thumbnail, uploadFile } from "./upload.js";

const $ = (id) => document.getElementById(id);
const log = $("log"), input = $("input"), pendingBox = $("pending"), statusEl = $("status");
const sendBtn = $("send"), stopBtn = $("stop");

// ---- settings (localStorage) ----
const DEFAULTS = { system: "", temperature: "0.7", top_p: "0.95", max_tokens: "512", api_key: "" };
const FIELDS = { system: "set-system", temperature: "set-temperature", top_p: "set-top-p",
  max_tokens: "set-max-tokens", api_key: "set-api-key" };
const settings = { ...DEFAULTS };
for (const [name, id] of Object.entries(FIELDS)) {
  const stored = localStorage.getItem(`mmserve.${name}`);
  if (stored !== null) settings[name] = stored;
  $(id).value = settings[name];
  $(id).addEventListener("input", () => {
    settings[name] = $(id).value;
    localStorage.setItem(`mmserve.${name}`, settings[name]);
  });
  if (name === "api_key") $(id).addEventListener("change", () => { conn.reconnect(); loadModel(); });
}
function num(name, parse) {
  const v = parse(settings[name]);
  return Number.isFinite(v) ? v : parse(DEFAULTS[name]);
}
function authHeaders() {
  return settings.api_key ? { Authorization: `Bearer ${settings.api_key}` } : {};
}

async function loadModel() {
  try {
    const res = await fetch("/v1/models", { headers: authHeaders() });
    const body = await res.json();
    $("model").textContent = res.ok ? body.data.map((m) => m.id).join(", ") : body?.error?.message || "";
  } catch { /* shown by the socket status */ }
}

// ---- conversation ----
let history = [];   // chat messages sent with each response.create
let current = null; // {id, el, body, text} of the reply in progress
let counter = 0;
let attachments = []; // {file, kind, el, thumb, state: uploading|ready|error, id}
let conn = null;

function message(role, cls = "") {
  const div = document.createElement("div");
  div.className = `msg ${role} ${cls}`.trim();
  const body = document.createElement("div");
  body.className = "body";
  div.append(body);
  log.append(div);
  return { el: div, body };
}
function scrollDown() { log.scrollTop = log.scrollHeight; }

function setBusy(busy) {
  sendBtn.hidden = busy;
  stopBtn.hidden = !busy;
  updateSend();
}
function updateSend() {
  const uploading = attachments.some((a) => a.state === "uploading");
  sendBtn.disabled = uploading || !conn?.ready;
}

function send() {
  if (current || sendBtn.disabled) return;
  const text = input.value.trim();
  const ready = attachments.filter((a) => a.state === "ready");
  if (!text && !ready.length) return;
  const content = ready.map((a) => (a.kind === "video"
    ? { type: "video_url", video_url: { url: a.id } }
    : { type: "image_url", image_url: { url: a.id } }));
  if (text) content.push({ type: "text", text });
  const userMsg = { role: "user", content: ready.length ? content : text };

  const view = message("user");
  if (ready.length) {
    const box = document.createElement("div");
    box.className = "attachments";
    for (const a of ready) box.append(a.thumb);
    view.el.prepend(box);
  }
  renderMarkdown(text, view.body);
  view.el.dataset.raw = text;
  for (const a of attachments) a.el.remove();
  attachments = [];
  input.value = "";
  autosize();

  history.push(userMsg);
  const messages = settings.system.trim() ? [{ role: "system", content: settings.system }, ...history] : history;
  const id = `r${Date.now().toString(36)}_${counter++}`;
  const reply = message("assistant", "streaming");
  current = { id, ...reply, text: "" };
  const ok = conn.send({
    type: "response.create",
    response: {
      id, messages,
      temperature: num("temperature", parseFloat),
      top_p: num("top_p", parseFloat),
      max_tokens: num("max_tokens", (v) => parseInt(v, 10)),
    },
  });
  if (!ok) finish("failed", "not connected");
  else setBusy(true);
  scrollDown();
}

function stop() {
  if (current) conn.send({ type: "response.cancel", response_id: current.id });
}

let renderQueued = false;
function renderCurrent() {
  renderQueued = false;
  if (current) { renderMarkdown(current.text, current.body); scrollDown(); }
}

function finish(status, detail, response) {
  const c = current;
  if (!c) return;
  current = null;
  if (response?.output_text !== undefined) c.text = response.output_text;
  renderMarkdown(c.text, c.body);
  c.el.classList.remove("streaming");
  c.el.dataset.status = status;
  c.el.dataset.raw = c.text;
  const meta = document.createElement("div");
  meta.className = "meta";
  const parts = [];
  const m = response?.metrics, u = response?.usage;
  if (m?.ttft_ms != null) parts.push(`TTFT ${Math.round(m.ttft_ms)} ms`);
  if (m?.tokens_per_s != null) parts.push(`${m.tokens_per_s.toFixed(1)} tok/s`);
  if (u) parts.push(`${u.prompt_tokens} prompt + ${u.completion_tokens} completion tokens`);
  meta.textContent = parts.join(" · ");
  if (status !== "completed") {
    const label = { cancelled: "stopped", incomplete: "max tokens", failed: "failed" }[status] || status;
    c.el.classList.add(status === "cancelled" ? "stopped" : status);
    const tag = document.createElement("span");
    tag.className = "tag";
    tag.textContent = detail ? `${label}: ${detail}` : label;
    meta.append(tag);
  }
  c.el.append(meta);
  if (status !== "failed" || c.text) history.push({ role: "assistant", content: c.text });
  setBusy(false);
  scrollDown();
}

function onEvent(ev) {
  if (ev.type === "connection.lost") { if (current) finish("failed", "connection lost"); return; }
  if (ev.type === "response.output_text.delta" && current && ev.response_id === current.id) {
    current.text += ev.delta;
    if (!renderQueued) { renderQueued = true; requestAnimationFrame(renderCurrent); }
  } else if (ev.type === "response.done" && current && ev.response.id === current.id) {
    finish(ev.response.status, ev.response.error?.message, ev.response);
  } else if (ev.type === "error") {
    if (current && (!ev.response_id || ev.response_id === current.id) && ev.error?.message) {
      current.error = ev.error.message;
      if (!ev.response_id) finish("failed", ev.error.message);
    }
  }
}

const STATUS_TEXT = { connecting: "connecting…", connected: "connected", reconnecting: "disconnected" };
function onState(state, detail) {
  statusEl.dataset.state = state;
  statusEl.textContent = detail ? `${STATUS_TEXT[state]} · ${detail}` : STATUS_TEXT[state];
  if (state === "connected") loadModel();
  updateSend();
}

conn = new Connection({ apiKey: () => settings.api_key, onEvent, onState });

// ---- attachments ----

function addFiles(files) {
  for (const file of files) {
    const kind = file.type.startsWith("video/") ? "video" : "image";
    const el = document.createElement("div");
    el.className = "att";
    el.dataset.state = "uploading";
    const thumb = thumbnail(file);
    const name = document.createElement("span");
    name.className = "name";
    name.textContent = file.name || kind;
    const bar = document.createElement("progress");
    bar.max = 1;
    bar.value = 0;
    const remove = document.createElement("button");
    remove.type = "button";
    remove.className = "remove";
    remove.textContent = "×";
    remove.title = "Remove";
    const att = { file, kind, el, thumb, state: "uploading", id: null };
    remove.onclick = () => { el.remove(); attachments = attachments.filter((a) => a !== att); updateSend(); };
    el.append(thumb, name, bar, remove);
    pendingBox.append(el);
    attachments.push(att);
    updateSend();
    uploadFile(file, settings.api_key, (f) => { bar.value = f; })
      .then((obj) => {
        att.state = "ready";
        att.id = obj.id;
        att.kind = obj.media_type === "video" ? "video" : "image";
        bar.remove();
      })
      .catch((err) => {
        // Refused (not an image or video, too big...) or not sent: say why, in place of the thumbnail.
        att.state = "error";
        bar.remove();
        thumb.remove();
        const msg = document.createElement("span");
        msg.className = "error";
        msg.setAttribute("role", "alert");
        msg.textContent = `Not attached: ${err.message}`;
        el.append(msg);
      })
      .finally(() => { el.dataset.state = att.state; updateSend(); });
  }
}

$("attach").addEventListener("click", () => $("file-input").click());
$("file-input").addEventListener("change", (e) => { addFiles([...e.target.files]); e.target.value = ""; });
input.addEventListener("paste", (e) => {
  const files = [...(e.clipboardData?.files || [])];
  if (files.length) { e.preventDefault(); addFiles(files); }
});
let dragDepth = 0;
const dropHint = $("drop-hint");
document.addEventListener("dragenter", (e) => { if (e.dataTransfer?.types.includes("Files")) { dragDepth++; dropHint.hidden = false; } });
document.addEventListener("dragleave", () => { if (--dragDepth <= 0) { dragDepth = 0; dropHint.hidden = true; } });
document.addEventListener("dragover", (e) => e.preventDefault());
document.addEventListener("drop", (e) => {
  e.preventDefault();
  dragDepth = 0;
  dropHint.hidden = true;
  const files = [...(e.dataTransfer?.files || [])];
  if (files.length) addFiles(files);
});

// ---- composer ----
function autosize() { input.style.height = "auto"; input.style.height = `${input.scrollHeight}px`; }
input.addEventListener("input", autosize);
input.addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); send(); }
});
document.addEventListener("keydown", (e) => { if (e.key === "Escape") stop(); });
$("composer").addEventListener("submit", (e) => { e.preventDefault(); send(); });
stopBtn.addEventListener("click", stop);
$("new-chat").addEventListener("click", () => {
  stop();
  current = null;
  history = [];
  log.replaceChildren();
  setBusy(false);
  input.focus();
});
input.focus();
