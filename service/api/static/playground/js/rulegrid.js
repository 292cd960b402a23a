// The sweep's attention rules, read from their field: one per line in the notation of `pe-client
// sweep --attention`, `standard` or `TYPE:key=value,key=value`, where `value1|value2|...`
// expands into one rule each. A field left out takes the default the model's context gives
// (`ruleDefaults`). Checked here: known types and keys, numbers, types the model supports; the
// server checks the ranges (its 422, naming `pe_attention.<field>`, ends the sweep with its message).

import { GridError, product } from "./grid.js";
import { LOGN, RULE_FIELDS, completeRule } from "./rules.js";

function numberOf(raw, key, where) {
  const value = Number(raw);
  if (raw === "" || !Number.isFinite(value)) throw new GridError(`${where}: ${key}=${raw} is not a number.`);
  return value;
}

function parseLine(line, where, model) {
  const [type, params = ""] = line.split(/:(.*)/s).map((part) => part.trim());
  if (!Object.hasOwn(RULE_FIELDS, type)) {
    throw new GridError(`${where}: unknown attention type "${type}" (known: ${Object.keys(RULE_FIELDS).join(", ")}).`);
  }
  const supported = model.supported_attention ?? ["standard"];
  if (!supported.includes(type)) {
    throw new GridError(`${where}: this model does not take ${type} attention (it takes ${supported.join(", ")}).`);
  }
  const fields = [...RULE_FIELDS[type], LOGN];
  const axes = new Map();
  for (const pair of params.split(",").map((part) => part.trim()).filter((part) => part !== "")) {
    const [key, values] = pair.split(/=(.*)/s).map((part) => part.trim());
    if (!fields.includes(key)) {
      throw new GridError(`${where}: "${key}" is not a parameter of ${type} attention (its parameters: ${fields.join(", ")}).`);
    }
    if (!values) throw new GridError(`${where}: "${key}" has no value (write ${key}=64|128).`);
    if (axes.has(key)) throw new GridError(`${where}: "${key}" is given twice (write ${key}=64|128 for both).`);
    axes.set(key, values.split("|").map((raw) => [key, numberOf(raw.trim(), key, where)]));
  }
  return product([...axes.values()]).map((pairs) => completeRule({ type, ...Object.fromEntries(pairs) }, model));
}

// Every rule the lines name, in order, each once; no line at all: `standard`.
export function parseRules(text, model) {
  const rules = [];
  text.split("\n").forEach((line, index) => {
    if (line.trim() === "") return;
    for (const rule of parseLine(line.trim(), `Attention line ${index + 1}`, model)) {
      if (!rules.some((seen) => JSON.stringify(seen) === JSON.stringify(rule))) rules.push(rule);
    }
  });
  return rules.length > 0 ? rules : [{ type: "standard" }];
}
