// Section 3 drawn: a table of the cells (bits per token, and past the native context), curves of
// bits per token against length (one per scaling), a heatmap of the same, and where each breaks.

import { colour, heatmap, lineChart, seriesColour } from "./charts.js";
import { scalingLabel } from "./grid.js";

const GUIDE = "#888";

function element(tag, text = "", attributes = {}) {
  const node = document.createElement(tag);
  node.textContent = text;
  for (const [name, value] of Object.entries(attributes)) node.setAttribute(name, value);
  return node;
}

const format = (bits) => (bits === null ? "–" : bits.toFixed(3));

function cellFor(sweep, scaling, length) {
  return sweep.cells.find((cell) => cell.scaling === scaling && cell.length === length);
}

function breakText(point, sweep) {
  if (point.judged === 0) return `not judged (no length ≥ ${sweep.reference.length})`;
  return point.breaks_at === null ? "holds at every length judged" : `breaks at ${point.breaks_at}`;
}

// One row per scaling, one column per length; each cell keeps its exact figures in data-* attributes.
function drawTable(table, sweep, points) {
  const head = element("tr");
  head.append(element("th", "scaling", { scope: "col" }));
  for (const length of sweep.lengths) {
    const past = length > sweep.native ? " (past native)" : "";
    head.append(element("th", `L = ${length}${past}`, { scope: "col" }));
  }
  head.append(element("th", "where it breaks", { scope: "col" }));
  const rows = sweep.scalings.map((scaling, index) => {
    const row = element("tr", "", { "data-scaling": JSON.stringify(scaling) });
    row.append(element("th", scalingLabel(scaling), { scope: "row" }));
    for (const length of sweep.lengths) {
      const cell = cellFor(sweep, scaling, length);
      const td = element("td", format(cell.bits_per_token), {
        "data-length": String(length),
        "data-bits": String(cell.bits_per_token),
        "data-tail-bits": String(cell.tail_bits_per_token),
      });
      if (cell.tail_bits_per_token !== null) td.append(element("small", `past native ${format(cell.tail_bits_per_token)}`));
      row.append(td);
    }
    const point = points[index];
    row.append(element("td", breakText(point, sweep), { class: point.breaks_at === null ? "holds" : "breaks" }));
    return row;
  });
  table.replaceChildren(element("thead"), element("tbody"));
  table.tHead.append(head);
  table.tBodies[0].append(...rows);
}

// A curve per scaling, the reference as a lone point, and dashed guides: the limit and the native context.
function drawCurves(sweep, limit) {
  const { reference } = sweep;
  const series = sweep.scalings.map((scaling, index) => ({
    label: scalingLabel(scaling),
    scaling: scalingLabel(scaling),
    colour: scaling.type === "none" ? colour("none") : seriesColour(index),
    points: sweep.lengths.map((length) => ({ x: length, y: cellFor(sweep, scaling, length).bits_per_token })),
  }));
  series.push({
    label: `reference (none, ${reference.length})`, colour: colour("none"),
    points: [{ x: reference.length, y: reference.bits_per_token }],
  });
  const [first, last] = [sweep.lengths[0], sweep.lengths.at(-1)];
  series.push({
    label: `break limit (${limit.toFixed(3)})`, colour: GUIDE, dashed: true,
    points: [{ x: Math.min(first, reference.length), y: limit }, { x: Math.max(last, reference.length), y: limit }],
  });
  if (first <= sweep.native && sweep.native <= last) {
    const values = [...sweep.cells, reference].map((cell) => cell.bits_per_token);
    const [low, high] = [Math.min(...values, limit), Math.max(...values, limit)];
    series.push({
      label: `native context (${sweep.native})`, colour: GUIDE, dashed: true,
      points: [{ x: sweep.native, y: low }, { x: sweep.native, y: high }],
    });
  }
  lineChart("sweep-curves", series, { xTitle: "length L (tokens)", yTitle: "bits per token, tokens 2..L" });
}

function drawHeatmap(sweep) {
  const rows = sweep.scalings.map((scaling) => sweep.lengths.map((length) => cellFor(sweep, scaling, length).bits_per_token));
  heatmap("sweep-heatmap", rows, {
    xs: sweep.lengths, ys: sweep.scalings.map(scalingLabel), xTitle: "length L", yTitle: "scaling", label: "bits per token",
  });
}

export function drawSweep(sweep, points, threshold) {
  const limit = sweep.reference.bits_per_token + threshold;
  drawTable(document.getElementById("sweep-table"), sweep, points);
  drawCurves(sweep, limit);
  drawHeatmap(sweep);
  document.getElementById("sweep-reference").textContent =
    `Reference: no scaling over the first ${sweep.reference.length} tokens, ${format(sweep.reference.bits_per_token)} ` +
    `bits per token; with the threshold of ${threshold} the limit is ${limit.toFixed(3)}.`;
}
