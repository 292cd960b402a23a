// Wires the page: the API key, the model list, the settings kept in the URL, the scalings and
// attention rules every section crosses, and the four sections' buttons. `window.playground`
// exposes the charts and each section's last result to anyone scripting the page (the browser
// tests read it).

import { apiKey, getJSON, setApiKey } from "./api.js";
import { buildRuleEditor, clearRuleErrors, offerSupported, showRuleError, tickedRules } from "./attention.js";
import { chart } from "./charts.js";
import { compare } from "./compare.js";
import { parseLengths, parseScalings } from "./grid.js";
import { inspect } from "./inspect.js";
import { parseRules } from "./rulegrid.js";
import { configurations } from "./rules.js";
import { SCALING_TYPES, buildScalingEditor, limitToSupported, scalingBody, tickedScalings } from "./scalings.js";
import { plotSurprisal } from "./surprisal.js";
import { breakPoints, runSweep } from "./sweep.js";
import { drawSweep } from "./sweepview.js";
import { restoreFromURL, saveToURL, urlValue, watchControls } from "./urlstate.js";

const byId = (id) => document.getElementById(id);
let models = [];
let sweepController = null;

function status(message, isError = false) {
  const line = byId("status");
  line.textContent = message;
  line.classList.toggle("error", isError);
}

function selectedModel() {
  return models.find((model) => model.name === byId("model").value);
}

// A training-side zoo member shows how it was trained beside its scheme ("rope, pi-ft").
function modelKind(model) {
  return model.training_method ? `${model.scheme}, ${model.training_method}` : model.scheme;
}

function showModel() {
  const model = selectedModel();
  if (!model) return;
  limitToSupported(model.supported_scalings);
  offerSupported(model);
  byId("model-info").textContent =
    `${modelKind(model)}, native context ${model.native_context}, max context ${model.max_context}, ${model.device} ${model.dtype}`;
}

async function loadModels() {
  try {
    models = (await getJSON("/models")).models;
  } catch (error) {
    status(`Could not list the models: ${error.message}${error.status === 401 ? " Enter the API key." : ""}`, true);
    return;
  }
  const select = byId("model");
  select.replaceChildren(...models.map((model) => new Option(`${model.name} (${modelKind(model)})`, model.name)));
  const wanted = urlValue("model");
  if (models.some((model) => model.name === wanted)) select.value = wanted;
  showModel();
  saveToURL();
  status(`${models.length} model(s) ready.`);
}

function numberOf(id) {
  const raw = byId(id).value.trim();
  return raw === "" ? undefined : Number(raw);
}

// One request per ticked scaling × ticked rule: [{configuration, request}].
function runsFor(input) {
  const model = selectedModel();
  return configurations(tickedScalings(), tickedRules(model), (type) => type).map((configuration) => ({
    configuration,
    request: {
      model: model.name, ...input, pe_scaling: scalingBody(configuration.scaling), pe_attention: configuration.attention,
    },
  }));
}

// A refused rule's message goes beside the field the server named.
function onRuleError(configuration, error) {
  showRuleError(configuration.attention.type, error);
}

// Runs one section's action with its button disabled; marks the section done, cancelled (its
// requests aborted) or failed.
async function run(buttonId, sectionId, action) {
  const button = byId(buttonId);
  const section = byId(sectionId);
  button.disabled = true;
  section.dataset.state = "running";
  try {
    window.playground.results[sectionId] = await action();
    section.dataset.state = "done";
  } catch (error) {
    const cancelled = error.name === "AbortError";
    section.dataset.state = cancelled ? "cancelled" : "error";
    status(cancelled ? "Cancelled." : error.message, !cancelled);
  } finally {
    button.disabled = false;
  }
}

function needConfigurations() {
  const model = selectedModel();
  if (!model) throw new Error("No model: check the API key and reload.");
  if (tickedScalings().length === 0) throw new Error("Tick at least one scaling.");
  if (tickedRules(model).length === 0) throw new Error("Tick at least one attention rule.");
  clearRuleErrors();
}

function onCompare() {
  return run("compare", "compare-section", async () => {
    needConfigurations();
    const sampling = { max_new_tokens: numberOf("max-new-tokens"), temperature: numberOf("temperature") };
    const seed = numberOf("seed");
    if (seed !== undefined) sampling.seed = seed;
    await compare(byId("columns"), runsFor({ prompt: byId("prompt").value, ...sampling }), onRuleError);
    status("Generation finished.");
  });
}

function onScore() {
  return run("score", "breaks-section", async () => {
    needConfigurations();
    const text = byId("document").value;
    if (!text) throw new Error("Paste a text to score, or load the sample.");
    const span = Math.max(1, numberOf("window") ?? 1);
    const result = await plotSurprisal(runsFor({ prompt: text }), selectedModel(), span, onRuleError);
    status(`Scored ${result.numTokens} tokens under ${result.scores.length} configuration(s).`);
    return result;
  });
}

// The grid is read and checked in full before the first request; an error shows in the section.
// A failed cell aborts the others: the sweep is reported whole or not at all.
function onSweep() {
  const message = byId("sweep-message");
  const cancel = byId("sweep-cancel");
  message.textContent = "";
  const controller = new AbortController();
  sweepController = controller; // what the Cancel button aborts
  const { signal } = controller;
  return run("sweep", "sweep-section", async () => {
    try {
      const model = selectedModel();
      if (!model) throw new Error("No model: check the API key and reload.");
      const lengths = parseLengths(byId("sweep-lengths").value, model.max_context);
      const scalings = parseScalings(byId("sweep-grid").value, model.supported_scalings);
      const rules = parseRules(byId("sweep-rules").value, model);
      const threshold = Math.max(0, numberOf("sweep-threshold") ?? 0);
      cancel.disabled = false;
      const sweep = await runSweep({
        model, lengths, signal,
        configurations: configurations(scalings, rules),
        text: byId("sweep-text").value,
        onCell: (done, total) => {
          Object.assign(byId("sweep-progress"), { value: done, max: total });
          byId("sweep-count").textContent = `${done} of ${total} cells`;
        },
      });
      const points = breakPoints(sweep, threshold);
      drawSweep(sweep, points, threshold);
      status(`Swept ${lengths.length} length(s) × ${scalings.length} scaling(s) × ${rules.length} attention rule(s).`);
      return { ...sweep, threshold, breaks: points };
    } catch (error) {
      if (error.name !== "AbortError") message.textContent = error.message;
      throw error;
    } finally {
      controller.abort();
      cancel.disabled = true;
    }
  });
}

function onInspect() {
  return run("inspect", "inspect-section", async () => {
    const type = byId("inspect-scaling").value;
    const body = {
      pe: byId("inspect-pe").value,
      length: numberOf("inspect-length"),
      head_dim: numberOf("inspect-head-dim"),
      rope_base: numberOf("inspect-base"),
      num_heads: numberOf("inspect-heads"),
      native_context: selectedModel()?.native_context ?? 256,
      pe_scaling: scalingBody(type),
    };
    const result = await inspect(body, numberOf("inspect-head") ?? 0);
    status(`Inspected ${result.pe} over ${result.length} positions.`);
    return result;
  });
}

async function loadSample(targetId) {
  const response = await fetch("/playground/static/sample.txt");
  byId(targetId).value = await response.text();
}

function start() {
  window.playground = { chart, results: {} };
  buildScalingEditor(byId("scalings"));
  buildRuleEditor(byId("attention-rules"));
  byId("inspect-scaling").replaceChildren(...SCALING_TYPES.map((type) => new Option(type, type)));
  restoreFromURL();
  watchControls();
  saveToURL();
  byId("api-key").value = apiKey();
  byId("key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    setApiKey(byId("api-key").value.trim());
    loadModels();
  });
  byId("model").addEventListener("change", showModel);
  byId("compare").addEventListener("click", onCompare);
  byId("score").addEventListener("click", onScore);
  byId("inspect").addEventListener("click", onInspect);
  byId("load-sample").addEventListener("click", () => loadSample("document"));
  byId("sweep").addEventListener("click", onSweep);
  byId("sweep-cancel").addEventListener("click", () => sweepController?.abort());
  byId("sweep-load-sample").addEventListener("click", () => loadSample("sweep-text"));
  window.playground.ready = loadModels();
}

start();
