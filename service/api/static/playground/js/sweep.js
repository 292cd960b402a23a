// Section 3: a sweep of lengths × scalings on one text. The text is tokenized once (/tokenize);
// each (length L, scaling) cell is the /score of its first L tokens. Every cell is sent at once, so
// the server batches whatever is in flight together. A cell holds what `pe-client sweep --json`
// reports (SPEC, "Context-extension lab"): bits per token over tokens 2..L, and over the tokens
// past the native context (null when L ≤ native).

import { postJSON } from "./api.js";
import { GridError } from "./grid.js";

// Mean −log2 p of token_logprobs[from..length-1] (0-based); null over an empty range.
function meanBits(logprobs, from, length) {
  if (length <= from) return null;
  let nats = 0;
  for (let index = from; index < length; index += 1) nats -= logprobs[index];
  return nats / (length - from) / Math.LN2;
}

function cellOf(length, scaling, score, native) {
  return {
    length,
    scaling,
    tokens: score.num_tokens,
    bits_per_token: meanBits(score.token_logprobs, 1, length),
    tail_bits_per_token: meanBits(score.token_logprobs, native, length),
  };
}

const isUnscaled = (scaling) => scaling.type === "none";

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

// `model`: the /models card; `lengths` sorted; `scalings`: pe_scaling bodies; `onCell(done, total)`
// reports progress. The reference (no scaling over the first min(native, max_context, text)
// tokens) is scored as one more cell when the grid does not hold it. Rejects with an AbortError
// once `signal` fires.
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
  const referenceJob = inGrid ?? { length: referenceLength, scaling: { type: "none" } };
  const all = inGrid ? jobs : [...jobs, referenceJob];
  let done = 0;
  onCell(done, all.length);
  const cells = await Promise.all(all.map(async (job) => {
    const body = { model: model.name, tokens: tokens.slice(0, job.length), pe_scaling: job.scaling };
    const score = await postJSON("/score", body, signal);
    onCell(++done, all.length);
    return cellOf(job.length, job.scaling, score, native);
  }));
  const reference = cells[all.indexOf(referenceJob)];
  return { model: model.name, native, lengths, scalings, cells: cells.slice(0, jobs.length), reference };
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
