// The sweep's grid, read from the page's two fields and checked before any request leaves: a list
// of lengths, and scalings in the CLI's notation (`pe-client sweep --scaling`), one per line:
// `none`, or `TYPE:key=value,key=value`, where `value1|value2|...` expands into one scaling each.

import { FIELDS, INTEGER_FIELDS } from "./scalings.js";

export class GridError extends Error {}

const MIN_LENGTH = 2; // bits per token are over tokens 2..L: one token has nothing to predict

function product(lists) {
  return lists.reduce((combos, list) => combos.flatMap((combo) => list.map((item) => [...combo, item])), [[]]);
}

function numberIn(raw, key, where) {
  const value = Number(raw.trim());
  if (raw.trim() === "" || !Number.isFinite(value)) throw new GridError(`${where}: ${key}=${raw} is not a number.`);
  if (INTEGER_FIELDS.has(key) && (!Number.isInteger(value) || value < 1)) {
    throw new GridError(`${where}: ${key} must be a whole number ≥ 1, got ${raw}.`);
  }
  if (key === "factor" && value < 1) throw new GridError(`${where}: factor must be ≥ 1, got ${raw}.`);
  return value;
}

// One line, `yarn:factor=2|4,beta_fast=32`, to its scalings ({type, factor: 2, beta_fast: 32}, ...).
function parseLine(line, where, supported) {
  const [type, params = ""] = line.split(/:(.*)/s).map((part) => part.trim());
  if (!(type in FIELDS)) {
    throw new GridError(`${where}: unknown scaling type "${type}" (known: ${Object.keys(FIELDS).join(", ")}).`);
  }
  if (!supported.includes(type)) throw new GridError(`${where}: this model does not support "${type}" scaling.`);
  const axes = [];
  for (const pair of params.split(",").filter((part) => part.trim() !== "")) {
    const [key, values] = pair.split(/=(.*)/s).map((part) => part.trim());
    if (!FIELDS[type].includes(key)) {
      const known = FIELDS[type].length ? FIELDS[type].join(", ") : "none";
      throw new GridError(`${where}: "${key}" is not a parameter of ${type} (its parameters: ${known}).`);
    }
    if (values === undefined) throw new GridError(`${where}: "${key}" has no value (write ${key}=2|4).`);
    axes.push(values.split("|").map((raw) => [key, numberIn(raw, key, where)]));
  }
  if (type !== "none" && !axes.some((axis) => axis[0][0] === "factor")) {
    throw new GridError(`${where}: ${type} needs a factor (e.g. ${type}:factor=2|4).`);
  }
  return product(axes).map((pairs) => ({ type, ...Object.fromEntries(pairs) }));
}

function sameScaling(a, b) {
  return JSON.stringify(a) === JSON.stringify(b);
}

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

// "yarn factor=4 beta_fast=16": the scaling as the page names it in legends and tables.
export function scalingLabel(scaling) {
  const params = Object.entries(scaling).filter(([key]) => key !== "type").map(([key, value]) => `${key}=${value}`);
  return [scaling.type, ...params].join(" ");
}
