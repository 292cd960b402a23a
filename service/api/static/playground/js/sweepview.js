// Section 3 drawn: a table of the cells (bits per token, and past the native context), curves of
// bits per token against length (one per configuration), a heatmap of the same, and where each
// breaks. Configurations are labelled with their scaling and, when rules are swept, the rule the
// server echoed for them.

import { colour, heatmap, lineChart, seriesColour } from "./charts.js";
import { scalingLabel } from "./grid.js";
import { isStandard, resolvedLabel } from "./rules.js";

const GUIDE = "#888";

function element(tag, text = "", attributes = {}) {
  const node = document.createElement(tag);
  node.textContent = text;
  for (const [name, value] of Object.entries(attributes)) node.setAttribute(name, value);
  return node;
}

const format = (bits) => (bits === null ? "–" : bits.toFixed(3));

function cellFor(sweep, configuration, length) {
  return sweep.cells.find((cell) => cell.configuration === configuration && cell.length === length);
}

// Each configuration's label, its rule as the server echoed it.
const labels = (sweep) => sweep.configurations.map((configuration, index) => resolvedLabel(configuration, sweep.echoes[index]));

function breakText(point, sweep) {
  if (point.judged === 0) return `not judged (no length ≥ ${sweep.reference.length})`;
  return point.breaks_at === null ? "holds at every length judged" : `breaks at ${point.breaks_at}`;
}

// One row per configuration, one column per length; the row keeps the scaling sent and the rule the
// server echoed, each cell its exact figures, in data-* attributes.
function drawTable(table, sweep, points) {
  const names = labels(sweep);
  const head = element("tr");
  head.append(element("th", sweep.configurations.some((c) => c.namesRule) ? "scaling + attention" : "scaling", { scope: "col" }));
  for (const length of sweep.lengths) {
    const past = length > sweep.native ? " (past native)" : "";
    head.append(element("th", `L = ${length}${past}`, { scope: "col" }));
  }
  head.append(element("th", "where it breaks", { scope: "col" }));
  const rows = sweep.configurations.map((configuration, index) => {
    const row = element("tr", "", {
      "data-scaling": JSON.stringify(configuration.scaling),
      "data-attention": JSON.stringify(sweep.echoes[index]),
    });
    row.append(element("th", names[index], { scope: "row" }));
    for (const length of sweep.lengths) {
      const cell = cellFor(sweep, configuration, length);
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

// A curve per configuration, the reference as a lone point, and dashed guides: the limit and the
// native context.
function drawCurves(sweep, limit) {
  const { reference } = sweep;
  const names = labels(sweep);
  const series = sweep.configurations.map((configuration, index) => ({
    label: names[index],
    scaling: scalingLabel(configuration.scaling),
    attention: sweep.echoes[index],
    colour: configuration.scaling.type === "none" && isStandard(configuration.attention) ? colour("none") : seriesColour(index),
    points: sweep.lengths.map((length) => ({ x: length, y: cellFor(sweep, configuration, length).bits_per_token })),
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
  const rows = sweep.configurations.map(
    (configuration) => sweep.lengths.map((length) => cellFor(sweep, configuration, length).bits_per_token));
  const yTitle = sweep.configurations.some((c) => c.namesRule) ? "scaling + attention" : "scaling";
  heatmap("sweep-heatmap", rows, { xs: sweep.lengths, ys: labels(sweep), xTitle: "length L", yTitle, label: "bits per token" });
}

export function drawSweep(sweep, points, threshold) {
  const limit = sweep.reference.bits_per_token + threshold;
  drawTable(document.getElementById("sweep-table"), sweep, points);
  drawCurves(sweep, limit);
  drawHeatmap(sweep);
  document.getElementById("sweep-reference").textContent =
    `Reference: no scaling, standard attention, over the first ${sweep.reference.length} tokens, ${format(sweep.reference.bits_per_token)} ` +
    `bits per token; with the threshold of ${threshold} the limit is ${limit.toFixed(3)}.`;
}
