// The Paphos web page (issue #22): chat and story modes over the public OpenAI routes
// (/v1/models, /v1/chat/completions, /v1/completions), with every sampler of docs/api.md §4.
// Settings, presets and the session live in localStorage. No dependencies, no build step: the
// server inlines this module into the page at `/`.

const STORE = { settings: "paphos.web.settings", presets: "paphos.web.presets", session: "paphos.web.session" };
// Settings that belong to this browser, not to a preset.
const LOCAL_KEYS = new Set(["api-key", "theme"]);

// The sampler stages of docs/api.md §4.2, in the server's default order.
const STAGES = {
  dry: "DRY", penalties: "Penalties", no_repeat_ngram: "No-repeat n-gram", temperature: "Temperature",
  top_nsigma: "Top-nσ", top_p_top_k: "Top-k, top-p", top_a: "Top-a", min_p: "Min-p", tfs: "Tail-free",
  eta_cutoff: "η cutoff", epsilon_cutoff: "ε cutoff", typical_p: "Typical-p", quadratic: "Smoothing", xtc: "XTC",
};
const DEFAULT_ORDER = Object.keys(STAGES);

// The fields of the sampler panel (docs/api.md §4.3), by group. `def` is the server's default: a
// field still at its default is not sent, except the `always` ones; `send: false` is for the page.
const num = (key, label, def, opts = {}) => ({ kind: "number", key, label, def, step: 0.01, ...opts });
const int = (key, label, def, opts = {}) => num(key, label, def, { step: 1, int: true, ...opts });
const bool = (key, label) => ({ kind: "bool", key, label, def: false });
const GROUPS = [
  ["Length and display", true, [
    int("max_tokens", "Max new tokens", 256, { min: 1, always: true }),
    int("min_tokens", "Min new tokens", 0, { min: 0 }),
    int("seed", "Seed (empty: random)", ""),
    int("top_logprobs", "Alternatives shown on hover (0: off)", 5, { min: 0, max: 20, send: false }),
  ]],
  ["Temperature", true, [
    num("temperature", "Temperature", 1, { min: 0, step: 0.05, always: true }),
    bool("temperature_last", "Temperature last"),
    num("dynatemp_min", "Dynamic temperature min", 0, { min: 0, step: 0.05 }),
    num("dynatemp_max", "Dynamic temperature max", 0, { min: 0, step: 0.05 }),
    num("dynatemp_exponent", "Dynamic temperature exponent", 1, { min: 0, step: 0.1 }),
  ]],
  ["Truncation", true, [
    int("top_k", "Top-k", 0, { min: -1 }),
    num("top_p", "Top-p", 1, { min: 0, max: 1 }),
    num("min_p", "Min-p", 0, { min: 0, max: 1 }),
    num("top_a", "Top-a", 0, { min: 0 }),
    num("tfs", "Tail-free (tfs)", 1, { min: 0, max: 1 }),
    num("typical_p", "Typical-p", 1, { min: 0, max: 1 }),
    num("nsigma", "Top-nσ (nsigma)", 0, { min: 0, step: 0.1 }),
    num("eta_cutoff", "η cutoff (×1e-4)", 0, { min: 0, step: 1 }),
    num("epsilon_cutoff", "ε cutoff (×1e-4)", 0, { min: 0, max: 10000, step: 1 }),
  ]],
  ["Smoothing and skew", false, [
    num("smoothing_factor", "Smoothing factor", 0, { min: 0, step: 0.05 }),
    num("smoothing_curve", "Smoothing curve", 1, { min: 1, step: 0.1 }),
    num("skew", "Skew", 0, { step: 0.1 }),
  ]],
  ["Penalties", false, [
    num("repetition_penalty", "Repetition penalty", 1, { min: 0 }),
    int("repetition_penalty_range", "Repetition penalty range (0: all)", 0, { min: -1 }),
    num("rep_pen_slope", "Repetition penalty slope", 1, { min: 0, max: 1 }),
    num("frequency_penalty", "Frequency penalty", 0, { min: -2, max: 2 }),
    num("presence_penalty", "Presence penalty", 0, { min: -2, max: 2 }),
    int("no_repeat_ngram_size", "No-repeat n-gram size", 0, { min: 0 }),
  ]],
  ["DRY", false, [
    num("dry_multiplier", "DRY multiplier (0: off)", 0, { min: 0, step: 0.05 }),
    num("dry_base", "DRY base", 1.75, { min: 1, step: 0.05 }),
    int("dry_allowed_length", "DRY allowed length", 2, { min: 1 }),
    int("dry_range", "DRY range (0: all)", 0, { min: -1 }),
    { kind: "json", key: "dry_sequence_breakers", label: "DRY sequence breakers (JSON list)", def: '["\\n", ":", "\\"", "*"]' },
  ]],
  ["XTC", false, [
    num("xtc_threshold", "XTC threshold", 0.1, { min: 0, max: 1 }),
    num("xtc_probability", "XTC probability (0: off)", 0, { min: 0, max: 1 }),
  ]],
  ["Mirostat", false, [
    { kind: "select", key: "mirostat_mode", label: "Mirostat", def: "0", int: true,
      options: [["0", "Off"], ["1", "Mirostat 1"], ["2", "Mirostat 2"]] },
    num("mirostat_tau", "Mirostat τ", 5, { min: 0, step: 0.1 }),
    num("mirostat_eta", "Mirostat η", 0.1, { min: 0 }),
  ]],
  ["Stop strings and bans", false, [
    { kind: "lines", key: "stop", label: "Stop strings (one a line; \\n is a newline)", def: "" },
    { kind: "lines", key: "banned_strings", label: "Banned strings (one a line)", def: "" },
    bool("banned_strings_case_sensitive", "Banned strings are case-sensitive"),
    bool("ban_eos_token", "Ban the end-of-text token"),
  ]],
];
const FIELDS = GROUPS.flatMap(([, , fields]) => fields);

const $ = (selector) => document.querySelector(selector);
const tokenInfo = new WeakMap(); // token <span> -> its logprob entries
const state = { mode: "chat", order: [...DEFAULT_ORDER], messages: [], storyMark: null, controller: null, model: null };

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

function button(label, onClick, ariaLabel) {
  const node = el("button", "", label);
  node.type = "button";
  if (ariaLabel) node.setAttribute("aria-label", ariaLabel);
  node.addEventListener("click", onClick);
  return node;
}

// ---- errors ------------------------------------------------------------------------------------

function showError(message) {
  $("#error-text").textContent = message;
  $("#error").hidden = false;
}

function hideError() {
  $("#error").hidden = true;
}

async function httpError(res) {
  let detail = res.statusText;
  try {
    const body = await res.json();
    detail = body.error?.message ?? (typeof body.error === "string" ? body.error : body.message) ?? detail;
  } catch { /* not JSON */ }
  const hint = res.status === 401 ? " — this server needs an API key: enter it under Settings, Connection." : "";
  return new Error(`${res.status} ${detail}${hint}`);
}

// ---- the sampler panel -------------------------------------------------------------------------

function fieldControl(field) {
  const id = `f-${field.key}`;
  const wrap = el("div", field.kind === "bool" ? "field check" : "field");
  const label = el("label", "", field.label);
  label.htmlFor = id;
  let control;
  if (field.kind === "bool") {
    control = el("input");
    control.type = "checkbox";
    control.defaultChecked = false;
  } else if (field.kind === "select") {
    control = el("select");
    for (const [value, text] of field.options) {
      const option = el("option", "", text);
      option.value = value;
      option.defaultSelected = value === field.def;
      control.append(option);
    }
  } else if (field.kind === "number") {
    control = el("input");
    control.type = "number";
    control.inputMode = "decimal";
    control.step = field.step;
    if (field.min !== undefined) control.min = field.min;
    if (field.max !== undefined) control.max = field.max;
    control.defaultValue = String(field.def);
  } else {
    control = el("textarea");
    control.rows = 3;
    control.spellcheck = false;
    control.defaultValue = field.def;
    wrap.classList.add("wide");
  }
  control.id = id;
  control.dataset.key = field.key;
  if (field.kind === "bool") wrap.append(control, label);
  else wrap.append(label, control);
  return wrap;
}

function buildPanel() {
  const box = $("#sampler-groups");
  for (const [title, open, fields] of GROUPS) {
    const group = el("details");
    group.open = open;
    group.append(el("summary", "", title), ...fields.map(fieldControl));
    box.append(group);
  }
}

function unescapeLine(line) {
  return line.replace(/\\([nt\\])/g, (_, c) => ({ n: "\n", t: "\t", "\\": "\\" })[c]);
}

// The value a field puts in a request; undefined when it is not sent. Throws on a bad entry.
function fieldValue(field) {
  const control = document.getElementById(`f-${field.key}`);
  if (field.kind === "bool") return control.checked || undefined;
  if (field.kind === "lines") {
    const lines = control.value.split("\n").filter((line) => line !== "").map(unescapeLine);
    return lines.length ? lines : undefined;
  }
  if (field.kind === "json") {
    if (control.value.trim() === field.def || control.value.trim() === "") return undefined;
    try {
      return JSON.parse(control.value);
    } catch {
      throw new Error(`${field.label}: not valid JSON`);
    }
  }
  const text = control.value.trim();
  if (text === "") return undefined;
  const value = Number(text);
  if (!Number.isFinite(value)) throw new Error(`${field.label}: not a number`);
  if (!field.always && field.def !== "" && value === Number(field.def)) return undefined;
  return field.int ? Math.trunc(value) : value;
}

function structuredFields() {
  const kind = $("#f-structured").value;
  const text = $("#f-structured-text").value;
  if (kind === "none") return {};
  if (kind === "json_object") return { response_format: { type: "json_object" } };
  if (!text.trim()) throw new Error("Structured output: the schema, grammar or regex is empty");
  if (kind === "grammar") return { guided_grammar: text };
  if (kind === "regex") return { guided_regex: text };
  try {
    return { guided_json: JSON.parse(text) };
  } catch {
    throw new Error("Structured output: the JSON schema is not valid JSON");
  }
}

// Every sampler field the panel sets, as the request fields of docs/api.md §4.3.
function samplerFields() {
  const body = {};
  for (const field of FIELDS) {
    if (field.send === false) continue;
    const value = fieldValue(field);
    if (value !== undefined) body[field.key] = value;
  }
  if (state.order.join() !== DEFAULT_ORDER.join()) body.sampler_priority = [...state.order];
  if (state.model) body.model = state.model;
  return { ...body, ...structuredFields() };
}

function topLogprobs() {
  return fieldValue(FIELDS.find((field) => field.key === "top_logprobs")) ?? 5;
}

// ---- sampler order: drag the handle, or the up / down buttons ----------------------------------

function renderOrder(focus) {
  const list = $("#order");
  list.replaceChildren();
  state.order.forEach((stage, i) => {
    const item = el("li");
    item.dataset.stage = stage;
    const handle = el("span", "handle", "⠿");
    handle.title = "Drag to reorder";
    handle.setAttribute("aria-hidden", "true");
    const up = button("↑", () => moveStage(stage, -1), `Move ${STAGES[stage]} up`);
    const down = button("↓", () => moveStage(stage, 1), `Move ${STAGES[stage]} down`);
    up.dataset.move = "up";
    down.dataset.move = "down";
    up.disabled = i === 0;
    down.disabled = i === state.order.length - 1;
    item.append(handle, el("span", "stage", STAGES[stage]), up, down);
    list.append(item);
  });
  const custom = state.order.join() !== DEFAULT_ORDER.join();
  $("#order-note").textContent = custom
    ? "Custom order, sent as sampler_priority."
    : "The server's default order (not sent). Drag a stage, or use its arrows.";
  if (focus) {
    const item = list.querySelector(`li[data-stage="${focus.stage}"]`);
    const target = item.querySelector(`[data-move="${focus.move}"]`);
    (target.disabled ? item.querySelector("button:not([disabled])") : target).focus();
  }
}

function moveStage(stage, delta) {
  const i = state.order.indexOf(stage);
  const j = i + delta;
  if (j < 0 || j >= state.order.length) return;
  [state.order[i], state.order[j]] = [state.order[j], state.order[i]];
  renderOrder({ stage, move: delta < 0 ? "up" : "down" });
  saveSettings();
}

function setupDrag() {
  const list = $("#order");
  list.addEventListener("pointerdown", (event) => {
    const handle = event.target.closest(".handle");
    if (!handle) return;
    event.preventDefault();
    const item = handle.closest("li");
    item.classList.add("dragging");
    handle.setPointerCapture(event.pointerId);
    const move = (ev) => {
      const over = document.elementFromPoint(ev.clientX, ev.clientY)?.closest("#order li");
      if (!over || over === item) return;
      const box = over.getBoundingClientRect();
      list.insertBefore(item, ev.clientY < box.top + box.height / 2 ? over : over.nextSibling);
    };
    const end = () => {
      handle.removeEventListener("pointermove", move);
      handle.removeEventListener("pointerup", end);
      handle.removeEventListener("pointercancel", end);
      state.order = [...list.children].map((li) => li.dataset.stage);
      renderOrder();
      saveSettings();
    };
    handle.addEventListener("pointermove", move);
    handle.addEventListener("pointerup", end);
    handle.addEventListener("pointercancel", end);
  });
}

// ---- settings, presets, session ----------------------------------------------------------------

const controls = () => document.querySelectorAll("[data-key]");
const read = (control) => (control.type === "checkbox" ? control.checked : control.value);

function write(control, value) {
  if (control.type === "checkbox") control.checked = Boolean(value);
  else control.value = value;
}

function defaultOf(control) {
  if (control.type === "checkbox") return control.defaultChecked;
  if (control.tagName === "SELECT") {
    return ([...control.options].find((option) => option.defaultSelected) ?? control.options[0]).value;
  }
  return control.defaultValue;
}

function snapshot(withLocal) {
  const values = {};
  for (const control of controls()) {
    if (withLocal || !LOCAL_KEYS.has(control.dataset.key)) values[control.dataset.key] = read(control);
  }
  return { values, order: [...state.order] };
}

// Sets every non-local control from `snap` (a default where it has no value), or every control.
function applySnapshot(snap, withLocal) {
  for (const control of controls()) {
    const key = control.dataset.key;
    if (!withLocal && LOCAL_KEYS.has(key)) continue;
    write(control, key in snap.values ? snap.values[key] : defaultOf(control));
  }
  const known = Array.isArray(snap.order) && snap.order.length === DEFAULT_ORDER.length
    && DEFAULT_ORDER.every((stage) => snap.order.includes(stage));
  state.order = known ? [...snap.order] : [...DEFAULT_ORDER];
  renderOrder();
  applyTheme();
}

function loadJSON(key, fallback) {
  try {
    return JSON.parse(localStorage.getItem(key)) ?? fallback;
  } catch {
    return fallback;
  }
}

function saveSettings() {
  localStorage.setItem(STORE.settings, JSON.stringify({ ...snapshot(true), mode: state.mode }));
}

function saveSession() {
  localStorage.setItem(STORE.session, JSON.stringify({ messages: state.messages, story: $("#story").value }));
}

function renderPresets(selected) {
  const presets = loadJSON(STORE.presets, {});
  const list = $("#preset-list");
  list.replaceChildren(...Object.keys(presets).sort().map((name) => {
    const option = el("option", "", name);
    option.value = name;
    return option;
  }));
  if (selected) list.value = selected;
}

function setupPresets() {
  $("#preset-save").addEventListener("click", () => {
    const name = $("#preset-name").value.trim();
    if (!name) return showError("Give the preset a name first.");
    const presets = loadJSON(STORE.presets, {});
    presets[name] = snapshot(false);
    localStorage.setItem(STORE.presets, JSON.stringify(presets));
    $("#preset-name").value = "";
    renderPresets(name);
  });
  $("#preset-load").addEventListener("click", () => {
    const preset = loadJSON(STORE.presets, {})[$("#preset-list").value];
    if (!preset) return;
    applySnapshot(preset, false);
    saveSettings();
  });
  $("#preset-delete").addEventListener("click", () => {
    const presets = loadJSON(STORE.presets, {});
    delete presets[$("#preset-list").value];
    localStorage.setItem(STORE.presets, JSON.stringify(presets));
    renderPresets();
  });
  $("#reset").addEventListener("click", () => {
    applySnapshot({ values: {}, order: DEFAULT_ORDER }, false);
    saveSettings();
  });
  $("#order-reset").addEventListener("click", () => {
    state.order = [...DEFAULT_ORDER];
    renderOrder();
    saveSettings();
  });
}

// ---- theme, mode, layout -----------------------------------------------------------------------

function isDark() {
  const theme = $("#theme").value;
  return theme === "dark" || (theme === "auto" && matchMedia("(prefers-color-scheme: dark)").matches);
}

// The page's one dark palette is keyed on data-theme="dark": "auto" resolves here, and again when
// the system's preference changes.
function applyTheme() {
  document.documentElement.dataset.theme = isDark() ? "dark" : "light";
}
matchMedia("(prefers-color-scheme: dark)").addEventListener("change", applyTheme);

function setMode(mode) {
  state.mode = mode === "story" ? "story" : "chat";
  for (const tab of document.querySelectorAll("[role=tab]")) {
    tab.setAttribute("aria-selected", String(tab.dataset.mode === state.mode));
  }
  $("#chat").hidden = state.mode !== "chat";
  $("#story-pane").hidden = state.mode !== "story";
}

function setSettingsOpen(open) {
  document.body.classList.toggle("settings-open", open);
  $("#settings-toggle").setAttribute("aria-expanded", String(open));
}

function setBusy(busy) {
  document.body.classList.toggle("busy", busy);
  $("#send").hidden = busy;
  $("#stop").hidden = !busy;
  $("#generate").hidden = busy;
  $("#story-stop").hidden = !busy;
  for (const node of document.querySelectorAll(".msg .actions button, #retry, #undo, #new-chat, [role=tab]")) {
    node.disabled = busy;
  }
  $("#messages").setAttribute("aria-busy", String(busy));
}

// ---- token spans and their alternatives --------------------------------------------------------

// The logprob entries of one streamed choice: [{token, logprob, top: [[token, logprob], …]}].
function logprobsOf(choice) {
  const lp = choice.logprobs;
  if (!lp) return null;
  if (Array.isArray(lp.content)) {
    return lp.content.map((entry) => ({
      token: entry.token, logprob: entry.logprob,
      top: (entry.top_logprobs ?? []).map((alt) => [alt.token, alt.logprob]),
    }));
  }
  if (Array.isArray(lp.tokens)) {
    return lp.tokens.map((token, i) => ({
      token, logprob: lp.token_logprobs?.[i],
      top: Object.entries(lp.top_logprobs?.[i] ?? {}).sort((a, b) => b[1] - a[1]),
    }));
  }
  return null;
}

function piece(text, logprobs) {
  if (!logprobs?.length) return document.createTextNode(text);
  const span = el("span", "tok", text);
  tokenInfo.set(span, logprobs);
  return span;
}

const percent = (logprob) => {
  const p = Math.exp(logprob) * 100;
  return `${p >= 1 ? p.toFixed(1) : p.toPrecision(2)}%`;
};

function showTip(span) {
  const tip = $("#tip");
  tip.replaceChildren();
  for (const entry of tokenInfo.get(span)) {
    tip.append(el("div", "tip-head", `${JSON.stringify(entry.token)}  ${percent(entry.logprob)}`));
    const table = el("table");
    for (const [token, logprob] of entry.top) {
      const row = el("tr", token === entry.token ? "chosen" : "");
      row.append(el("td", "", JSON.stringify(token)), el("td", "num", percent(logprob)));
      table.append(row);
    }
    tip.append(table);
  }
  tip.hidden = false;
  const box = span.getBoundingClientRect();
  const top = box.bottom + tip.offsetHeight + 8 > innerHeight ? box.top - tip.offsetHeight - 6 : box.bottom + 6;
  tip.style.top = `${Math.max(4, top)}px`;
  tip.style.left = `${Math.max(4, Math.min(box.left, innerWidth - tip.offsetWidth - 4))}px`;
}

function setupTips() {
  document.addEventListener("mouseover", (event) => {
    const span = event.target.closest?.(".tok");
    if (span) showTip(span);
    else $("#tip").hidden = true;
  });
  document.addEventListener("click", (event) => { // a tap on a phone
    const span = event.target.closest?.(".tok");
    if (span) showTip(span);
  });
}

// ---- streaming ---------------------------------------------------------------------------------

function headers() {
  const key = $("#api-key").value.trim();
  return { "Content-Type": "application/json", ...(key ? { Authorization: `Bearer ${key}` } : {}) };
}

// POSTs `body` and calls onEvent with each `data:` object of the SSE stream until [DONE].
async function streamEvents(path, body, signal, onEvent) {
  const res = await fetch(path, { method: "POST", headers: headers(), body: JSON.stringify(body), signal });
  if (!res.ok) throw await httpError(res);
  const reader = res.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value.replace(/\r\n/g, "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of block.split("\n")) {
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") return;
        const event = JSON.parse(data);
        if (event.object === "error" || event.error) {
          throw new Error(event.error?.message ?? event.message ?? "the generation failed");
        }
        onEvent(event);
      }
    }
  }
}

function statsText({ usage, t0, tFirst, tLast, finish }) {
  const parts = [];
  if (usage) parts.push(`${usage.prompt_tokens} prompt + ${usage.completion_tokens} generated tokens`);
  const n = usage?.completion_tokens ?? 0;
  if (n > 1 && tLast > tFirst) parts.push(`${((n - 1) / ((tLast - tFirst) / 1000)).toFixed(1)} tokens/s`);
  if (tFirst !== null) parts.push(`first token ${((tFirst - t0) / 1000).toFixed(2)} s`);
  if (finish) parts.push(finish === "stopped" ? "stopped" : `finish: ${finish}`);
  return parts.join(" · ");
}

// Streams one generation into `sink.text(text, logprobs)`; live statistics go to `sink.stats`.
// Returns the final statistics line, or null after an error (shown in the banner).
async function generate(path, body, sink) {
  const controller = new AbortController();
  state.controller = controller;
  hideError();
  setBusy(true);
  const run = { usage: null, t0: performance.now(), tFirst: null, tLast: null, finish: null };
  try {
    await streamEvents(path, body, controller.signal, (event) => {
      if (event.usage) run.usage = event.usage;
      const choice = event.choices?.[0];
      const text = choice ? (choice.delta ? choice.delta.content : choice.text) : "";
      if (text) {
        run.tLast = performance.now();
        run.tFirst ??= run.tLast;
        sink.text(text, logprobsOf(choice));
      }
      if (choice?.finish_reason) run.finish = choice.finish_reason;
      sink.stats(statsText(run));
    });
    return statsText(run);
  } catch (error) {
    if (error.name === "AbortError") {
      run.finish = "stopped";
      return statsText(run);
    }
    showError(error.message);
    return null;
  } finally {
    state.controller = null;
    setBusy(false);
  }
}

function stop() {
  state.controller?.abort();
}

// ---- chat mode ---------------------------------------------------------------------------------

function fillContent(node, message) {
  node.replaceChildren();
  if (message.pieces) node.append(...message.pieces.map(([text, logprobs]) => piece(text, logprobs)));
  else node.textContent = message.content;
}

function messageView(message, i) {
  const last = i === state.messages.length - 1;
  const article = el("article", `msg ${message.role}`);
  const head = el("div", "msg-head");
  head.append(el("span", "role", message.role === "user" ? "You" : "Assistant"));
  const actions = el("div", "actions");
  const n = i + 1;
  actions.append(button("Edit", () => editMessage(i), `Edit message ${n}`));
  if (message.role === "assistant") {
    actions.append(button("Regenerate", () => regenerate(i), `Regenerate message ${n}`));
    if (last) actions.append(button("Continue", () => reply(true), `Continue message ${n}`));
  }
  actions.append(button("Delete", () => deleteMessage(i), `Delete message ${n}`));
  head.append(actions);
  const content = el("div", "content");
  fillContent(content, message);
  article.append(head, content);
  if (message.stats) article.append(el("div", "stats", message.stats));
  return article;
}

function renderChat() {
  const box = $("#messages");
  box.replaceChildren(...state.messages.map(messageView));
  if (!state.messages.length) box.append(el("p", "hint empty", "Say something to the model."));
  box.scrollTop = box.scrollHeight;
}

function editMessage(i) {
  const message = state.messages[i];
  const article = $("#messages").children[i];
  const content = article.querySelector(".content");
  const area = el("textarea", "edit");
  area.value = message.content;
  area.rows = Math.min(12, message.content.split("\n").length + 1);
  area.setAttribute("aria-label", `Edit message ${i + 1}`);
  const save = button("Save", () => {
    message.content = area.value;
    message.pieces = null;
    message.stats = null;
    saveSession();
    renderChat();
  });
  const cancel = button("Cancel", renderChat);
  const row = el("div", "buttons");
  row.append(save, cancel);
  content.replaceChildren(area, row);
  area.focus();
}

function deleteMessage(i) {
  state.messages.splice(i, 1);
  saveSession();
  renderChat();
}

function regenerate(i) {
  state.messages.splice(i);
  reply(false);
}

function chatBody(continuing) {
  const messages = state.messages.map(({ role, content }) => ({ role, content }));
  const system = $("#system").value;
  if (system.trim()) messages.unshift({ role: "system", content: system });
  const body = {
    ...samplerFields(), messages, stream: true, stream_options: { include_usage: true, continuous_usage_stats: true },
  };
  const top = topLogprobs();
  if (top > 0) Object.assign(body, { logprobs: true, top_logprobs: top });
  if (continuing) Object.assign(body, { continue_final_message: true, add_generation_prompt: false });
  return body;
}

// Generates the next assistant message, or continues the last one.
async function reply(continuing) {
  let body;
  try {
    body = chatBody(continuing);
  } catch (error) {
    return showError(error.message);
  }
  if (!continuing) state.messages.push({ role: "assistant", content: "", pieces: [] });
  const message = state.messages.at(-1);
  message.pieces ??= [[message.content, null]];
  renderChat();
  const article = $("#messages").lastElementChild;
  const content = article.querySelector(".content");
  const stats = article.appendChild(el("div", "stats"));
  const box = $("#messages");
  const finalStats = await generate("v1/chat/completions", body, {
    text(text, logprobs) {
      const follow = box.scrollHeight - box.scrollTop - box.clientHeight < 40;
      message.content += text;
      message.pieces.push([text, logprobs]);
      content.append(piece(text, logprobs));
      if (follow) box.scrollTop = box.scrollHeight;
    },
    stats(line) {
      stats.textContent = line;
    },
  });
  if (finalStats !== null) message.stats = finalStats;
  else if (!continuing && !message.content) state.messages.pop();
  saveSession();
  renderChat();
}

function setupChat() {
  const input = $("#chat-input");
  $("#chat-form").addEventListener("submit", (event) => {
    event.preventDefault();
    if (state.controller) return;
    const text = input.value;
    if (text.trim()) {
      state.messages.push({ role: "user", content: text });
      input.value = "";
    } else if (state.messages.at(-1)?.role !== "user") {
      return;
    }
    reply(false);
  });
  input.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      $("#chat-form").requestSubmit();
    }
  });
  $("#stop").addEventListener("click", stop);
  $("#new-chat").addEventListener("click", () => {
    state.messages = [];
    saveSession();
    renderChat();
  });
}

// ---- story mode --------------------------------------------------------------------------------

async function continueStory(retry) {
  const story = $("#story");
  if (retry && state.storyMark !== null) story.value = story.value.slice(0, state.storyMark);
  let body;
  try {
    body = {
      ...samplerFields(), prompt: story.value, stream: true,
      stream_options: { include_usage: true, continuous_usage_stats: true },
    };
    const top = topLogprobs();
    if (top > 0) body.logprobs = top;
  } catch (error) {
    return showError(error.message);
  }
  state.storyMark = story.value.length;
  const tokens = $("#story-tokens");
  tokens.replaceChildren();
  const stats = await generate("v1/completions", body, {
    text(text, logprobs) {
      story.value += text;
      story.scrollTop = story.scrollHeight;
      tokens.append(piece(text, logprobs));
    },
    stats(line) {
      $("#story-stats").textContent = line;
    },
  });
  if (stats !== null) $("#story-stats").textContent = stats;
  saveSession();
}

function setupStory() {
  $("#generate").addEventListener("click", () => continueStory(false));
  $("#retry").addEventListener("click", () => continueStory(true));
  $("#story-stop").addEventListener("click", stop);
  $("#undo").addEventListener("click", () => {
    if (state.storyMark === null) return;
    $("#story").value = $("#story").value.slice(0, state.storyMark);
    state.storyMark = null;
    $("#story-tokens").replaceChildren();
    saveSession();
  });
  $("#story").addEventListener("input", () => {
    state.storyMark = null; // the user's own edit: nothing to retry or undo
    saveSession();
  });
}

// ---- start -------------------------------------------------------------------------------------

async function checkServer() {
  try {
    const res = await fetch("v1/models", { headers: headers() });
    if (!res.ok) throw await httpError(res);
    const card = (await res.json()).data?.[0];
    state.model = card?.id ?? null;
    $("#model").textContent = card ? `${card.id} · ${card.max_model_len} tokens of context` : "no model";
    hideError();
  } catch (error) {
    state.model = null;
    $("#model").textContent = "not connected";
    showError(error.message);
  }
}

function start() {
  buildPanel();
  setupDrag();
  setupPresets();
  setupTips();
  setupChat();
  setupStory();
  const saved = loadJSON(STORE.settings, null);
  applySnapshot(saved ?? { values: {}, order: DEFAULT_ORDER }, true);
  setMode(saved?.mode);
  renderPresets();
  const session = loadJSON(STORE.session, {});
  state.messages = Array.isArray(session.messages) ? session.messages : [];
  $("#story").value = session.story ?? "";
  renderChat();
  setSettingsOpen(matchMedia("(min-width: 900px)").matches);
  // On a phone the settings are a drawer under the header, whose height depends on wrapping.
  const bar = $(".bar");
  new ResizeObserver(() => document.body.style.setProperty("--bar-height", `${bar.offsetHeight}px`)).observe(bar);

  document.addEventListener("input", (event) => {
    if (event.target.dataset?.key) saveSettings();
  });
  document.addEventListener("change", (event) => {
    const key = event.target.dataset?.key;
    if (!key) return;
    saveSettings();
    if (key === "theme") applyTheme();
    if (key === "api-key") checkServer();
  });
  for (const tab of document.querySelectorAll("[role=tab]")) {
    tab.addEventListener("click", () => {
      setMode(tab.dataset.mode);
      saveSettings();
    });
  }
  $("#theme-toggle").addEventListener("click", () => {
    $("#theme").value = isDark() ? "light" : "dark";
    applyTheme();
    saveSettings();
  });
  $("#settings-toggle").addEventListener("click", () => {
    setSettingsOpen(!document.body.classList.contains("settings-open"));
  });
  $("#error-close").addEventListener("click", hideError);
  $("#connection").addEventListener("submit", (event) => {
    event.preventDefault();
    checkServer();
  });
  checkServer();
}

start();
