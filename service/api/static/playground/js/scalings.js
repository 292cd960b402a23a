// The scaling editor: one row per scaling type (a checkbox and its parameters) and the
// `pe_scaling` bodies built from it. A blank parameter is left out, so the server applies its
// default (original_max_position_embeddings: the model's native context).

const FIELDS = {
  none: [],
  linear: ["factor"],
  ntk: ["factor"],
  dynamic: ["factor", "original_max_position_embeddings"],
  yarn: ["factor", "original_max_position_embeddings", "beta_fast", "beta_slow"],
  llama3: ["factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"],
};

const FIELD_INPUT = {
  factor: { label: "factor", value: "4", min: "1", step: "0.5" },
  original_max_position_embeddings: { label: "orig. ctx", value: "", min: "1", step: "1" },
  beta_fast: { label: "β fast", value: "32", min: "0", step: "1" },
  beta_slow: { label: "β slow", value: "1", min: "0", step: "0.5" },
  low_freq_factor: { label: "low", value: "1", min: "0", step: "0.5" },
  high_freq_factor: { label: "high", value: "4", min: "0", step: "0.5" },
};

const INTEGER_FIELDS = new Set(["original_max_position_embeddings"]);

export const SCALING_TYPES = Object.keys(FIELDS);
const DEFAULT_TICKED = new Set(["none", "linear", "yarn"]);

function element(tag, attributes = {}, text = "") {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attributes)) node.setAttribute(name, value);
  if (text) node.textContent = text;
  return node;
}

export function buildScalingEditor(fieldset) {
  for (const type of SCALING_TYPES) {
    const row = element("div", { class: "scaling" });
    const box = element("input", { type: "checkbox", id: `use-${type}`, "data-url": `scaling.${type}` });
    box.checked = DEFAULT_TICKED.has(type);
    row.append(element("label", { for: `use-${type}` }, type));
    row.firstChild.prepend(box);
    for (const field of FIELDS[type]) {
      const spec = FIELD_INPUT[field];
      const id = `${type}-${field}`;
      row.append(element("label", { for: id }, spec.label));
      const input = element("input", { type: "number", id, min: spec.min, step: spec.step, "data-url": `${type}.${field}` });
      input.value = spec.value;
      input.setAttribute("aria-label", `${type} ${field}`);
      row.append(input);
    }
    fieldset.append(row);
  }
}

// Grey out the scalings the chosen model's scheme cannot run (its /models card lists them).
export function limitToSupported(supported) {
  for (const type of SCALING_TYPES) {
    const box = document.getElementById(`use-${type}`);
    box.disabled = !supported.includes(type);
    if (box.disabled) box.checked = false;
  }
}

export function scalingBody(type) {
  const body = { type };
  for (const field of FIELDS[type]) {
    const raw = document.getElementById(`${type}-${field}`).value.trim();
    if (raw === "") continue;
    body[field] = INTEGER_FIELDS.has(field) ? parseInt(raw, 10) : parseFloat(raw);
  }
  return body;
}

export function tickedScalings() {
  return SCALING_TYPES.filter((type) => {
    const box = document.getElementById(`use-${type}`);
    return box.checked && !box.disabled;
  });
}
