// Section 3: a sweep of lengths × scalings on one text. The text is tokenized once (/tokenize); a
// (length L, scaling) cell holds what `pe-client sweep --json` reports (SPEC, "Context-extension
// lab"): bits per token over tokens 2..L, and over the tokens past the native context (null when
// L ≤ native), as the /score of the first L tokens gives them. The cells of one scaling are prefixes
// of one text, so each scaling is scored once, at its longest length, and its shorter cells are read
// from that pass's log-probabilities; dynamic NTK and LongRoPE, whose positions depend on the total
// length, keep one /score per length. The passes go out together (at most PASSES_IN_FLIGHT), so the
// server batches them.

import { postJSON } from "./api.js";
import { GridError } from "./grid.js";

// Mean −log2 p of token_logprobs[from..length-1] (0-based); null over an empty range.
function meanBits(logprobs, from, length) {
  if (length <= from) return null;
  let nats = 0;
  for (let index = from; index < length; index += 1) nats -= logprobs[index];
  return nats / (length - from) / Math.LN2;
}

// The cell of the first `length` tokens of a /score of at least as many.
function cellOf(length, scaling, score, native) {
  return {
    length,
    scaling,
    tokens: length,
    bits_per_token: meanBits(score.token_logprobs, 1, length),
    tail_bits_per_token: meanBits(score.token_logprobs, native, length),
  };
}

const isUnscaled = (scaling) => scaling.type === "none";

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

// The /score passes the jobs need: each (length, scaling) job is read from one pass of its scaling,
// at the longest length asked of it, or, for a length-dependent scaling, from a pass of its own.
export function scorePasses(jobs) {
  const passes = [];
  const byScaling = new Map();
  for (const job of jobs) {
    let pass = LENGTH_DEPENDENT.has(job.scaling.type) ? undefined : byScaling.get(job.scaling);
    if (pass === undefined) {
      pass = { scaling: job.scaling, length: 0, jobs: [] };
      passes.push(pass);
      if (!LENGTH_DEPENDENT.has(job.scaling.type)) byScaling.set(job.scaling, pass);
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

// `model`: the /models card; `lengths` sorted; `scalings`: pe_scaling bodies; `onCell(done, total)`
// reports progress. The reference (no scaling over the first min(native, max_context, text)
// tokens) is one more cell when the grid does not hold it, read from the grid's unscaled pass when
// it has one. Rejects with an AbortError once `signal` fires.
export async function runSweep({ model, text, lengths, scalings, signal, onCell }) {
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
  const jobs = lengths.flatMap((length) => scalings.map((scaling) => ({ length, scaling })));
  const inGrid = jobs.find((job) => job.length === referenceLength && isUnscaled(job.scaling));
  const unscaled = scalings.find(isUnscaled);
  const referenceJob = inGrid ?? { length: referenceLength, scaling: unscaled ?? { type: "none" } };
  const all = inGrid ? jobs : [...jobs, referenceJob];
  const cells = new Map(); // job -> cell
  onCell(0, all.length);
  await boundedAll(scorePasses(all), PASSES_IN_FLIGHT, async (pass) => {
    const body = { model: model.name, tokens: tokens.slice(0, pass.length), pe_scaling: pass.scaling };
    const score = await postJSON("/score", body, signal);
    for (const job of pass.jobs) cells.set(job, cellOf(job.length, job.scaling, score, native));
    onCell(cells.size, all.length);
  });
  const reference = cells.get(referenceJob);
  return { model: model.name, native, lengths, scalings, cells: jobs.map((job) => cells.get(job)), reference };
}

// Where each scaling breaks: the first swept length L ≥ the reference's whose bits per token exceed
// the reference's by more than `threshold` (null: it held at every length judged).
export function breakPoints(sweep, threshold) {
  const limit = sweep.reference.bits_per_token + threshold;
  return sweep.scalings.map((scaling) => {
    const judged = sweep.cells.filter((cell) => cell.scaling === scaling && cell.length >= sweep.reference.length);
    const broken = judged.find((cell) => cell.bits_per_token > limit);
    return { scaling, breaks_at: broken?.length ?? null, judged: judged.length };
  });
}
