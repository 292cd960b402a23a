// Calls to the pe-serve API from the page: the key kept for the browser session, the SPEC's error
// body turned into an exception, and the /generate event stream read as it arrives.

const KEY_STORAGE = "pe-serve-api-key";

export function apiKey() {
  return sessionStorage.getItem(KEY_STORAGE) || "";
}

export function setApiKey(key) {
  if (key) sessionStorage.setItem(KEY_STORAGE, key);
  else sessionStorage.removeItem(KEY_STORAGE);
}

export class APIError extends Error {
  constructor(status, error) {
    super(error.param ? `${error.message} (${error.param})` : error.message);
    this.status = status;
    this.type = error.type;
    this.param = error.param;
  }
}

function headers(json) {
  const result = json ? { "Content-Type": "application/json" } : {};
  const key = apiKey();
  if (key) result.Authorization = `Bearer ${key}`;
  return result;
}

async function failure(response) {
  let body = null;
  try {
    body = await response.json();
  } catch {
    // Not the SPEC's JSON error (a proxy's page, say): report the status alone.
  }
  return new APIError(response.status, body?.error ?? { type: "http_error", message: `HTTP ${response.status}` });
}

async function send(path, init) {
  const response = await fetch(path, init);
  if (!response.ok) throw await failure(response);
  return response;
}

export async function getJSON(path) {
  return (await send(path, { headers: headers(false) })).json();
}

// `signal` (an AbortController's) cancels the call; the server then drops the request's work.
export async function postJSON(path, body, signal = undefined) {
  const init = { method: "POST", headers: headers(true), body: JSON.stringify(body), signal };
  return (await send(path, init)).json();
}

// Yields each `data:` payload of a streamed /generate until `[DONE]`; an error event throws.
export async function* streamEvents(path, body) {
  const init = { method: "POST", headers: headers(true), body: JSON.stringify({ ...body, stream: true }) };
  const response = await send(path, init);
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const payload = line.slice("data: ".length);
        if (payload === "[DONE]") return;
        const data = JSON.parse(payload);
        if (data.error) throw new APIError(response.status, data.error);
        yield data;
      }
    }
  }
}
