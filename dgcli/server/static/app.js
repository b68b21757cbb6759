// dg serve's page: a chat whose answers show their canvas as the server denoises it. The answer
// streams from /v1/chat/completions with dg_steps: every denoising step brings the canvas
// (dg_step: the argmax tokens, which were accepted this step, their text, the temperature, the
// mean entropy); every committed canvas brings its text as a content delta.
"use strict";

const MAX_PIECE_CHARS = 16;
const $ = (id) => document.getElementById(id);
const state = { model: null, messages: [], busy: false, endIds: new Set(), padId: null };

async function init() {
  const saved = sessionStorage.getItem("dg-api-key");
  if (saved) $("api-key").value = saved;
  try {
    const health = await (await fetch("/health")).json();
    state.model = health.model;
    state.endIds = new Set(health.end_token_ids || []);
    state.padId = health.pad_token_id ?? null;
    $("model").textContent = `${health.model} · canvas ${health.canvas_length} · ${health.slots.total} slots`;
    if (health.auth) $("key-row").hidden = false;
  } catch (err) {
    $("model").textContent = "the server does not answer";
  }
  $("ask").addEventListener("submit", onSubmit);
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey) {
      event.preventDefault();
      $("ask").requestSubmit();
    }
  });
}

function addMessage(kind, text) {
  const box = document.createElement("div");
  box.className = `msg ${kind}`;
  if (text) box.textContent = text;
  $("log").append(box);
  box.scrollIntoView({ block: "end" });
  return box;
}

async function onSubmit(event) {
  event.preventDefault();
  const prompt = $("prompt").value.trim();
  if (state.busy || !prompt) return;
  $("prompt").value = "";
  addMessage("user", prompt);
  state.messages.push({ role: "user", content: prompt });
  const view = new AnswerView(addMessage("model"));
  state.busy = true;
  $("send").disabled = true;
  try {
    const answer = await ask(view);
    state.messages.push({ role: "assistant", content: answer });
  } catch (err) {
    view.fail(err.message);
    state.messages.pop();
  } finally {
    state.busy = false;
    $("send").disabled = false;
    $("prompt").focus();
  }
}

async function ask(view) {
  const body = { model: state.model, messages: state.messages, stream: true, dg_steps: true };
  const steps = parseInt($("steps").value, 10);
  if (steps > 0) body.steps = steps;
  const headers = { "Content-Type": "application/json" };
  const key = $("api-key").value.trim();
  if (key) {
    headers.Authorization = `Bearer ${key}`;
    sessionStorage.setItem("dg-api-key", key);
  }
  const response = await fetch("/v1/chat/completions", { method: "POST", headers, body: JSON.stringify(body) });
  if (!response.ok) {
    let message = response.statusText;
    try { message = (await response.json()).error.message; } catch (err) { /* not JSON */ }
    if (response.status === 401) $("key-row").hidden = false;
    throw new Error(`${response.status}: ${message}`);
  }
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return view.finish();
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(chunk.error.message);
        view.update(chunk);
      }
    }
  }
  return view.finish();
}

function visiblePiece(piece) {
  if (piece === "") return "·";
  const shown = piece.replace(/\n/g, "↵").replace(/\t/g, "→");
  return shown.length > MAX_PIECE_CHARS ? `${shown.slice(0, MAX_PIECE_CHARS - 1)}…` : shown;
}

class AnswerView {
  constructor(box) {
    this.box = box;
    this.status = this.part("div", "status", "waiting for a slot…");
    this.canvas = this.part("div", "canvas");
    this.thinking = this.part("div", "thinking");
    this.text = this.part("div", "text");
    this.content = "";
    this.reasoning = "";
    this.steps = 0;
  }

  part(tag, cls, text) {
    const el = document.createElement(tag);
    el.className = cls;
    if (text) el.textContent = text;
    this.box.append(el);
    return el;
  }

  update(chunk) {
    if (chunk.dg_step) this.step(chunk.dg_step);
    for (const choice of chunk.choices || []) {
      const delta = choice.delta || {};
      if (delta.reasoning_content) {
        this.reasoning += delta.reasoning_content;
        this.thinking.textContent = this.reasoning;
      }
      if (delta.content) {
        this.content += delta.content;
        this.text.textContent = this.content;
      }
    }
  }

  step(s) {
    this.steps += 1;
    const spans = [];
    let ended = false;
    s.argmax_canvas.forEach((token, i) => {
      const span = document.createElement("span");
      if (state.endIds.has(token)) ended = true;
      if (ended || token === state.padId) {
        span.className = "tok end";
        span.textContent = state.endIds.has(token) ? "⟨end⟩" : "▪";
      } else {
        span.className = s.accepted[i] ? "tok acc" : "tok noisy";
        span.textContent = visiblePiece(s.pieces[i]);
      }
      spans.push(span);
    });
    this.canvas.replaceChildren(...spans);
    this.canvas.dataset.canvas = s.canvas;
    this.canvas.dataset.step = s.step;
    this.canvas.dataset.accepted = s.n_accepted;
    this.status.textContent = `canvas ${s.canvas + 1} · step ${s.step}/${s.max_steps} · ` +
      `t ${s.temperature.toFixed(3)} · mean entropy ${s.mean_entropy.toFixed(3)} · ` +
      `${s.n_accepted}/${s.argmax_canvas.length} accepted`;
    this.box.scrollIntoView({ block: "end" });
  }

  finish() {
    this.canvas.classList.add("done");
    this.status.textContent = `${this.steps} denoising step${this.steps === 1 ? "" : "s"}`;
    this.box.dataset.done = "1";
    return this.content;
  }

  fail(message) {
    this.canvas.classList.add("done");
    this.status.textContent = "";
    const error = this.part("div", "error", message);
    this.box.dataset.done = "error";
    return error;
  }
}

document.addEventListener("DOMContentLoaded", init);
