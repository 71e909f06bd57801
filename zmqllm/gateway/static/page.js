"use strict";
// What both pages share: the API key (asked for after a 401, kept in this tab's
// sessionStorage), the gateway's JSON error messages, the notice line, the model name.
const page = (() => {
  const KEY = "zmqllm-api-key";
  const $ = (id) => document.getElementById(id);

  function headers(extra) {
    const all = Object.assign({}, extra);
    const key = sessionStorage.getItem(KEY);
    if (key) all.Authorization = `Bearer ${key}`;
    return all;
  }

  async function errorText(response) {
    let message = `${response.status} ${response.statusText}`;
    try {
      const body = await response.json();
      if (body && body.error && body.error.message) message = body.error.message;
    } catch (ignored) {
      // Not JSON (a proxy's page): the status line says enough.
    }
    if (response.status === 401) {
      $("key-row").hidden = false;
      $("api-key").focus();
    }
    return message;
  }

  function notice(text) {
    $("notice").textContent = text;
  }

  async function showModel() {
    try {
      const response = await fetch("/v1/models", { headers: headers() });
      if (response.ok) $("model").textContent = (await response.json()).data[0].id;
    } catch (ignored) {
      // The gateway is down: the page's own requests say so.
    }
  }

  function init() {
    const input = $("api-key");
    input.value = sessionStorage.getItem(KEY) || "";
    input.addEventListener("change", () => {
      sessionStorage.setItem(KEY, input.value.trim());
      notice("API key set");
      showModel();
    });
    showModel();
  }

  return { $, headers, errorText, notice, init };
})();
