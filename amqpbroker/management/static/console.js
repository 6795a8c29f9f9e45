// amqpbroker console: polls the management API every 2 s; no build step, no dependencies.
"use strict";

const POLL_MS = 2000;

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") node.className = v;
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v);
  }
  for (const c of children) node.append(c instanceof Node ? c : document.createTextNode(c == null ? "" : String(c)));
  return node;
}

async function api(method, path) {
  const resp = await fetch(path, { method, headers: { Accept: "application/json" }, credentials: "same-origin" });
  let body = null;
  try { body = await resp.json(); } catch (e) { /* not JSON */ }
  if (!resp.ok) {
    const err = new Error((body && body.error) || `${resp.status} ${resp.statusText}`);
    err.status = resp.status;
    throw err;
  }
  return body;
}

function showError(message) {
  const box = document.getElementById("error");
  box.textContent = message || "";
  box.hidden = !message;
}

function bytes(n) {
  if (n < 1024) return `${n} B`;
  const units = ["KiB", "MiB", "GiB", "TiB"];
  let v = n, i = -1;
  do { v /= 1024; i++; } while (v >= 1024 && i < units.length - 1);
  return `${v.toFixed(1)} ${units[i]}`;
}

function ago(epoch) {
  if (epoch == null) return "never";
  return duration(Date.now() / 1000 - epoch) + " ago";
}

function duration(s) {
  if (s == null) return "";
  s = Math.max(0, s);
  if (s >= 86400) return (s / 86400).toFixed(1) + "d";
  if (s >= 3600) return (s / 3600).toFixed(1) + "h";
  if (s >= 60) return (s / 60).toFixed(1) + "m";
  return Math.round(s) + "s";
}

function fill(tableId, rows, columns, emptyText) {
  const tbody = document.querySelector(`#${tableId} tbody`);
  const fresh = rows.map((row) => columns(row));
  if (!fresh.length) fresh.push(el("tr", {}, el("td", { class: "empty", colspan: "20" }, emptyText)));
  tbody.replaceChildren(...fresh);
}

function subPath(s) {
  const q = new URLSearchParams({ namespace: s.namespace, durable: String(s.durable) });
  return `/api/subscriptions/${encodeURIComponent(s.name)}?${q}`;
}

async function deleteSubscription(s) {
  if (!confirm(`Delete subscription '${s.name}' (${s.namespace}) and its ${s.pending} pending message(s)?`)) return;
  try {
    await api("DELETE", subPath(s));
  } catch (e) {
    if (e.status === 409 && confirm(`${e.message}\n\nDetach the consumers and delete anyway?`)) {
      await api("DELETE", subPath(s) + "&force=true");
    } else {
      throw e;
    }
  }
}

async function action(fn) {
  try {
    await fn();
    showError("");
  } catch (e) {
    showError(e.message);
  }
  refresh();
}

function subscriptionRow(s) {
  const kind = [s.durable ? "durable" : "non-durable", s.shared ? "shared" : null, s.global ? "global" : null]
    .filter(Boolean).join(", ");
  const del = el("button", { class: "danger delete", onclick: () => action(() => deleteSubscription(s)) }, "Delete");
  return el("tr", { class: s.abandoned ? "abandoned" : "", "data-name": s.name, "data-namespace": s.namespace },
    el("td", {}, s.name), el("td", {}, s.global ? "(global)" : s.namespace), el("td", {}, s.topic),
    el("td", {}, s.selector || ""), el("td", {}, kind),
    el("td", { class: "n" }, s.consumers), el("td", { class: "n" }, s.pending),
    el("td", { class: "n" }, bytes(s.pending_bytes)), el("td", {}, ago(s.last_delivered_at)),
    el("td", {}, s.idle_seconds == null ? "consuming" : duration(s.idle_seconds)),
    el("td", {}, s.named ? del : ""));
}

function queueRow(q) {
  const purge = el("button", {
    class: "purge",
    onclick: () => action(async () => {
      if (!confirm(`Purge the ${q.ready} ready message(s) of '${q.name}'?`)) return;
      await api("POST", `/api/queues/${encodeURIComponent(q.name)}/purge`);
    }),
  }, "Purge");
  const del = el("button", {
    class: "danger delete",
    onclick: () => action(async () => {
      if (!confirm(`Delete queue '${q.name}' and its ${q.depth} message(s)?`)) return;
      await api("DELETE", `/api/queues/${encodeURIComponent(q.name)}`);
    }),
  }, "Delete");
  return el("tr", { "data-name": q.name },
    el("td", {}, q.name), el("td", { class: "n" }, q.depth), el("td", { class: "n" }, bytes(q.bytes)),
    el("td", { class: "n" }, q.consumers), el("td", { class: "n" }, q.enqueue_rate.toFixed(1)),
    el("td", { class: "n" }, q.ack_rate.toFixed(1)), el("td", { class: "n" }, q.enqueued_total),
    el("td", { class: "n" }, q.acked_total), el("td", {}, purge, " ", q.subscription ? "" : del));
}

function connectionRow(c) {
  const close = el("button", {
    class: "danger close",
    onclick: () => action(async () => {
      if (!confirm(`Close connection ${c.id} (${c.container_id}, ${c.remote_address})?`)) return;
      await api("DELETE", `/api/connections/${c.id}`);
    }),
  }, "Close");
  return el("tr", { "data-id": String(c.id), "data-container": c.container_id || "" },
    el("td", { class: "n" }, c.id), el("td", {}, c.container_id), el("td", {}, c.user || ""),
    el("td", {}, c.remote_address), el("td", { class: "n" }, c.sessions), el("td", { class: "n" }, c.links),
    el("td", {}, close));
}

let timer = null;
let busy = false;

async function refresh() {
  clearTimeout(timer);
  if (busy) { timer = setTimeout(refresh, POLL_MS); return; }
  busy = true;
  try {
    const idle = document.getElementById("idle").value.trim() || "7d";
    const [overview, subs, queues, conns] = await Promise.all([
      api("GET", "/api/overview"),
      api("GET", `/api/subscriptions?idle=${encodeURIComponent(idle)}`),
      api("GET", "/api/queues"),
      api("GET", "/api/connections"),
    ]);
    document.getElementById("overview").textContent =
      `${overview.container_id} ${overview.version} · ${overview.connections} connection(s) · ${overview.messages} message(s)`;
    const abandoned = subs.filter((s) => s.abandoned).length;
    document.getElementById("sub-count").textContent = `${subs.length}` + (abandoned ? ` · ${abandoned} abandoned` : "");
    const plain = queues.filter((q) => !q.subscription);
    document.getElementById("queue-count").textContent = `${plain.length}`;
    document.getElementById("conn-count").textContent = `${conns.length}`;
    fill("subscriptions", subs, subscriptionRow, "no subscriptions");
    fill("queues", plain, queueRow, "no queues");
    fill("connections", conns, connectionRow, "no connections");
    document.getElementById("status").textContent = `updated ${new Date().toLocaleTimeString()}`;
    document.body.dataset.refreshed = String(Date.now());
  } catch (e) {
    document.getElementById("status").textContent = `error: ${e.message}`;
  } finally {
    busy = false;
    timer = setTimeout(refresh, POLL_MS);
  }
}

document.getElementById("idle").addEventListener("change", refresh);
refresh();
