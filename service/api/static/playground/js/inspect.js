// Section 3: POST /inspect and its tables drawn: frequencies (or slopes) as lines, the cos table
// (or bias, buckets, sinusoidal table) as a heatmap, thinned to at most MAX_ROWS rows.

import { postJSON } from "./api.js";
import { heatmap, lineChart } from "./charts.js";

const MAX_ROWS = 128;

function stride(rows) {
  const step = Math.max(1, Math.ceil(rows.length / MAX_ROWS));
  const kept = [];
  const labels = [];
  for (let index = 0; index < rows.length; index += step) {
    kept.push(rows[index]);
    labels.push(index);
  }
  return { rows: kept, labels, step };
}

function indices(count) {
  return Array.from({ length: count }, (_, index) => index);
}

function caption(id, text) {
  document.getElementById(id).textContent = text;
}

function drawRope(result) {
  const { rope } = result;
  const points = (values) => values.map((y, x) => ({ x, y }));
  lineChart("inspect-lines", [
    { label: "unscaled", colour: "#444c5c", points: points(rope.inv_freq_unscaled) },
    { label: result.scaling ? result.scaling.type : "none", colour: "#d62728", points: points(rope.inv_freq) },
  ], { xTitle: "frequency index i", yTitle: "inverse frequency (rad / position)", yLog: true });
  caption("inspect-lines-caption", "Inverse frequency per dimension pair before and after scaling (log scale).");
  const table = stride(rope.cos);
  heatmap("inspect-heatmap", table.rows, {
    xs: indices(rope.inv_freq.length), ys: table.labels, xTitle: "frequency", yTitle: "position", label: "cos",
  });
  caption("inspect-heatmap-caption", `cos(position × inv_freq) × attention factor, every ${table.step} position(s).`);
}

function drawAlibi(result, head) {
  const { alibi } = result;
  const shown = Math.min(head, alibi.slopes.length - 1);
  lineChart("inspect-lines", [
    { label: "slope", colour: "#1f77b4", points: alibi.slopes.map((y, x) => ({ x, y })) },
  ], { xTitle: "head", yTitle: "slope", yLog: true });
  caption("inspect-lines-caption", "ALiBi slope per head.");
  const causal = alibi.bias[shown].map((row, query) => row.map((bias, key) => (key > query ? null : bias)));
  const table = stride(causal);
  heatmap("inspect-heatmap", table.rows, {
    xs: indices(result.length), ys: table.labels, xTitle: "key", yTitle: "query", label: "bias",
  });
  caption("inspect-heatmap-caption", `Bias slope × (key − query) of head ${shown}; keys after the query are masked (blank).`);
}

function drawT5(result) {
  const { t5_bias: t5 } = result;
  const middle = t5.buckets[Math.floor(result.length / 2)];
  lineChart("inspect-lines", [
    { label: `query ${Math.floor(result.length / 2)}`, colour: "#2ca02c", points: middle.map((y, x) => ({ x, y })) },
  ], { xTitle: "key", yTitle: "bucket" });
  caption("inspect-lines-caption", "Bucket of each key seen from the middle query.");
  const table = stride(t5.buckets);
  heatmap("inspect-heatmap", table.rows, {
    xs: indices(result.length), ys: table.labels, xTitle: "key", yTitle: "query", label: "bucket",
  });
  caption("inspect-heatmap-caption", `Relative-position bucket (${t5.num_buckets} buckets, max distance ${t5.max_distance}); its bias is a learned weight.`);
}

function drawSinusoidal(result) {
  const { sinusoidal } = result;
  lineChart("inspect-lines", [0, 1, sinusoidal.dim - 2].map((column, index) => ({
    label: `dimension ${column}`,
    colour: ["#1f77b4", "#ff7f0e", "#2ca02c"][index],
    points: sinusoidal.table.map((row, x) => ({ x, y: row[column] })),
  })), { xTitle: "position", yTitle: "value" });
  caption("inspect-lines-caption", "Three dimensions of the table against position.");
  const table = stride(sinusoidal.table);
  heatmap("inspect-heatmap", table.rows, {
    xs: indices(sinusoidal.dim), ys: table.labels, xTitle: "dimension", yTitle: "position", label: "value",
  });
  caption("inspect-heatmap-caption", `The sinusoidal table, read at position / ${sinusoidal.factor}.`);
}

const DRAW = { rope: drawRope, alibi: drawAlibi, t5_bias: drawT5, sinusoidal: drawSinusoidal };

export async function inspect(body, head) {
  const result = await postJSON("/inspect", body);
  DRAW[result.pe](result, head);
  document.getElementById("inspect-info").textContent =
    `Attention factor ${result.attention_factor.toFixed(4)}; scaling ${JSON.stringify(result.scaling)}.`;
  return result;
}
