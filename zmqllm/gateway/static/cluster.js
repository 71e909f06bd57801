"use strict";
// The cluster page: GET /cluster/status about once a second, drawn as the pipeline
// (stages left to right, replicas stacked). Rates (tokens/s, each worker's busy share)
// are the counters' differences between two snapshots, over their "at" seconds.
(() => {
  const { $ } = page;
  const POLL_MS = 1000;
  // The latest two snapshots with a broker status and different "at" (the gateway reuses
  // a status for up to a second): rates are taken between them.
  let latest = null;
  let before = null;

  function el(tag, className, text) {
    const node = document.createElement(tag);
    if (className) node.className = className;
    if (text !== undefined) node.textContent = String(text); // never markup: ids come from peers
    return node;
  }

  function mib(bytes) {
    return `${(bytes / 1048576).toFixed(0)} MiB`;
  }

  // Per second, from a counter's values in two snapshots; null without a usable pair
  // (a restarted process counts from 0 again).
  function rate(now, then, seconds) {
    if (now === undefined || then === undefined || now < then || !(seconds > 0)) return null;
    return (now - then) / seconds;
  }

  // One term and its value; "name" marks the value for tests and styles.
  function pair(list, term, value, name) {
    const item = el("div");
    const dd = el("dd", "", value);
    if (name) dd.dataset.figure = name;
    item.append(el("dt", "", term), dd);
    list.append(item);
  }

  function drawSummary(snap, old) {
    const list = $("summary");
    list.replaceChildren();
    const st = snap.broker;
    pair(list, "Broker", st ? `up ${Math.round(st.uptime_s)} s` : "not answering");
    if (!st) return;
    const seconds = old ? snap.at - old.at : 0;
    const perSecond = old ? rate(st.counters.tokens, old.broker.counters.tokens, seconds) : null;
    pair(list, "Workers", st.workers.length);
    pair(list, "Routes", st.routes.length);
    pair(list, "Sessions", st.sessions);
    pair(list, "Queue", `${st.queue} in the broker, ${snap.gateway.queued} in the gateway`);
    pair(list, "Requests running", snap.gateway.in_flight);
    pair(list, "Tokens/s", perSecond === null ? "…" : perSecond.toFixed(1), "tokens-per-s");
  }

  function workerCard(w, old, seconds) {
    const card = el("article", "worker");
    card.setAttribute("aria-label", `worker ${w.id}`);
    if (w.draining) card.classList.add("draining");
    card.append(el("h4", "name", w.id));
    card.append(el("p", "range", `${w.layers[0]}:${w.layers[1]}`));
    const list = el("dl", "figures");
    const info = w.info || {};
    pair(list, "host", info.pid ? `${info.host} (pid ${info.pid})` : info.host || "?");
    pair(list, "sessions", `${w.sessions} / ${w.capacity}`);
    const kv = w.max_kv_tokens ? (100 * w.kv_tokens_reserved) / w.max_kv_tokens : 0;
    pair(list, "KV", `${w.kv_tokens_reserved} / ${w.max_kv_tokens} tokens (${kv.toFixed(0)} %)`);
    const stats = w.stats || {};
    pair(list, "batch", stats.last_batch === undefined ? "?" : stats.last_batch);
    // Busy time is shown only where the gateway shows it (prefix_stats): it tells whether a
    // prompt hit the prefix cache.
    if (stats.busy_s !== undefined) {
      const busy = old && old.stats ? rate(stats.busy_s, old.stats.busy_s, seconds) : null;
      pair(list, "busy", busy === null ? "…" : `${Math.min(100, 100 * busy).toFixed(0)} %`, "busy");
    }
    pair(list, "RSS", stats.rss_bytes ? mib(stats.rss_bytes) : "?");
    // The node's health, from the worker's heartbeats (CPU: of one core, between two).
    pair(list, "CPU", typeof w.cpu_percent === "number" ? `${w.cpu_percent.toFixed(0)} %` : "…");
    if (stats.kv_bytes_reserved !== undefined) {
      pair(list, "KV bytes", `${mib(stats.kv_bytes_used || 0)} used / ${mib(stats.kv_bytes_reserved)}`);
    }
    if (stats.net_rx_bytes !== undefined) {
      pair(list, "bus in/out", `${mib(stats.net_rx_bytes)} / ${mib(stats.net_tx_bytes || 0)}`);
    }
    if (stats.cuda_total_bytes) {
      pair(list, "GPU", `${mib(stats.cuda_used_bytes || 0)} / ${mib(stats.cuda_total_bytes)}`);
    }
    if (stats.prefix_query_tokens !== undefined) {
      // Prompt tokens taken from the prefix cache, of those looked up; and what it holds.
      const asked = stats.prefix_query_tokens;
      const found = stats.prefix_hit_tokens || 0;
      const share = asked ? ` (${((100 * found) / asked).toFixed(0)} %)` : "";
      pair(list, "prefix hits", `${found} / ${asked} tokens${share}`, "prefix");
      pair(list, "prefix cache", `${stats.prefix_cached_tokens || 0} tokens`);
    }
    if (w.draining) pair(list, "state", "draining");
    card.append(list);
    const meter = el("div", "meter");
    meter.setAttribute("role", "meter");
    meter.setAttribute("aria-label", "KV use");
    meter.setAttribute("aria-valuenow", kv.toFixed(0));
    meter.setAttribute("aria-valuemin", "0");
    meter.setAttribute("aria-valuemax", "100");
    const fill = el("span", "fill");
    fill.style.width = `${Math.min(100, kv)}%`;
    meter.append(fill);
    card.append(meter);
    return card;
  }

  function drawPipeline(snap, old) {
    const pipeline = $("pipeline");
    pipeline.replaceChildren();
    const st = snap.broker;
    if (!st) return;
    const seconds = old ? snap.at - old.at : 0;
    const oldWorkers = new Map(old ? old.broker.workers.map((w) => [w.id, w]) : []);
    // Several models: each model's stages side by side, the model named on each.
    const many = (st.models || []).length > 1;
    const stages = new Map(); // "model layers a:b" -> workers, in the order of their layers
    const sorted = [...st.workers].sort(
      (x, y) =>
        (x.model || "").localeCompare(y.model || "") ||
        x.layers[0] - y.layers[0] ||
        x.layers[1] - y.layers[1] ||
        (x.id < y.id ? -1 : 1)
    );
    for (const w of sorted) {
      const where = w.text_model ? "remote" : `layers ${w.layers[0]}:${w.layers[1]}`;
      const key = many ? `${w.model} · ${where}` : where;
      if (!stages.has(key)) stages.set(key, { model: w.model, workers: [] });
      stages.get(key).workers.push(w);
    }
    let previous = null;
    for (const [title, stage] of stages) {
      // An arrow between stages of one model; between two models only a gap.
      if (previous !== null) pipeline.append(el("div", "arrow", previous === stage.model ? "→" : ""));
      previous = stage.model;
      const column = el("section", "stage");
      column.setAttribute("aria-label", title);
      column.append(el("h3", "", title));
      for (const w of stage.workers) column.append(workerCard(w, oldWorkers.get(w.id), seconds));
      pipeline.append(column);
    }
    if (!st.workers.length) pipeline.append(el("p", "hint", "No worker is registered."));
  }

  function drawRoutes(snap) {
    const list = $("routes");
    list.replaceChildren();
    const st = snap.broker;
    const models =
      st && st.models && st.models.length > 1
        ? [...st.models].sort((a, b) => a.name.localeCompare(b.name))
        : null;
    const routes = !st
      ? []
      : models
        ? models.flatMap((m) => m.routes.map((r) => `${m.name}: ${m.text_model ? "remote" : r.join(" → ")}`))
        : st.routes.map((r) => r.join(" → "));
    for (const route of routes) list.append(el("li", "", route));
    if (st && !routes.length) {
      list.append(el("li", "", "none: the workers do not cover every layer"));
    }
  }

  function drawHosts(snap) {
    // Per machine: its workers, their resident memory and CPU use (100 % = one core).
    const list = $("hosts");
    list.replaceChildren();
    const st = snap.broker;
    if (!st) return;
    const hosts = new Map();
    for (const w of st.workers) {
      const name = (w.info && w.info.host) || "?";
      const h = hosts.get(name) || { workers: 0, rss: 0, cpu: 0, kv: 0 };
      const stats = w.stats || {};
      h.workers += 1;
      h.rss += stats.rss_bytes || 0;
      h.kv += stats.kv_bytes_reserved || 0;
      h.cpu += typeof w.cpu_percent === "number" ? w.cpu_percent : 0;
      hosts.set(name, h);
    }
    for (const [name, h] of [...hosts].sort((a, b) => a[0].localeCompare(b[0]))) {
      const item = el(
        "li",
        "",
        `${name}: ${h.workers} worker${h.workers === 1 ? "" : "s"}, RSS ${mib(h.rss)}, ` +
          `CPU ${h.cpu.toFixed(0)} %, KV reserved ${mib(h.kv)}`,
      );
      item.setAttribute("aria-label", `host ${name}`);
      list.append(item);
    }
  }

  async function poll() {
    try {
      const response = await fetch("/cluster/status", { headers: page.headers(), cache: "no-store" });
      if (!response.ok) {
        page.notice(await page.errorText(response));
        return;
      }
      let snap = await response.json();
      if (snap.broker) {
        if (!latest || snap.at > latest.at) {
          before = latest;
          latest = snap;
        }
        snap = { ...latest, gateway: snap.gateway }; // the gateway's own figures are live
      }
      const old = snap.broker ? before : null;
      drawSummary(snap, old);
      drawPipeline(snap, old);
      drawHosts(snap);
      drawRoutes(snap);
      page.notice(snap.broker ? "" : "The broker does not answer.");
    } catch (error) {
      page.notice(`The gateway does not answer (${error.message}).`);
    } finally {
      setTimeout(poll, POLL_MS);
    }
  }

  page.init();
  poll();
})();
