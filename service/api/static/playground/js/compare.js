// Section 1: one streamed /generate per configuration (a ticked scaling crossed with a ticked
// attention rule), all sent at once so the server batches them together; each column fills in as
// its tokens arrive and ends with the resolved `pe` block, the echoed rule included.

import { streamEvents } from "./api.js";
import { resolvedLabel } from "./rules.js";

// `column-yarn`, or `column-yarn-self_extend` when rules are compared too.
function column(configuration) {
  const { scaling, attention, namesRule } = configuration;
  const node = document.createElement("article");
  node.className = "column";
  node.id = namesRule ? `column-${scaling}-${attention.type}` : `column-${scaling}`;
  node.dataset.scaling = scaling;
  node.dataset.rule = attention.type;
  node.dataset.state = "running";
  node.setAttribute("aria-busy", "true");
  const title = document.createElement("h3");
  title.textContent = configuration.label;
  const text = document.createElement("pre");
  text.className = "column-text";
  const details = document.createElement("dl");
  node.append(title, text, details);
  return node;
}

function describe(details, entries) {
  details.replaceChildren();
  for (const [name, value] of entries) {
    const term = document.createElement("dt");
    term.textContent = name;
    const description = document.createElement("dd");
    description.textContent = value;
    description.dataset.term = name;
    details.append(term, description);
  }
}

function summary(end) {
  const { pe, timing, usage } = end;
  return [
    ["scaling", JSON.stringify(pe.scaling)],
    ["attention", JSON.stringify(pe.attention)],
    ["attention factor", pe.attention_factor.toFixed(4)],
    ["context", `native ${pe.native_context}, max ${pe.max_context}`],
    ["tokens", `${usage.prompt_tokens} prompt + ${usage.completion_tokens} new (${end.finish_reason})`],
    ["timing", `queue ${timing.queue_ms.toFixed(1)} ms, prefill ${timing.prefill_ms.toFixed(1)} ms, decode ${timing.decode_ms.toFixed(1)} ms`],
  ];
}

async function fill(node, { configuration, request }, onError) {
  const text = node.querySelector(".column-text");
  const details = node.querySelector("dl");
  try {
    for await (const event of streamEvents("/generate", request)) {
      if ("token" in event) {
        text.textContent += event.text;
      } else {
        describe(details, summary(event));
        node.querySelector("h3").textContent = resolvedLabel(configuration, event.pe.attention);
      }
    }
    node.dataset.state = "done";
  } catch (error) {
    node.dataset.state = "error";
    describe(details, [["error", error.message]]);
    details.classList.add("error");
    onError(configuration, error);
  } finally {
    node.removeAttribute("aria-busy");
  }
}

// `runs`: [{configuration, request}], each configuration's /generate body; `onError(configuration,
// error)` hears of each column that failed. Resolves when every column has ended.
export async function compare(container, runs, onError = () => {}) {
  const columns = runs.map(({ configuration }) => column(configuration));
  container.replaceChildren(...columns);
  await Promise.all(runs.map((run, index) => fill(columns[index], run, onError)));
}
