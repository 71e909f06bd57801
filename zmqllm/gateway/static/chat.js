"use strict";
// The chat page: the whole conversation goes to /v1/chat/completions with every turn
// (stream: true); the reply grows as its tokens arrive. Stop aborts the request: the
// gateway sees the connection close and cancels the session on the workers.
(() => {
  const { $ } = page;
  const history = []; // {role, content}, as the API takes them
  let controller = null; // the running request's, while one runs

  function addMessage(role, text) {
    const item = document.createElement("li");
    item.className = `message ${role}`;
    const who = document.createElement("span");
    who.className = "who";
    who.textContent = role === "user" ? "You" : "Model";
    const body = document.createElement("div");
    body.className = "text";
    body.textContent = text;
    const meta = document.createElement("div");
    meta.className = "meta";
    item.append(who, body, meta);
    $("messages").append(item);
    item.scrollIntoView({ block: "end" });
    return { item, body, meta };
  }

  function setBusy(busy) {
    $("send").disabled = busy;
    $("stop").disabled = !busy;
    $("new-chat").disabled = busy;
  }

  // Server-sent events of a fetch response, as parsed JSON ("[DONE]" ends them).
  async function* events(response) {
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += decoder.decode(value, { stream: true });
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const block = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        const data = block
          .split("\n")
          .filter((line) => line.startsWith("data:"))
          .map((line) => line.slice(5).trimStart())
          .join("\n");
        if (data === "[DONE]") return;
        if (data) yield JSON.parse(data);
      }
    }
  }

  function figures(started, first, last, tokens, finish) {
    const parts = [];
    if (first !== null) parts.push(`time to first token ${Math.round(first - started)} ms`);
    if (tokens > 1 && last > first) {
      parts.push(`${((tokens - 1) / ((last - first) / 1000)).toFixed(1)} tokens/s`);
    }
    if (tokens) parts.push(`${tokens} tokens`);
    if (finish === "length") parts.push("stopped at max tokens");
    return parts.join(" · ");
  }

  async function send(event) {
    event.preventDefault();
    const text = $("message").value.trim();
    if (!text || controller) return;
    $("message").value = "";
    page.notice("");
    history.push({ role: "user", content: text });
    addMessage("user", text);
    const reply = addMessage("assistant", "");
    reply.item.setAttribute("aria-busy", "true");
    controller = new AbortController();
    setBusy(true);
    const started = performance.now();
    let first = null;
    let last = null;
    let answer = "";
    let pieces = 0;
    let usage = null;
    let finish = null;
    try {
      const response = await fetch("/v1/chat/completions", {
        method: "POST",
        headers: page.headers({ "Content-Type": "application/json" }),
        signal: controller.signal,
        body: JSON.stringify({
          messages: history,
          stream: true,
          stream_options: { include_usage: true },
          temperature: Number($("temperature").value),
          max_tokens: Number($("max-tokens").value),
        }),
      });
      if (!response.ok) throw new Error(await page.errorText(response));
      for await (const chunk of events(response)) {
        if (chunk.error) throw new Error(chunk.error.message);
        if (chunk.usage) usage = chunk.usage;
        for (const choice of chunk.choices || []) {
          const piece = choice.delta && choice.delta.content;
          if (piece) {
            last = performance.now();
            if (first === null) first = last;
            pieces += 1;
            answer += piece;
            reply.body.textContent = answer;
          }
          if (choice.finish_reason) finish = choice.finish_reason;
        }
      }
      history.push({ role: "assistant", content: answer });
      const tokens = usage ? usage.completion_tokens : pieces;
      reply.meta.textContent = figures(started, first, last, tokens, finish);
    } catch (error) {
      if (error.name === "AbortError") {
        // What arrived stays in the conversation, as it was shown.
        history.push({ role: "assistant", content: answer });
        reply.meta.textContent = `stopped · ${figures(started, first, last, pieces, null)}`;
      } else {
        history.pop(); // the turn failed: the next one is sent without it
        reply.item.classList.add("failed");
        reply.meta.textContent = `error: ${error.message}`;
      }
    } finally {
      controller = null;
      reply.item.removeAttribute("aria-busy");
      setBusy(false);
      $("message").focus();
    }
  }

  $("composer").addEventListener("submit", send);
  $("message").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("stop").addEventListener("click", () => {
    if (controller) controller.abort();
  });
  $("new-chat").addEventListener("click", () => {
    history.length = 0;
    $("messages").replaceChildren();
    page.notice("");
    $("message").focus();
  });
  page.init();
  $("message").focus();
})();
