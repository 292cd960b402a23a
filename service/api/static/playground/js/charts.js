// Chart.js configurations the sections share: line plots over numeric x, heatmaps (the matrix
// chart type), a colour per scaling. Each canvas holds one chart, replaced when redrawn.

/* global Chart */

const COLOURS = {
  none: "#444c5c", linear: "#1f77b4", ntk: "#2ca02c", dynamic: "#9467bd", yarn: "#d62728", llama3: "#ff7f0e",
};
const EXTRA_COLOURS = ["#17becf", "#8c564b", "#e377c2", "#7f7f7f"];

export function colour(name, index = 0) {
  return COLOURS[name] ?? EXTRA_COLOURS[index % EXTRA_COLOURS.length];
}

// Ten distinguishable colours (matplotlib's tab10), for series that are not one per scaling type.
const PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"];

export function seriesColour(index) {
  return PALETTE[index % PALETTE.length];
}

const charts = {};

// A screen reader gets what the chart shows in words: its kind, axes and series.
function replace(canvasId, config, description) {
  charts[canvasId]?.destroy();
  const canvas = document.getElementById(canvasId);
  canvas.setAttribute("aria-label", description);
  charts[canvasId] = new Chart(canvas, config);
  return charts[canvasId];
}

export function chart(canvasId) {
  return charts[canvasId];
}

// `series`: [{label, points: [{x, y}], colour, dashed?, scaling?, attention?}] on linear (or log)
// axes; `scaling` and `attention` (the rule the server echoed) are kept on the dataset for scripts.
export function lineChart(canvasId, series, { xTitle, yTitle, yLog = false, xLog = false }) {
  const datasets = series.map((line) => ({
    label: line.label,
    scaling: line.scaling,
    attention: line.attention,
    data: line.points,
    borderColor: line.colour,
    backgroundColor: line.colour,
    borderWidth: line.dashed ? 1.5 : 2,
    borderDash: line.dashed ? [6, 4] : [],
    pointRadius: line.dashed || line.points.length > 40 ? 0 : 3,
    spanGaps: true,
  }));
  return replace(canvasId, {
    type: "line",
    data: { datasets },
    options: {
      animation: false,
      maintainAspectRatio: false,
      parsing: false,
      interaction: { mode: "nearest", axis: "x", intersect: false },
      scales: {
        x: { type: xLog ? "logarithmic" : "linear", title: { display: true, text: xTitle } },
        y: { type: yLog ? "logarithmic" : "linear", title: { display: true, text: yTitle } },
      },
    },
  }, `Line chart of ${yTitle} against ${xTitle}: ${series.map((line) => line.label).join(", ")}.`);
}

// Blue (lowest) through white to red (highest), linear in the value.
function diverging(value, low, high) {
  const t = high > low ? (value - low) / (high - low) : 0.5;
  const [from, to, u] = t < 0.5 ? [[49, 84, 160], [247, 247, 247], t * 2] : [[247, 247, 247], [178, 24, 43], t * 2 - 1];
  const rgb = from.map((start, i) => Math.round(start + (to[i] - start) * u));
  return `rgb(${rgb.join(",")})`;
}

// Up to this many heatmap rows, every row is labelled (a sweep's configurations); past it, Chart.js
// skips labels that would overlap (an inspected table's positions).
const LABELLED_ROWS = 32;

// A tick at each row's centre (the linear scale's own ticks fall between rows once there are many).
const rowTicks = (ys) => (axis) => {
  axis.ticks = ys.map((_, index) => ({ value: index }));
};

// `rows[y][x]` as a heatmap (null: no cell); `xs` and `ys` label the columns and rows (after any striding).
export function heatmap(canvasId, rows, { xs, ys, xTitle, yTitle, label }) {
  const cells = [];
  let low = Infinity;
  let high = -Infinity;
  rows.forEach((row, yi) => row.forEach((v, xi) => {
    if (v === null) return;  // a cell that does not exist (a masked attention entry): left blank
    cells.push({ x: xi, y: yi, v });
    low = Math.min(low, v);
    high = Math.max(high, v);
  }));
  const tick = (values) => (index) => values[index] ?? "";
  return replace(canvasId, {
    type: "matrix",
    data: {
      datasets: [{
        label,
        data: cells,
        backgroundColor: (context) => diverging(context.raw?.v ?? 0, low, high),
        borderWidth: 0,
        width: ({ chart: c }) => (c.chartArea?.width ?? 0) / xs.length + 0.5,
        height: ({ chart: c }) => (c.chartArea?.height ?? 0) / ys.length + 0.5,
      }],
    },
    options: {
      animation: false,
      maintainAspectRatio: false,
      plugins: {
        legend: { display: false },
        tooltip: {
          callbacks: {
            title: () => "",
            label: (context) => `${yTitle} ${ys[context.raw.y]}, ${xTitle} ${xs[context.raw.x]}: ${context.raw.v.toPrecision(4)}`,
          },
        },
      },
      scales: {
        x: { type: "linear", min: -0.5, max: xs.length - 0.5, offset: false, grid: { display: false },
          ticks: { callback: tick(xs) }, title: { display: true, text: xTitle } },
        y: { type: "linear", min: -0.5, max: ys.length - 0.5, offset: false, reverse: true, grid: { display: false },
          afterBuildTicks: rowTicks(ys), ticks: { callback: tick(ys), autoSkip: ys.length > LABELLED_ROWS },
          title: { display: true, text: yTitle } },
      },
    },
  }, `Heatmap of ${label} by ${yTitle} (rows) and ${xTitle} (columns), from ${low.toPrecision(3)} (blue) to ${high.toPrecision(3)} (red).`);
}
