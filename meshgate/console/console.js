// meshgate web console: polls the admin API that served this page (same origin) every 2 s and
// keeps the last ~5 minutes of samples in memory for the charts. Plain JavaScript, no library.
// The token, when the user types one, lives in this page's memory only (never stored).
"use strict";

const POLL_MS = 2000;
const KEEP = 150; // samples: 5 minutes at 2 s
const SVGNS = "http://www.w3.org/2000/svg";

let token = "";
let tokenConfigured = false;
const samples = []; // {t, peers, stats}
let configShown = "";

const $ = (id) => document.getElementById(id);

function el(tag, attrs, text) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}

function svg(tag, attrs, text) {
  const e = document.createElementNS(SVGNS, tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, String(v));
  if (text !== undefined) e.textContent = text;
  return e;
}

function clear(node) {
  while (node.firstChild) node.removeChild(node.firstChild);
}

function fmtBytes(n) {
  if (n === null || n === undefined || !isFinite(n)) return "–";
  const units = ["B", "kB", "MB", "GB", "TB"];
  let i = 0;
  while (Math.abs(n) >= 1000 && i < units.length - 1) { n /= 1000; i++; }
  return (i === 0 ? Math.round(n) : n.toFixed(n < 10 ? 2 : 1)) + " " + units[i];
}

function fmtRate(n) {
  if (n === null || n === undefined || !isFinite(n)) return "–";
  return n < 10 ? n.toFixed(2) : n < 100 ? n.toFixed(1) : Math.round(n).toString();
}

function fmtMs(n) {
  return n === null || n === undefined ? "–" : (n < 10 ? n.toFixed(2) : n.toFixed(1)) + " ms";
}

function fmtUptime(s) {
  const d = Math.floor(s / 86400), h = Math.floor((s % 86400) / 3600), m = Math.floor((s % 3600) / 60);
  return (d ? d + "d " : "") + (d || h ? h + "h " : "") + m + "m " + Math.floor(s % 60) + "s";
}

async function api(path, method) {
  const headers = {};
  if (token) headers["Authorization"] = "Bearer " + token;
  const r = await fetch(path, { method: method || "GET", headers, cache: "no-store" });
  if (r.status === 401) {
    const e = new Error("the admin API needs the token");
    e.status = 401;
    throw e;
  }
  if (!r.ok) throw new Error(path + ": HTTP " + r.status);
  return r.json();
}

// --- charts: one or two series of numbers as a polyline in a small SVG

function chart(node, series, opts) {
  opts = opts || {};
  const w = node.clientWidth || 180, h = node.clientHeight || 34;
  node.setAttribute("viewBox", "0 0 " + w + " " + h);
  clear(node);
  const n = Math.max(...series.map((s) => s.length), 0);
  node.setAttribute("data-points", String(n));
  if (n === 0) return;
  let max = 0;
  for (const s of series) for (const v of s) if (v !== null && v > max) max = v;
  if (max <= 0) max = 1;
  const span = Math.max(n, 30); // the x axis: at least a minute, at most the 5 kept
  series.forEach((s, i) => {
    const pts = [];
    s.forEach((v, j) => {
      if (v === null) return;
      const x = n === 1 ? w - 1 : (j + (span - n)) * (w - 2) / (span - 1) + 1;
      const y = h - 2 - (v / max) * (h - 12);
      pts.push(x.toFixed(1) + "," + y.toFixed(1));
    });
    if (pts.length === 1) pts.push(pts[0]);
    node.appendChild(svg("polyline", { class: i ? "line second" : "line", points: pts.join(" ") }));
  });
  node.appendChild(svg("text", { class: "max", x: 3, y: 9 }, (opts.fmt || fmtRate)(max)));
}

// rate of a counter between consecutive samples: get(sample) -> number (or undefined)
function rates(get) {
  const out = [];
  for (let i = 1; i < samples.length; i++) {
    const a = get(samples[i - 1]), b = get(samples[i]);
    const dt = (samples[i].t - samples[i - 1].t) / 1000;
    out.push(a === undefined || b === undefined || dt <= 0 ? null : Math.max(0, (b - a) / dt));
  }
  return out;
}

function last(arr) {
  return arr.length ? arr[arr.length - 1] : null;
}

// --- the mesh graph: columns by hop count from this node (left), each node near its neighbours
// one column to the left, so the links mostly run left to right

function layout(mesh, W, H) {
  const cols = {};
  for (const n of mesh.nodes) (cols[n.hops] = cols[n.hops] || []).push(n);
  const hops = Object.keys(cols).map(Number).sort((a, b) => a - b);
  const maxHops = Math.max(1, ...hops);
  const adj = {};
  for (const l of mesh.links) {
    (adj[l.a] = adj[l.a] || []).push(l.b);
    (adj[l.b] = adj[l.b] || []).push(l.a);
  }
  const pos = {};
  for (const h of hops) {
    const col = cols[h];
    const parentY = (n) => {
      const ys = (adj[n.id] || []).map((id) => pos[id]).filter(Boolean).map((p) => p[1]);
      return ys.length ? ys.reduce((a, b) => a + b, 0) / ys.length : H / 2;
    };
    col.sort((a, b) => parentY(a) - parentY(b) || (a.name < b.name ? -1 : 1));
    const x = 90 + (h / maxHops) * (W - 180);
    col.forEach((n, i) => { pos[n.id] = [x, (H * (i + 0.5)) / col.length]; });
  }
  return pos;
}

function drawGraph(mesh) {
  const g = $("graph");
  clear(g);
  if (!mesh) {
    g.setAttribute("viewBox", "0 0 800 60");
    g.appendChild(svg("text", { x: 400, y: 34, class: "node-sub" }, "this node runs no mesh"));
    $("mesh-summary").textContent = "";
    return;
  }
  const W = 800;
  const tallest = Math.max(1, ...Object.values(mesh.nodes.reduce((c, n) => {
    c[n.hops] = (c[n.hops] || 0) + 1;
    return c;
  }, {})));
  const H = Math.max(160, Math.min(900, tallest * 95));
  g.setAttribute("viewBox", "0 0 " + W + " " + H);
  const pos = layout(mesh, W, H);
  const names = {};
  for (const n of mesh.nodes) names[n.id] = n.name || n.id;
  for (const l of mesh.links) {
    const a = pos[l.a], b = pos[l.b];
    if (!a || !b) continue;
    const line = svg("line", { class: l.direct ? "edge direct" : "edge", x1: a[0], y1: a[1], x2: b[0], y2: b[1],
      "data-a": names[l.a], "data-b": names[l.b] });
    line.appendChild(svg("title", {}, names[l.a] + " – " + names[l.b] + (l.direct ? " (direct: " + l.kinds.join(", ") + ")" : "")));
    g.appendChild(line);
    const label = (l.latency_ms !== null ? fmtMs(l.latency_ms) : "") + (l.kinds && l.kinds.length ? " " + l.kinds.join("+") : "");
    g.appendChild(svg("text", { class: "edge-label", x: (a[0] + b[0]) / 2, y: (a[1] + b[1]) / 2 - 4 }, label));
  }
  for (const n of mesh.nodes) {
    const [x, y] = pos[n.id];
    const cls = ["node"];
    if (n.self) cls.push("self");
    if (n.exit) cls.push("exit");
    if (n.relay) cls.push("relay");
    const grp = svg("g", { class: cls.join(" "), "data-id": n.id, "data-name": n.name });
    grp.appendChild(svg("circle", { cx: x, cy: y, r: n.self ? 20 : 16 }));
    const tags = [n.exit ? "EXIT" : "", n.relay ? "RELAY" : ""].filter(Boolean).join(" ");
    if (tags) grp.appendChild(svg("text", { class: "badge", x: x, y: y + 3 }, tags));
    grp.appendChild(svg("text", { class: "node-label", x: x, y: y - 25 }, n.name || n.id));
    const sub = [n.ipv4 || n.ipv6 || "", ...n.proxy_cidrs].filter(Boolean).join(" · ");
    if (sub) grp.appendChild(svg("text", { class: "node-sub", x: x, y: y + 32 }, sub));
    grp.appendChild(svg("title", {}, (n.name || "") + " " + n.id + (n.self ? " (this node)" : " (" + n.hops + " hops)")));
    g.appendChild(grp);
  }
  const direct = mesh.links.filter((l) => l.direct).length;
  $("mesh-summary").textContent = mesh.nodes.length + " nodes, " + mesh.links.length + " links (" + direct + " direct)";
}

// --- tables

function cell(tr, text, cls) {
  const td = el("td", cls ? { class: cls } : {}, text);
  tr.appendChild(td);
  return td;
}

function drawPeers(peers) {
  const body = $("peers").tBodies[0];
  clear(body);
  $("peers-empty").hidden = peers.length > 0;
  const key = (p) => p.id + " " + p.url;
  for (const p of peers) {
    const k = key(p);
    const find = (s) => (s.peers || []).find((q) => key(q) === k);
    const lat = samples.map((s) => { const q = find(s); return q ? q.latency_ms : null; });
    const rin = rates((s) => { const q = find(s); return q ? q.bytes_in : undefined; });
    const rout = rates((s) => { const q = find(s); return q ? q.bytes_out : undefined; });
    const tr = el("tr", { "data-peer": p.name });
    cell(tr, p.name || p.id);
    cell(tr, p.url);
    cell(tr, fmtMs(p.latency_ms), "num");
    const c1 = svg("svg", { class: "chart latency" });
    cell(tr, "").appendChild(c1);
    cell(tr, fmtBytes(last(rin)) + "/s", "num");
    cell(tr, fmtBytes(last(rout)) + "/s", "num");
    const c2 = svg("svg", { class: "chart traffic" });
    cell(tr, "").appendChild(c2);
    body.appendChild(tr);
    chart(c1, [lat], { fmt: fmtMs });
    chart(c2, [rin, rout], { fmt: (v) => fmtBytes(v) + "/s" });
  }
}

function drawRoutes(routes, mesh) {
  const body = $("routes").tBodies[0];
  clear(body);
  const policy = mesh ? mesh.policy : "";
  $("routes-policy").textContent = policy ? "this node's policy: " + policy : "";
  for (const th of document.querySelectorAll("#routes th")) {
    th.classList.toggle("active", th.classList.contains("p-" + policy));
  }
  const names = {};
  for (const r of routes) names[r.id] = r.name || r.id;
  for (const r of routes) {
    const tr = el("tr");
    cell(tr, r.name || r.id);
    cell(tr, [r.ipv4, r.ipv6].filter(Boolean).join(", "));
    cell(tr, r.proxy_cidrs.join(", "));
    cell(tr, r.exit ? "yes" : "");
    const via = (nh, hops) => (hops === 0 ? "this node" : hops === 1 ? "direct" : "via " + (names[nh] || nh));
    cell(tr, via(r.next_hop, r.hops) + ", " + r.hops + ", " + fmtMs(r.latency_ms));
    cell(tr, via(r.next_hop_ll, r.hops_ll) + ", " + r.hops_ll + ", " + fmtMs(r.latency_ms_ll));
    body.appendChild(tr);
  }
}

function drawDns(dns) {
  $("dns-off").hidden = !!dns;
  $("dns-on").hidden = !dns;
  if (!dns) return;
  const qps = rates((s) => (s.stats.dns ? s.stats.dns.queries : undefined));
  $("dns-qps").textContent = fmtRate(last(qps));
  const lookups = dns.cache_hits + dns.cache_misses;
  $("dns-hit").textContent = lookups ? Math.round((100 * dns.cache_hits) / lookups) + " %" : "–";
  $("dns-blocked").textContent = String(dns.blocked);
  chart($("chart-dns"), [qps]);
  const body = $("upstreams").tBodies[0];
  clear(body);
  const span = Math.min(samples.length - 1, 15); // health over the last ~30 s
  for (const u of dns.upstreams) {
    const get = (field) => (s) => {
      const v = s.stats.dns && s.stats.dns.upstreams.find((x) => x.url === u.url);
      return v ? v[field] : undefined;
    };
    const q = rates(get("queries")), e = rates(get("errors"));
    const old = samples.length > span ? samples[samples.length - 1 - span] : null;
    const delta = (field) => (old && get(field)(old) !== undefined ? u[field] - get(field)(old) : u[field]);
    // From outcomes, not from queries sent: a question still in flight at the newest sample
    // (its timeout not counted yet) must not turn an upstream that never answers "degraded".
    const da = delta("answers"), de = delta("errors");
    const health = da === 0 && de === 0 ? (delta("queries") ? "waiting" : "idle")
      : de === 0 ? "ok" : da === 0 ? "failing" : "degraded";
    const tr = el("tr");
    cell(tr, u.url);
    cell(tr, fmtRate(last(q)), "num");
    cell(tr, fmtRate(last(e)), "num");
    const reasons = Object.entries(u.errors_by_reason).map(([k, v]) => k + " " + v).join(", ");
    const td = cell(tr, health, "health " + health);
    if (reasons) td.setAttribute("title", "failures since start: " + reasons);
    body.appendChild(tr);
  }
}

function drawPortal(portal) {
  const s5 = portal.socks5, hp = portal.http_proxy;
  $("socks5-clients").textContent = String(s5.clients);
  $("http-clients").textContent = String(hp.clients);
  $("portal-accepted").textContent = String(s5.accepted + hp.accepted);
  chart($("chart-clients"), [samples.map((s) => s.stats.portal.socks5.clients),
    samples.map((s) => s.stats.portal.http_proxy.clients)]);
  const body = $("replies").tBodies[0];
  clear(body);
  for (const [kind, label] of [["socks5", "SOCKS5"], ["http_proxy", "HTTP"]]) {
    for (const [reply, count] of Object.entries(portal[kind].replies)) {
      const r = rates((s) => s.stats.portal[kind].replies[reply]);
      const tr = el("tr");
      cell(tr, label);
      const good = reply === "succeeded" || reply.startsWith("2");
      cell(tr, reply, good ? "reply-ok" : "reply-err");
      cell(tr, String(count), "num");
      cell(tr, fmtRate(last(r)), "num");
      body.appendChild(tr);
    }
  }
  if (!body.rows.length) {
    const tr = el("tr");
    cell(tr, "no portal requests yet", "empty").setAttribute("colspan", "4");
    body.appendChild(tr);
  }
}

function drawStatus(status) {
  $("node-name").textContent = status.name;
  $("node-id").textContent = status.id ? "id " + status.id : "";
  document.title = status.name + " · meshgate console";
  const addrs = [status.ipv4, status.ipv6].filter(Boolean).join(", ");
  $("node-facts").textContent = "network " + status.network + (addrs ? " · " + addrs : "") + " · v" +
    status.version + " · up " + fmtUptime(status.uptime) + " · services: " + Object.keys(status.services).join(", ");
}

function drawAuth(needToken) {
  const form = $("auth");
  form.hidden = !(tokenConfigured || needToken);
  $("reload").hidden = !tokenConfigured || !token;
  if (needToken) $("auth-note").textContent = "this API needs the admin token to be read";
  else if (tokenConfigured && !token) $("auth-note").textContent = "type the token to reload the config";
  else if ($("auth-note").dataset.sticky !== "1") $("auth-note").textContent = "";
}

function setConn(ok, text) {
  const c = $("conn");
  c.className = "conn " + (ok ? "ok" : "err");
  c.textContent = text;
}

async function poll() {
  try {
    const [status, peers, routes, stats] = await Promise.all([
      api("/status"), api("/peers"), api("/routes"), api("/console/stats")]);
    tokenConfigured = !!stats.admin.token;
    samples.push({ t: Date.now(), peers, stats });
    while (samples.length > KEEP) samples.shift();
    drawStatus(status);
    drawGraph(stats.mesh);
    drawPeers(peers);
    drawRoutes(routes, stats.mesh);
    drawDns(stats.dns);
    drawPortal(stats.portal);
    drawAuth(false);
    if (!configShown) {
      configShown = JSON.stringify(await api("/config"), null, 2);
      $("config").textContent = configShown;
    }
    setConn(true, "live · " + samples.length + " samples");
    $("last-update").textContent = "last update " + new Date().toLocaleTimeString();
  } catch (e) {
    setConn(false, e.message);
    if (e.status === 401) drawAuth(true);
  }
}

async function reload() {
  const note = $("auth-note");
  note.dataset.sticky = "1";
  try {
    const r = await fetch("/reload", { method: "POST", headers: { Authorization: "Bearer " + token }, cache: "no-store" });
    const body = await r.json().catch(() => ({}));
    note.textContent = r.ok ? "reload: " + body.message : "reload refused: HTTP " + r.status;
    if (r.ok && body.applied) configShown = ""; // show the new config on the next poll
  } catch (e) {
    note.textContent = "reload failed: " + e.message;
  }
}

document.addEventListener("DOMContentLoaded", () => {
  $("auth").addEventListener("submit", (ev) => {
    ev.preventDefault();
    token = $("token").value.trim();
    $("auth-note").dataset.sticky = "";
    poll();
  });
  $("reload").addEventListener("click", reload);
  poll();
  setInterval(poll, POLL_MS);
});
