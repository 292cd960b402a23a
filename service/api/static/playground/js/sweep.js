// Section 3: a sweep of lengths × configurations on one text, a configuration being a scaling and
// an attention rule (`pe_scaling` and `pe_attention`, every scaling crossed with every rule). The
// text is tokenized once (/tokenize); a (length L, configuration) cell holds what `pe-client sweep
// --json` reports (SPEC, "Context-extension lab"): bits per token over tokens 2..L, and over the
// tokens past the native context (null when L ≤ native), as the /score of the first L tokens gives
// them. The cells of one configuration are prefixes of one text, and every rule places a pair by
// its two text indices alone, so each configuration is scored once, at its longest length, and its
// shorter cells are read from that pass's log-probabilities; dynamic NTK and LongRoPE, whose
// positions depend on the total length, keep one /score per length. The passes go out together (at
// most PASSES_IN_FLIGHT), so the server batches them.

import { postJSON } from "./api.js";
import { GridError } from "./grid.js";
import { isStandard } from "./rules.js";

// Mean −log2 p of token_logprobs[from..length-1] (0-based); null over an empty range.
function meanBits(logprobs, from, length) {
  if (length <= from) return null;
  let nats = 0;
  for (let index = from; index < length; index += 1) nats -= logprobs[index];
  return nats / (length - from) / Math.LN2;
}

// The cell of the first `length` tokens of a /score of at least as many.
function cellOf(length, configuration, score, native) {
  return {
    length,
    configuration,
    tokens: length,
    bits_per_token: meanBits(score.token_logprobs, 1, length),
    tail_bits_per_token: meanBits(score.token_logprobs, native, length),
  };
}

// No scaling and the standard rule: the model as trained, what the reference is scored under.
const isAsTrained = ({ scaling, attention }) => scaling.type === "none" && isStandard(attention);
const AS_TRAINED = { scaling: { type: "none" }, attention: { type: "standard" }, label: "none" };

// Scalings whose positions depend on the sequence's total length: a long pass's prefix is not a short pass.
const LENGTH_DEPENDENT = new Set(["dynamic", "longrope"]);

// /score requests in flight at once: the server's default scoring places (--max-batch-size).
const PASSES_IN_FLIGHT = 16;

const CHARS_PER_TOKEN_GUESS = 8;

// The text's first `count` tokens as the server tokenizes a prompt (BOS first). Only a prefix of
// the text is sent, doubled until it yields a token more than needed (so the last one kept is not
// cut mid-word), so a pasted book never meets the server's body limit.
async function leadingTokens(model, text, count, signal) {
  for (let chars = count * CHARS_PER_TOKEN_GUESS; ; chars *= 2) {
    const { tokens } = await postJSON("/tokenize", { model: model.name, prompt: text.slice(0, chars) }, signal);
    if (tokens.length > count || chars >= text.length) return tokens.slice(0, count);
  }
}

// The /score passes the jobs need: each (length, configuration) job is read from one pass of its
// configuration, at the longest length asked of it, or, for a length-dependent scaling, from a pass
// of its own.
export function scorePasses(jobs) {
  const passes = [];
  const byConfiguration = new Map();
  for (const job of jobs) {
    const own = LENGTH_DEPENDENT.has(job.configuration.scaling.type);
    let pass = own ? undefined : byConfiguration.get(job.configuration);
    if (pass === undefined) {
      pass = { configuration: job.configuration, length: 0, jobs: [] };
      passes.push(pass);
      if (!own) byConfiguration.set(job.configuration, pass);
    }
    pass.length = Math.max(pass.length, job.length);
    pass.jobs.push(job);
  }
  return passes;
}

// `work` over every item, at most `limit` at once; results in item order. The first failure rejects.
async function boundedAll(items, limit, work) {
  const results = new Array(items.length);
  let next = 0;
  const worker = async () => {
    while (next < items.length) {
      const index = next++;
      results[index] = await work(items[index]);
    }
  };
  await Promise.all(Array.from({ length: Math.min(limit, items.length) }, worker));
  return results;
}

// `model`: the /models card; `lengths` sorted; `configurations`: [{scaling, attention, label}] with
// pe_scaling and pe_attention bodies; `onCell(done, total)` reports progress. The reference (no
// scaling, standard attention, over the first min(native, max_context, text) tokens) is one more
// cell when the grid does not hold it, read from the grid's pass under neither when it has one.
// The result keeps, per configuration, the rule the server echoed (`echoes`). A refused pass
// rejects with the server's error, its message led by the configuration's label; once `signal`
// fires, with an AbortError.
export async function runSweep({ model, text, lengths, configurations, signal, onCell }) {
  if (text === "") throw new GridError("Paste a text to sweep, or load the sample.");
  const longest = lengths.at(-1);
  const native = model.native_context;
  const tokens = await leadingTokens(model, text, Math.max(longest, Math.min(native, model.max_context)), signal);
  if (tokens.length < longest) {
    throw new GridError(
      `The text is ${tokens.length} tokens long, shorter than the longest length asked (${longest}): ` +
      "paste a longer text or drop the longer lengths.");
  }
  const referenceLength = Math.min(native, tokens.length);
  const jobs = lengths.flatMap((length) => configurations.map((configuration) => ({ length, configuration })));
  const inGrid = jobs.find((job) => job.length === referenceLength && isAsTrained(job.configuration));
  const asTrained = configurations.find(isAsTrained) ?? AS_TRAINED;
  const referenceJob = inGrid ?? { length: referenceLength, configuration: asTrained };
  const all = inGrid ? jobs : [...jobs, referenceJob];
  const cells = new Map(); // job -> cell
  const echoes = new Map(); // configuration -> the pe_attention the server resolved
  onCell(0, all.length);
  await boundedAll(scorePasses(all), PASSES_IN_FLIGHT, async (pass) => {
    const { scaling, attention, label } = pass.configuration;
    const body = { model: model.name, tokens: tokens.slice(0, pass.length), pe_scaling: scaling, pe_attention: attention };
    let score;
    try {
      score = await postJSON("/score", body, signal);
    } catch (error) {
      if (error.name !== "AbortError") error.message = `${label}: ${error.message}`;
      throw error;
    }
    echoes.set(pass.configuration, score.pe?.attention ?? null);
    for (const job of pass.jobs) cells.set(job, cellOf(job.length, job.configuration, score, native));
    onCell(cells.size, all.length);
  });
  const reference = cells.get(referenceJob);
  return {
    model: model.name, native, lengths, configurations,
    echoes: configurations.map((configuration) => echoes.get(configuration)),
    cells: jobs.map((job) => cells.get(job)),
    reference,
  };
}

// Where each configuration breaks: the first swept length L ≥ the reference's whose bits per token
// exceed the reference's by more than `threshold` (null: it held at every length judged).
export function breakPoints(sweep, threshold) {
  const limit = sweep.reference.bits_per_token + threshold;
  return sweep.configurations.map((configuration) => {
    const judged = sweep.cells.filter(
      (cell) => cell.configuration === configuration && cell.length >= sweep.reference.length);
    const broken = judged.find((cell) => cell.bits_per_token > limit);
    const { scaling, attention, label } = configuration;
    return { scaling, attention, label, breaks_at: broken?.length ?? null, judged: judged.length };
  });
}
