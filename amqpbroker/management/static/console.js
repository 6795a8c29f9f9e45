// amqpbroker console: polls the management API every 2 s; no build step, no dependencies.
"use strict";

const POLL_MS = 2000;
const QUEUE_PAGE = 50;   // queues per page: the API pages and filters, the console shows one page
const queueView = { offset: 0, name: "", sort: "name" };

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

async function request(method, path, payload) {
  const headers = { Accept: "application/json" };
  // Changes say they are JSON: the broker refuses a browser's change without it (a
  // page elsewhere could send a form or text/plain without asking first).
  if (method !== "GET") headers["Content-Type"] = "application/json";
  const data = payload === undefined ? undefined : JSON.stringify(payload);
  const resp = await fetch(path, { method, headers, body: data, credentials: "same-origin" });
  let body = null;
  try { body = await resp.json(); } catch (e) { /* not JSON */ }
  if (!resp.ok) {
    const err = new Error((body && body.error) || `${resp.status} ${resp.statusText}`);
    err.status = resp.status;
    throw err;
  }
  return { body, headers: resp.headers };
}

async function api(method, path, payload) {
  return (await request(method, path, payload)).body;
}

async function queuePage() {
  const q = new URLSearchParams({ offset: String(queueView.offset), limit: String(QUEUE_PAGE),
                                  sort: queueView.sort, subscription: "false" });
  if (queueView.name) q.set("name", queueView.name);
  const { body, headers } = await request("GET", `/api/queues?${q}`);
  return { queues: body, total: Number(headers.get("X-Total-Count") || body.length), offset: queueView.offset };
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
  const browse = el("button", { class: "browse", onclick: () => showMessages({ queue: q.name, offset: 0 }) }, "Messages");
  return el("tr", { "data-name": q.name },
    el("td", {}, q.name), el("td", { class: "n" }, q.depth), el("td", { class: "n" }, bytes(q.bytes)),
    el("td", { class: "n" }, q.consumers), el("td", { class: "n" }, q.enqueue_rate.toFixed(1)),
    el("td", { class: "n" }, q.ack_rate.toFixed(1)), el("td", { class: "n" }, q.enqueued_total),
    el("td", { class: "n" }, q.acked_total), el("td", { class: "limit" }, limitText(q)),
    el("td", {}, browse, " ", purge, " ", q.subscription ? "" : del));
}

// A queue's limits and overflow policy, and what overflow did (docs/operations.md).
function limitText(q) {
  if (!q.limits) return "—";
  const l = q.limits;
  const parts = [];
  if (l.max_depth) parts.push(`${l.max_depth} msgs`);
  if (l.max_bytes) parts.push(bytes(l.max_bytes));
  let text = `${parts.join(" / ")}, ${l.overflow}`;
  if (q.overflow_rejected_total) text += ` · ${q.overflow_rejected_total} rejected`;
  if (q.overflow_dropped_total) text += ` · ${q.overflow_dropped_total} dropped`;
  return text;
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

// ---- the messages panel: one queue's waiting messages (GET /api/queues/{name}/messages),
// replay and move (docs/operations.md "Browsing messages", "Dead-letter replay and move").
const MESSAGE_PAGE = 20;
const messageView = { queue: null, offset: 0, selector: "" };

function messagesPath(suffix) {
  return `/api/queues/${encodeURIComponent(messageView.queue)}/${suffix}`;
}

function messageRow(m) {
  const p = m.properties || {};
  const a = m.message_annotations || {};
  const origin = a["x-opt-amqpbroker-dlq-queue"];
  const body = m.body || {};
  const preview = String(body.preview == null ? "" : body.preview).slice(0, 80) + (body.truncated ? "…" : "");
  return el("tr", { "data-seq": String(m.sequence) },
    el("td", { class: "n" }, m.sequence), el("td", {}, m.state), el("td", {}, p.message_id || ""),
    el("td", {}, p.subject || ""), el("td", { class: "n" }, m.delivery_count), el("td", { class: "n" }, bytes(m.size)),
    el("td", {}, JSON.stringify(m.application_properties || {})),
    el("td", { class: "origin" }, origin ? `${origin} (${a["x-opt-amqpbroker-dlq-reason"]})` : ""),
    el("td", { class: "body" }, preview));
}

async function loadMessages() {
  if (!messageView.queue) return;
  const q = new URLSearchParams({ offset: String(messageView.offset), limit: String(MESSAGE_PAGE) });
  if (messageView.selector) q.set("selector", messageView.selector);
  const page = await api("GET", `${messagesPath("messages")}?${q}`);
  document.getElementById("messages-queue").textContent = page.queue;
  document.getElementById("messages-count").textContent = `depth ${page.depth} · ${page.unacked} held by consumers`;
  document.getElementById("messages-page").textContent = page.messages.length
    ? `${page.offset + 1}–${page.offset + page.messages.length}` : "";
  document.getElementById("messages-prev").disabled = page.offset === 0;
  document.getElementById("messages-next").disabled = page.messages.length < MESSAGE_PAGE;
  fill("messages", page.messages, messageRow, "no waiting messages");
}

function showMessages(change) {
  Object.assign(messageView, change);
  document.getElementById("messages-panel").hidden = !messageView.queue;
  if (messageView.queue) action(loadMessages);
}

function moveSummary(r) {
  const where = Object.entries(r.destinations).map(([d, n]) => `${n} to ${d}`).join(", ");
  const skipped = Object.entries(r.skip_reasons).map(([why, n]) => `${n} ${why}`).join(", ");
  return `${r.moved} moved${where ? ` (${where})` : ""}${skipped ? `; left: ${skipped}` : ""}${r.stopped ? `; stopped: ${r.stopped}` : ""}`;
}

async function moveMessages(verb) {
  const payload = {};
  if (messageView.selector) payload.selector = messageView.selector;
  if (verb === "move") {
    const to = prompt(`Move the waiting messages of '${messageView.queue}'${messageView.selector ? " matching the selector" : ""} to which address?`);
    if (!to) return;
    payload.to = to;
  } else if (!confirm(`Send the dead-lettered messages of '${messageView.queue}'${messageView.selector ? " matching the selector" : ""} back to their origin?`)) {
    return;
  }
  const job = await api("POST", `${messagesPath(verb)}?wait=30`, payload);   // a job (GET/DELETE job.href)
  const state = job.state === "running" ? ` (still running: job ${job.id})` : "";
  document.getElementById("status").textContent = `${verb}: ${moveSummary(job.report)}${state}`;
  await loadMessages();
}

let timer = null;
let busy = false;
let haEnabled = true;   // until /api/ha says this broker runs alone: then it is not asked again
let clusterEnabled = true;   // until /api/cluster says this broker is no node of a cluster
let again = false;   // asked for while a refresh ran (a new filter, page, sort): run once more at once

// The HA pair's state (GET /api/ha): status and role, the backup and its lag, the
// ZooKeeper session; amber when the backup is not in sync or ZooKeeper is not connected.
async function showHa() {
  const ha = await api("GET", "/api/ha");
  const el = document.getElementById("ha");
  if (!ha.enabled) { haEnabled = false; el.hidden = true; return; }
  const rep = ha.replication;
  const backup = rep ? `backup ${rep.peer_state}, lag ${rep.lag_batches} batch(es) / ${rep.lag_bytes} B / ${rep.lag_seconds} s`
                     : "no backup";
  const zk = ha.zookeeper.session;
  el.textContent = `HA ${ha.status} (${ha.role}, activation ${ha.activation}) · ${backup} · ZooKeeper ${zk}`;
  el.classList.toggle("degraded", zk !== "CONNECTED" || !rep || rep.peer_state !== "in-sync" || !ha.accepting);
  el.hidden = false;
}

// The cluster as this node sees it (GET /api/cluster, docs/cluster.md): every node, live
// or not, its slots and this node's connections to it; the forwarding figures; the
// partitioned destinations.  Hidden on a broker that is no node of a cluster.
async function showCluster() {
  const c = await api("GET", "/api/cluster");
  const panel = document.getElementById("cluster-panel");
  const badge = document.getElementById("cluster-badge");
  if (!c.enabled) { clusterEnabled = false; panel.hidden = true; badge.hidden = true; return; }
  const live = c.nodes.filter((n) => n.live).length;
  const zk = c.zookeeper ? ` · ZooKeeper ${c.zookeeper.session}` : "";
  badge.textContent = `cluster node ${c.node} · ${live}/${c.nodes.length} live${c.serving ? "" : " · NOT SERVING"}`;
  badge.classList.toggle("degraded", !c.serving || live < c.nodes.length || (c.zookeeper && c.zookeeper.session !== "CONNECTED"));
  badge.hidden = false;
  document.getElementById("cluster-summary").textContent =
    `node ${c.node} · ${c.serving ? "serving" : "not serving"} · map epoch ${c.epoch} · ` +
    `${c.slots_owned} of ${c.slots} slots here${c.tls ? " · TLS between nodes" : ""}${zk}`;
  fill("cluster-nodes", c.nodes, (n) => el("tr", { "data-name": n.node, class: n.live ? "" : "down" },
    el("td", {}, n.node + (n.here ? " (this node)" : "")), el("td", {}, n.live ? "live" : "away"),
    el("td", { class: "n" }, n.slots), el("td", { class: "n" }, n.here ? "" : n.connections)), "no nodes");
  const f = c.forwarded;
  document.getElementById("cluster-forwarding").textContent =
    `forwarded for ${f.clients} client(s): ${f.links} link(s) on ${f.connections} connection(s) to other nodes ` +
    `(${f.links_total} since start) · ${f.waiting_on_owners} message(s) waiting on owners · ` +
    `${f.unsettled_at_clients} delivery(ies) unsettled at clients · ${c.inter_node_connections_in} connection(s) from other nodes`;
  const parts = document.getElementById("cluster-partitioned");
  parts.hidden = !c.partitioned.length;
  fill("cluster-partitioned", c.partitioned, (p) => el("tr", { "data-name": p.address },
    el("td", {}, p.address), el("td", {}, p.members.map((m) => `${m.address} on ${m.node}`).join(", "))), "");
  panel.hidden = false;
}

async function refresh() {
  clearTimeout(timer);
  if (busy) { again = true; return; }
  busy = true;
  try {
    const idle = document.getElementById("idle").value.trim() || "7d";
    const [overview, subs, page, conns] = await Promise.all([
      api("GET", "/api/overview"),
      api("GET", `/api/subscriptions?idle=${encodeURIComponent(idle)}`),
      queuePage(),
      api("GET", "/api/connections"),
    ]);
    document.getElementById("overview").textContent =
      `${overview.container_id} ${overview.version} · ${overview.connections} connection(s) · ${overview.messages} message(s)`;
    const alarms = overview.alarms || [];
    const alarmEl = document.getElementById("alarms");
    alarmEl.hidden = alarms.length === 0;
    alarmEl.textContent = alarms.length ? `${alarms.join(" + ")} alarm: producers blocked` : "";
    if (haEnabled) await showHa();
    if (clusterEnabled) await showCluster();
    const abandoned = subs.filter((s) => s.abandoned).length;
    document.getElementById("sub-count").textContent = `${subs.length}` + (abandoned ? ` · ${abandoned} abandoned` : "");
    const { queues, total, offset } = page;
    if (offset > 0 && offset >= total && queueView.offset === offset) {   // the last page emptied: go back
      queueView.offset = Math.max(0, Math.floor((total - 1) / QUEUE_PAGE) * QUEUE_PAGE);
      again = true;
    }
    document.getElementById("queue-count").textContent = `${total}`;
    document.getElementById("queue-page").textContent = queues.length
      ? `${offset + 1}–${offset + queues.length} of ${total}` : "";
    document.getElementById("queue-prev").disabled = offset === 0;
    document.getElementById("queue-next").disabled = offset + queues.length >= total;
    document.getElementById("conn-count").textContent = `${conns.length}`;
    fill("subscriptions", subs, subscriptionRow, "no subscriptions");
    fill("queues", queues, queueRow, queueView.name ? "no queue matches" : "no queues");
    fill("connections", conns, connectionRow, "no connections");
    document.getElementById("status").textContent = `updated ${new Date().toLocaleTimeString()}`;
    document.body.dataset.refreshed = String(Date.now());
  } catch (e) {
    document.getElementById("status").textContent = `error: ${e.message}`;
  } finally {
    busy = false;
    timer = setTimeout(refresh, again ? 0 : POLL_MS);
    again = false;
  }
}

function showQueues(change) {
  Object.assign(queueView, change);
  refresh();
}

document.getElementById("idle").addEventListener("change", refresh);
document.getElementById("queue-filter").addEventListener("input", (e) => showQueues({ name: e.target.value.trim(), offset: 0 }));
document.getElementById("queue-sort").addEventListener("change", (e) => showQueues({ sort: e.target.value, offset: 0 }));
document.getElementById("queue-prev").addEventListener("click", () => showQueues({ offset: Math.max(0, queueView.offset - QUEUE_PAGE) }));
document.getElementById("queue-next").addEventListener("click", () => showQueues({ offset: queueView.offset + QUEUE_PAGE }));
document.getElementById("messages-selector").addEventListener("change", (e) => showMessages({ selector: e.target.value.trim(), offset: 0 }));
document.getElementById("messages-prev").addEventListener("click", () => showMessages({ offset: Math.max(0, messageView.offset - MESSAGE_PAGE) }));
document.getElementById("messages-next").addEventListener("click", () => showMessages({ offset: messageView.offset + MESSAGE_PAGE }));
document.getElementById("messages-replay").addEventListener("click", () => action(() => moveMessages("replay")));
document.getElementById("messages-move").addEventListener("click", () => action(() => moveMessages("move")));
document.getElementById("messages-close").addEventListener("click", () => showMessages({ queue: null }));
refresh();
