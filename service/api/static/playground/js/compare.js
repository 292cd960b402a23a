// Section 1: one streamed /generate per ticked scaling, all sent at once so the server batches
// them together; each column fills in as its tokens arrive and ends with the resolved `pe` block.

import { streamEvents } from "./api.js";

function column(type) {
  const node = document.createElement("article");
  node.className = "column";
  node.id = `column-${type}`;
  node.dataset.scaling = type;
  node.dataset.state = "running";
  node.setAttribute("aria-busy", "true");
  const title = document.createElement("h3");
  title.textContent = type;
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
    details.append(term, description);
  }
}

function summary(end) {
  const { pe, timing, usage } = end;
  return [
    ["scaling", JSON.stringify(pe.scaling)],
    ["attention factor", pe.attention_factor.toFixed(4)],
    ["context", `native ${pe.native_context}, max ${pe.max_context}`],
    ["tokens", `${usage.prompt_tokens} prompt + ${usage.completion_tokens} new (${end.finish_reason})`],
    ["timing", `queue ${timing.queue_ms.toFixed(1)} ms, prefill ${timing.prefill_ms.toFixed(1)} ms, decode ${timing.decode_ms.toFixed(1)} ms`],
  ];
}

async function fill(node, request) {
  const text = node.querySelector(".column-text");
  const details = node.querySelector("dl");
  try {
    for await (const event of streamEvents("/generate", request)) {
      if ("token" in event) text.textContent += event.text;
      else describe(details, summary(event));
    }
    node.dataset.state = "done";
  } catch (error) {
    node.dataset.state = "error";
    describe(details, [["error", error.message]]);
    details.classList.add("error");
  } finally {
    node.removeAttribute("aria-busy");
  }
}

// `requests` maps each scaling type to its /generate body; resolves when every column has ended.
export async function compare(container, requests) {
  const columns = requests.map(([type]) => column(type));
  container.replaceChildren(...columns);
  await Promise.all(requests.map(([, request], index) => fill(columns[index], request)));
}
