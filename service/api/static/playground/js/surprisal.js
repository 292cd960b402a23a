// Section 2: the text scored once per configuration (a ticked scaling crossed with a ticked
// attention rule) through /score; per-token surprisal in bits against position (moving average),
// mean surprisal of the first L tokens for L = 256, 512, ..., and the `pe` block each /score echoed.

import { postJSON } from "./api.js";
import { colour, lineChart, seriesColour } from "./charts.js";
import { resolvedLabel } from "./rules.js";

const FIRST_SWEEP_LENGTH = 256;

// Bits per token; the first token has no prefix, so it has no surprisal (null, a gap).
function bits(tokenLogprobs) {
  return tokenLogprobs.map((logprob) => (logprob === null ? null : -logprob / Math.LN2));
}

// Trailing moving average over the last `window` tokens that have a surprisal.
function movingAverage(values, window) {
  const result = [];
  const recent = [];
  let sum = 0;
  for (const value of values) {
    if (value === null) {
      result.push(null);
      continue;
    }
    recent.push(value);
    sum += value;
    if (recent.length > window) sum -= recent.shift();
    result.push(sum / recent.length);
  }
  return result;
}

function sweepLengths(numTokens, maxContext) {
  const limit = Math.min(numTokens, maxContext);
  const lengths = [];
  for (let length = FIRST_SWEEP_LENGTH; length <= limit; length *= 2) lengths.push(length);
  if (lengths.at(-1) !== limit) lengths.push(limit);
  return lengths;
}

// Mean surprisal of the tokens predicted within the first `length` tokens.
function meanBits(values, length) {
  const scored = values.slice(1, length);
  return scored.reduce((total, value) => total + value, 0) / scored.length;
}

// A byte-level tokenizer gives one token per UTF-8 byte (plus BOS): then bits per token are bits per byte.
function isByteLevel(text, tokens) {
  const bytes = new TextEncoder().encode(text).length;
  return tokens.length === bytes || tokens.length === bytes + 1;
}

// The resolved scaling and rule of each /score, listed under the plots.
function listResolved(list, runs, scores) {
  list.replaceChildren(...scores.map((score, index) => {
    const item = document.createElement("li");
    item.dataset.scaling = JSON.stringify(score.pe.scaling);
    item.dataset.attention = JSON.stringify(score.pe.attention);
    item.textContent = `${resolvedLabel(runs[index].configuration, score.pe.attention)}: scaling ` +
      `${item.dataset.scaling}, attention ${item.dataset.attention}`;
    return item;
  }));
}

// `runs`: [{configuration, request}], each configuration's /score body; `model`: the chosen
// /models card; `onError(configuration, error)` hears of a refused /score before the plot fails.
export async function plotSurprisal(runs, model, window, onError = () => {}) {
  const scores = await Promise.all(runs.map(({ configuration, request }) => postJSON("/score", request).catch((error) => {
    onError(configuration, error);
    throw error;
  })));
  const series = scores.map((score, index) => {
    const { configuration } = runs[index];
    const type = configuration.scaling;
    const label = resolvedLabel(configuration, score.pe.attention);
    const shade = configuration.namesRule ? seriesColour(index) : colour(type, index);
    return { type, label, shade, attention: score.pe.attention, values: bits(score.token_logprobs), score };
  });
  const numTokens = Math.max(...scores.map((score) => score.num_tokens));
  const lines = series.map(({ type, label, shade, attention, values }) => ({
    label,
    scaling: type,
    attention,
    colour: shade,
    points: movingAverage(values, window).map((y, x) => ({ x, y })),
  }));
  const peak = Math.max(...lines.flatMap((line) => line.points.map((point) => point.y ?? 0)));
  lines.push({
    label: `native context (${model.native_context})`,
    colour: "#888",
    dashed: true,
    points: [{ x: model.native_context, y: 0 }, { x: model.native_context, y: peak }],
  });
  lineChart("surprisal-chart", lines, { xTitle: "position (tokens)", yTitle: "surprisal (bits)" });

  const perByte = isByteLevel(runs[0].request.prompt, scores[0].tokens);
  const unit = perByte ? "bits per byte" : "bits per token";
  const sweep = series.map(({ type, label, shade, attention, values }) => ({
    label,
    scaling: type,
    attention,
    colour: shade,
    points: sweepLengths(values.length, model.max_context).map((length) => ({ x: length, y: meanBits(values, length) })),
  }));
  lineChart("sweep-chart", sweep, { xTitle: "context length L (tokens)", yTitle: unit, xLog: true });
  const dynamic = runs.some(({ configuration }) => configuration.scaling === "dynamic")
    ? "; dynamic scaling ran with the table of the whole text's length" : "";
  document.getElementById("sweep-caption").textContent =
    `Mean surprisal (${unit}) of the first L tokens, from the same scores${dynamic}.`;
  listResolved(document.getElementById("score-resolved"), runs, scores);
  return { numTokens, scores };
}
