// The sweep's grid, read from the page's two fields and checked before any request leaves: a list
// of lengths, and scalings in the notation of `pe-client sweep --scaling`, one per line: `none`,
// or `TYPE:key=value,key=value`, where `value1|value2|...` expands into one scaling each. The
// checks are the CLI's: known types and keys, factor ≥ 1, other numbers finite and positive,
// lengths in 2..max_context, types the model supports; the server checks the rest (its 422 shows).

export class GridError extends Error {}

const MIN_LENGTH = 2; // bits per token are over tokens 2..L: one token has nothing to predict

// Every `pe_scaling` field a grid line may set, by type, with the kind of value it takes. LongRoPE
// is absent: its per-frequency lists have no notation here.
const NUMBER = "number";
const INTEGER = "integer";
const BOOLEAN = "boolean";
const ORIGINAL = { original_max_position_embeddings: INTEGER };
const GRID_FIELDS = {
  none: {},
  linear: { factor: NUMBER },
  ntk: { factor: NUMBER },
  dynamic: { factor: NUMBER, ...ORIGINAL, dynamic_mode: ["bucketed", "hf"] },
  yarn: {
    factor: NUMBER, ...ORIGINAL, beta_fast: NUMBER, beta_slow: NUMBER, mscale: NUMBER, mscale_all_dim: NUMBER,
    attention_factor: NUMBER, truncate: BOOLEAN,
  },
  llama3: { factor: NUMBER, ...ORIGINAL, low_freq_factor: NUMBER, high_freq_factor: NUMBER },
};
// YaRN derives its factor from the lengths when none is given; these types cannot.
const NEED_FACTOR = new Set(["linear", "ntk", "dynamic", "llama3"]);
const SHORT_KEYS = { original_max_position_embeddings: "orig" };

// Every combination of one item from each list, in order.
export function product(lists) {
  return lists.reduce((combos, list) => combos.flatMap((combo) => list.map((item) => [...combo, item])), [[]]);
}

function valueOf(raw, key, kind, where) {
  if (Array.isArray(kind)) {
    if (!kind.includes(raw)) throw new GridError(`${where}: ${key} must be one of ${kind.join(", ")}, got "${raw}".`);
    return raw;
  }
  if (kind === BOOLEAN) {
    if (raw !== "true" && raw !== "false") throw new GridError(`${where}: ${key} must be true or false, got "${raw}".`);
    return raw === "true";
  }
  const value = Number(raw);
  if (raw === "" || !Number.isFinite(value)) throw new GridError(`${where}: ${key}=${raw} is not a number.`);
  if (key === "factor" && value < 1) throw new GridError(`${where}: factor must be ≥ 1, got ${raw}.`);
  if (kind === INTEGER && !Number.isInteger(value)) throw new GridError(`${where}: ${key} must be a whole number, got ${raw}.`);
  if (value < 0 || (value === 0 && key !== "mscale")) {
    throw new GridError(`${where}: ${key} must be a positive number, got ${raw}.`);
  }
  return value;
}

// One line, `yarn:factor=2|4,beta_fast=32`, to its scalings ({type, factor: 2, beta_fast: 32}, ...).
function parseLine(line, where, supported) {
  const [type, params = ""] = line.split(/:(.*)/s).map((part) => part.trim());
  if (!Object.hasOwn(GRID_FIELDS, type)) {
    throw new GridError(`${where}: unknown scaling type "${type}" (known: ${Object.keys(GRID_FIELDS).join(", ")}).`);
  }
  const fields = GRID_FIELDS[type];
  if (!supported.includes(type)) {
    throw new GridError(`${where}: this model does not take ${type} scaling (it takes ${supported.join(", ")}).`);
  }
  const axes = new Map();
  for (const pair of params.split(",").map((part) => part.trim()).filter((part) => part !== "")) {
    const [key, values] = pair.split(/=(.*)/s).map((part) => part.trim());
    if (!Object.hasOwn(fields, key)) {
      const known = Object.keys(fields).join(", ") || "none";
      throw new GridError(`${where}: "${key}" is not a parameter of ${type} (its parameters: ${known}).`);
    }
    if (!values) throw new GridError(`${where}: "${key}" has no value (write ${key}=2|4).`);
    if (axes.has(key)) throw new GridError(`${where}: "${key}" is given twice (write ${key}=2|4 for both).`);
    axes.set(key, values.split("|").map((raw) => [key, valueOf(raw.trim(), key, fields[key], where)]));
  }
  if (NEED_FACTOR.has(type) && !axes.has("factor")) {
    throw new GridError(`${where}: ${type} needs a factor (e.g. ${type}:factor=2|4).`);
  }
  return product([...axes.values()]).map((pairs) => ({ type, ...Object.fromEntries(pairs) }));
}

function sameScaling(a, b) {
  return JSON.stringify(a) === JSON.stringify(b);
}

// Every scaling the lines name, in order, each once.
export function parseScalings(text, supported) {
  const scalings = [];
  text.split("\n").forEach((line, index) => {
    if (line.trim() === "") return;
    for (const scaling of parseLine(line.trim(), `Scaling line ${index + 1}`, supported)) {
      if (!scalings.some((seen) => sameScaling(seen, scaling))) scalings.push(scaling);
    }
  });
  if (scalings.length === 0) throw new GridError("Give at least one scaling (e.g. none).");
  return scalings;
}

// "256, 512,1024" to [256, 512, 1024], each in 2..max_context; sorted, repeats dropped.
export function parseLengths(text, maxContext) {
  const parts = text.split(/[\s,]+/).filter((part) => part !== "");
  if (parts.length === 0) throw new GridError("Give at least one length (e.g. 128, 256, 512).");
  const lengths = parts.map((part) => {
    const length = Number(part);
    if (!Number.isInteger(length) || length < MIN_LENGTH) {
      throw new GridError(`Length "${part}" must be a whole number of tokens ≥ ${MIN_LENGTH}.`);
    }
    if (length > maxContext) {
      throw new GridError(`Length ${length} is above the model's max_context (${maxContext} tokens).`);
    }
    return length;
  });
  return [...new Set(lengths)].sort((a, b) => a - b);
}

// The CLI's label: `none`, `yarn x4`, then any other field, `yarn x4 (orig=256,beta_fast=16)`.
export function scalingLabel(scaling) {
  const { type, factor, ...rest } = scaling;
  const extras = Object.entries(rest).map(([key, value]) => `${SHORT_KEYS[key] ?? key}=${value}`).join(",");
  const name = factor === undefined ? type : `${type} x${factor}`;
  return extras ? `${name} (${extras})` : name;
}
