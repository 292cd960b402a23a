// Settings in the address bar, so a link reproduces the page: every control marked `data-url`
// is written to the query string when it changes and read back when the page loads.

function controls() {
  return document.querySelectorAll("[data-url]");
}

function valueOf(control) {
  if (control.type === "checkbox") return control.checked ? "1" : "0";
  return control.value;
}

export function restoreFromURL() {
  const params = new URLSearchParams(window.location.search);
  for (const control of controls()) {
    const value = params.get(control.dataset.url);
    if (value === null) continue;
    if (control.type === "checkbox") control.checked = value === "1";
    else control.value = value;
  }
}

// A select filled later (the model list) takes its value from the URL once its options exist.
export function urlValue(name) {
  return new URLSearchParams(window.location.search).get(name);
}

export function saveToURL() {
  const params = new URLSearchParams();
  for (const control of controls()) params.set(control.dataset.url, valueOf(control));
  window.history.replaceState(null, "", `${window.location.pathname}?${params}`);
}

export function watchControls() {
  document.addEventListener("change", (event) => {
    if (event.target.matches?.("[data-url]")) saveToURL();
  });
}
