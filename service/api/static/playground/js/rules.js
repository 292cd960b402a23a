// Attention rules (`pe_attention`) as the page writes them: each type's fields, the defaults the
// page fills in from the model's context, labels, and the (scaling, rule) configurations that the
// sections run. The server checks every range; its 422 names `pe_attention.<field>`.

import { scalingLabel } from "./grid.js";

// The fields of each type (SPEC, "Attention-level extension methods"), `logn` aside: any type takes it.
export const RULE_FIELDS = {
  standard: [],
  self_extend: ["group_size", "window"],
  rerope: ["window"],
  leaky_rerope: ["window", "leak"],
  dca: ["chunk_size", "local_window"],
  streaming: ["sink_tokens", "window"],
};
export const RULE_TYPES = Object.keys(RULE_FIELDS);
export const LOGN = "logn";
// Every field is a whole number but Leaky ReRoPE's leak.
export const FRACTIONAL_FIELDS = new Set(["leak"]);

const STREAMING_SINKS = 4;
const SELF_EXTEND_GROUP = 4;

// Defaults from the model's native context N (and max_context M), so a rule keeps every position
// it reads inside what the model was trained on: Self-Extend's neighbour window N/4 with groups of
// 4; ReRoPE's window N/2; Leaky ReRoPE's window N/2 and a leak such that a key at distance M lands
// within N (for the window `given`, when it sets one); DCA's chunks of 3N/4 overlapping by N/16
// (ChunkLlama's proportions); StreamingLLM's 4 sinks and a window that fills the N cache slots
// (S + W + 1 = N).
export function ruleDefaults(type, model, given = {}) {
  const native = model.native_context;
  const half = Math.max(1, Math.floor(native / 2));
  switch (type) {
    case "self_extend":
      return { group_size: SELF_EXTEND_GROUP, window: Math.max(1, Math.floor(native / 4)) };
    case "rerope":
      return { window: half };
    case "leaky_rerope": {
      const window = given.window ?? half;
      const reach = Math.max(native - window, 1);
      return { window: half, leak: Math.max(2, Math.ceil((model.max_context - window) / reach)) };
    }
    case "dca": {
      const chunk = Math.max(2, Math.floor((native * 3) / 4));
      return { chunk_size: chunk, local_window: Math.min(chunk - 1, Math.floor(native / 16)) };
    }
    case "streaming":
      return { sink_tokens: STREAMING_SINKS, window: Math.max(1, native - STREAMING_SINKS - 1) };
    default:
      return {};
  }
}

// The rule with every field it leaves out taken from `ruleDefaults` (`logn` stays optional), in
// the SPEC's field order: {type, ...fields, logn?}.
export function completeRule(rule, model) {
  const defaults = ruleDefaults(rule.type, model, rule);
  const complete = { type: rule.type };
  for (const field of RULE_FIELDS[rule.type] ?? []) complete[field] = rule[field] ?? defaults[field];
  if (rule.logn !== undefined) complete.logn = rule.logn;
  return complete;
}

// `standard` with no log-n: the model as trained.
export function isStandard(rule) {
  return rule.type === "standard" && rule.logn === undefined;
}

// The lab's label: `standard`, `self_extend (group_size=4,window=64)`, `rerope (window=128,logn=256)`.
export function ruleLabel(rule) {
  return scalingLabel(rule);
}

// Every scaling crossed with every rule, scalings outer (the lab's order). A configuration's label
// is its scaling's (`scalingName`), joined by ` + ` to its rule's whenever a rule other than plain
// `standard` is in play (`namesRule`; so the default, standard attention only, reads as before).
export function configurations(scalings, rules, scalingName = scalingLabel) {
  const namesRule = rules.some((rule) => !isStandard(rule));
  return scalings.flatMap((scaling) => rules.map((attention) => {
    const configuration = { scaling, attention, namesRule, scalingName };
    return { ...configuration, label: resolvedLabel(configuration, attention) };
  }));
}

// A configuration's label with the rule the server echoed (`pe.attention`) in place of the one sent.
export function resolvedLabel(configuration, echoed) {
  const { scaling, attention, namesRule, scalingName = scalingLabel } = configuration;
  const name = scalingName(scaling);
  return namesRule ? `${name} + ${ruleLabel(echoed ?? attention)}` : name;
}
