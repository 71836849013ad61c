// The page at `/`: a form for the model's endpoints (from GET /info) and a view of each answer. Plain DOM, no
// build step; text from the model or the user is only ever set as textContent, never parsed as HTML.
"use strict";

const $ = (id) => document.getElementById(id);
const NAMES = {"/predict": "Predict", "/fill-mask": "Fill mask", "/embed": "Embed"};
let info = null;
let mode = null;

async function call(method, path, body) {
  const headers = {"content-type": "application/json"};
  if ($("key").value) headers.authorization = "Bearer " + $("key").value;
  const response = await fetch(path, {method, headers, body: body === undefined ? undefined : JSON.stringify(body)});
  const data = await response.json().catch(() => ({error: `${response.status} ${response.statusText}`}));
  if (!response.ok) {
    const error = new Error(data.error || `${response.status} ${response.statusText}`);
    error.status = response.status;
    throw error;
  }
  return data;
}

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) node.setAttribute(name, value);
  for (const child of children) node.append(child);
  return node;
}

function showError(message) {
  $("result").replaceChildren(el("p", {class: "error", role: "alert"}, message));
}

async function loadInfo() {
  try {
    info = await call("GET", "/info");
  } catch (error) {
    if (error.status === 401) {
      $("key-row").hidden = false;
      $("model").textContent = "This server needs its API key: type it below, then Run.";
    } else {
      showError(error.message);
    }
    return false;
  }
  const what = info.kind === "pretrained" ? "pretrained model" : `${info.task} model (${info.kind.replace("_", " ")})`;
  const labels = info.labels && info.labels.length <= 20 ? `, labels ${info.labels.join(", ")}` : "";
  $("model").textContent = `${info.model}: ${what}${labels}; ${info.engine} engine, ${info.precision}` +
    `${info.quantize ? ", " + info.quantize : ""}, up to ${info.max_length} tokens`;
  $("key-row").hidden = !$("key").value;
  $("modes").replaceChildren(...info.endpoints.map((path) => {
    const button = el("button", {type: "button", "data-endpoint": path}, NAMES[path] || path);
    button.addEventListener("click", () => setMode(path));
    return button;
  }));
  setMode(info.endpoints[0]);
  return true;
}

// Per endpoint (and task kind for /predict): the first box's label, the second box's (null: none), a hint.
function formFor(path, kind) {
  if (path === "/fill-mask") return ["Text with [MASK]", null, "Write [MASK] where a word should be predicted."];
  if (path === "/embed") return ["Text", null, "The text's vector: its length and first values are shown."];
  if (kind === "question_answering") return ["Question", "Context", "The answer is a span of the context."];
  if (kind === "multiple_choice") return ["Context", "Choices, one per line", "Each choice is scored after the context."];
  if (kind === "token_classification") return ["Text", null, "The entities found are highlighted in the text."];
  return ["Text", "Second text (for tasks on pairs of texts; leave empty otherwise)", ""];
}

function setMode(path) {
  mode = path;
  for (const button of $("modes").children) button.setAttribute("aria-pressed", button.dataset.endpoint === path);
  const [first, second, hint] = formFor(path, info.kind);
  $("text-label").textContent = first;
  $("second-row").hidden = second === null;
  if (second !== null) $("second-label").textContent = second;
  $("embed-row").hidden = path !== "/embed";
  $("pooling").options[2].disabled = !info.pooler;  // pooler: only a model with pooler weights
  $("hint").textContent = hint;
  $("result").replaceChildren();
}

function request() {
  const text = $("text").value;
  const second = $("second").value;
  if (mode === "/fill-mask") return {inputs: text, top_k: 5};
  if (mode === "/embed") return {inputs: text, pooling: $("pooling").value, normalize: $("normalize").checked};
  if (info.kind === "question_answering") return {inputs: {question: text, context: second}};
  if (info.kind === "multiple_choice") {
    return {inputs: {context: text, choices: second.split("\n").map((c) => c.trim()).filter(Boolean)}};
  }
  return {inputs: second.trim() ? {text, text_pair: second} : text};
}

function bars(rows, top) {
  return el("div", {class: "bars"}, ...rows.map(([name, p], i) => el("div", {class: i === top ? "row top" : "row"},
    el("span", {class: "name"}, name),
    el("span", {class: "bar"}, el("span", {style: `width: ${(100 * p).toFixed(1)}%`})),
    el("span", {class: "num"}, p.toFixed(3)))));
}

// `text` with the spans [{start, end, tag}] marked (sorted, not overlapping).
function marked(text, spans) {
  const passage = el("p", {class: "passage"});
  let at = 0;
  for (const span of spans) {
    passage.append(text.slice(at, span.start));
    const mark = el("mark", {}, text.slice(span.start, span.end));
    if (span.tag) mark.append(el("small", {}, span.tag));
    passage.append(mark);
    at = span.end;
  }
  passage.append(text.slice(at));
  return passage;
}

function showPrediction(result, sent) {
  if (info.kind === "classification") {
    const rows = Object.entries(result.probabilities).sort((a, b) => b[1] - a[1]);
    return [el("h3", {class: "label"}, `${result.label} (${result.score.toFixed(3)})`), bars(rows, 0)];
  }
  if (info.kind === "regression") return [el("h3", {class: "label"}, `score ${result.score.toFixed(4)}`)];
  if (info.kind === "token_classification") {
    const spans = result.entities.map((e) => ({start: e.start, end: e.end, tag: e.type}));
    return [el("h3", {}, `${spans.length} entit${spans.length === 1 ? "y" : "ies"}`), marked(sent.inputs, spans)];
  }
  if (info.kind === "question_answering") {
    if (result.start === null) return [el("h3", {class: "label"}, "no answer found")];
    return [el("h3", {class: "label"}, `${result.answer} (${result.score.toFixed(3)})`),
      marked(sent.inputs.context, [{start: result.start, end: result.end}])];
  }
  const rows = sent.inputs.choices.map((choice, i) => [choice, result.probabilities[i]]);
  return [el("h3", {class: "label"}, sent.inputs.choices[result.choice]), bars(rows, result.choice)];
}

function showFill(masks, text) {
  const pieces = text.split("[MASK]");
  const filled = el("p", {class: "passage"}, pieces[0]);
  masks.forEach((candidates, i) => filled.append(el("mark", {}, candidates[0].token), pieces[i + 1]));
  filled.append(pieces.slice(masks.length + 1).join("[MASK]"));  // a [MASK] past the model's length: no answer
  const lists = masks.map((candidates, i) => [el("h3", {}, `[MASK] ${i + 1}`),
    bars(candidates.map((c) => [c.token, c.score]), 0)]);
  return [filled, ...lists.flat()];
}

function showEmbedding(vector) {
  const norm = Math.sqrt(vector.reduce((s, x) => s + x * x, 0));
  return [el("h3", {class: "label"}, `${vector.length} dimensions, norm ${norm.toFixed(4)}`),
    el("p", {class: "passage"}, `[${vector.slice(0, 8).map((x) => x.toFixed(4)).join(", ")}, …]`)];
}

async function submit(event) {
  event.preventDefault();
  if (info === null && !(await loadInfo())) return;
  const sent = request();
  $("submit").disabled = true;
  try {
    const result = await call("POST", mode, sent);
    const shown = mode === "/predict" ? showPrediction(result, sent)
      : mode === "/fill-mask" ? showFill(result, sent.inputs) : showEmbedding(result);
    $("result").replaceChildren(...shown);
  } catch (error) {
    showError(error.message);
  } finally {
    $("submit").disabled = false;
  }
}

$("form").addEventListener("submit", submit);
loadInfo();
