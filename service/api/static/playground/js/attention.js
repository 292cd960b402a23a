// The attention rule editor: one row per `pe_attention` type (a checkbox, its fields and an
// optional log-n), only the types the chosen model's card lists shown. A blank field takes the
// default derived from the model's context, shown as its placeholder; a blank log-n is off. The
// server's 422 for a rule (`param`: `pe_attention.<field>`) is shown beside that field.

import { FRACTIONAL_FIELDS, LOGN, RULE_FIELDS, RULE_TYPES, completeRule, ruleDefaults } from "./rules.js";

const FIELD_LABELS = {
  group_size: ["group", "group_size G: keys past the window share a position per G"],
  window: ["window", "window: the keys nearest the query, at their exact positions"],
  leak: ["leak", "leak k: past the window, distance grows 1/k per token"],
  chunk_size: ["chunk", "chunk_size s"],
  local_window: ["local", "local_window l < s: chunks advance by s − l"],
  sink_tokens: ["sinks", "sink_tokens S: the first keys, always seen"],
  [LOGN]: ["log-n", "logn L (Qwen's log-n attention): queries past position L sharpened by ln(i + 1) / ln L; blank: off"],
};
const DEFAULT_TICKED = new Set(["standard"]);
const TYPE = "type"; // a 422 on the type itself is shown beside its checkbox

const byId = (id) => document.getElementById(id);
let offeredFor = null; // the model whose rules are offered
const inputId = (type, field) => `attention-${type}-${field}`;
const errorId = (type, field) => `${inputId(type, field)}-error`;

function element(tag, attributes = {}, text = "") {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attributes)) node.setAttribute(name, value);
  if (text) node.textContent = text;
  return node;
}

function errorSlot(type, field) {
  return element("span", { id: errorId(type, field), class: "field-error", role: "alert" });
}

function fieldInput(type, field) {
  const [label, title] = FIELD_LABELS[field];
  const id = inputId(type, field);
  const input = element("input", {
    type: "number", id, min: field === LOGN ? "2" : "0", step: FRACTIONAL_FIELDS.has(field) ? "0.5" : "1",
    title, "aria-label": `${type} ${field}`, "aria-describedby": errorId(type, field), "data-url": `attention.${type}.${field}`,
  });
  input.addEventListener("input", () => {
    clearError(type, field);
    showDefaults(type);
  });
  return [element("label", { for: id, title }, label), input, errorSlot(type, field)];
}

export function buildRuleEditor(fieldset) {
  for (const type of RULE_TYPES) {
    const row = element("div", { class: "scaling rule", id: `rule-${type}`, "data-rule": type });
    const box = element("input", { type: "checkbox", id: `use-attention-${type}`, "data-url": `attention.${type}` });
    box.checked = DEFAULT_TICKED.has(type);
    const name = element("label", { for: box.id }, type);
    name.prepend(box);
    row.append(name, errorSlot(type, TYPE));
    for (const field of [...RULE_FIELDS[type], LOGN]) row.append(...fieldInput(type, field));
    fieldset.append(row);
  }
}

// The fields typed in `type`'s row (blank ones left out).
function typed(type) {
  const rule = { type };
  for (const field of [...RULE_FIELDS[type], LOGN]) {
    const raw = byId(inputId(type, field)).value.trim();
    if (raw !== "") rule[field] = Number(raw); // as typed: the server says what it refuses
  }
  return rule;
}

// Each blank field's placeholder: the default it takes (given the fields typed beside it).
function showDefaults(type) {
  if (!offeredFor) return;
  const defaults = ruleDefaults(type, offeredFor, typed(type));
  for (const field of RULE_FIELDS[type]) byId(inputId(type, field)).placeholder = String(defaults[field]);
  const logn = byId(inputId(type, LOGN));
  logn.placeholder = "off";
  logn.title = `${FIELD_LABELS[LOGN][1]}; e.g. ${offeredFor.native_context}, the native context`;
}

// Offer only the types the model's card lists (`supported_attention`), with the defaults its
// context gives.
export function offerSupported(model) {
  offeredFor = model;
  const supported = model.supported_attention ?? ["standard"];
  for (const type of RULE_TYPES) {
    const offered = supported.includes(type);
    const box = byId(`use-attention-${type}`);
    byId(`rule-${type}`).hidden = !offered;
    box.disabled = !offered;
    if (!offered) box.checked = false;
    showDefaults(type);
  }
}

// The `pe_attention` body of each ticked, offered type, blanks filled from `model`.
export function tickedRules(model) {
  return RULE_TYPES.filter((type) => {
    const box = byId(`use-attention-${type}`);
    return box.checked && !box.disabled;
  }).map((type) => completeRule(typed(type), model));
}

function clearError(type, field) {
  const slot = byId(errorId(type, field));
  if (slot) slot.textContent = "";
  byId(inputId(type, field))?.removeAttribute("aria-invalid");
}

export function clearRuleErrors() {
  for (const type of RULE_TYPES) for (const field of [TYPE, ...RULE_FIELDS[type], LOGN]) clearError(type, field);
}

// Shows a request's error beside the field of `type`'s row that its `param` names (a field the
// row lacks: beside the type); false when the error is not about `pe_attention`.
export function showRuleError(type, error) {
  const prefix = "pe_attention.";
  if (!error.param?.startsWith(prefix) || !RULE_FIELDS[type]) return false;
  const named = error.param.slice(prefix.length);
  const field = [...RULE_FIELDS[type], LOGN].includes(named) ? named : TYPE;
  byId(errorId(type, field)).textContent = error.message;
  byId(inputId(type, field))?.setAttribute("aria-invalid", "true");
  return true;
}
