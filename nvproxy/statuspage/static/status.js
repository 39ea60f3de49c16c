// nvproxy status page: reads /admin/events (snapshot, then updates) and
// keeps the page current.  No dependencies, no inline code (strict CSP).
"use strict";
(function () {
  var READINESS = ["awake", "waking", "sleeping", "offloaded", "restarting"];
  var WINDOW_MS = 10 * 60 * 1000;
  var view = null;
  var skew = 0; // server clock minus ours, in ms
  var points = new Map(); // workload id -> {t, ttft, tps}

  function $(id) { return document.getElementById(id); }
  function el(tag, cls, text) {
    var e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined && text !== null) e.textContent = String(text);
    return e;
  }
  function serverNow() { return Date.now() + skew; }
  function clear(node) { while (node.firstChild) node.removeChild(node.firstChild); }
  function ago(ms) {
    if (ms === null || ms === undefined) return "–";
    var s = Math.max(0, Math.round((serverNow() - ms) / 1000));
    if (s < 60) return s + " s ago";
    if (s < 3600) return Math.floor(s / 60) + " min ago";
    return Math.floor(s / 3600) + " h ago";
  }
  function fmtMs(ms) {
    if (ms === null || ms === undefined) return "–";
    return ms < 1000 ? Math.round(ms) + " ms" : (ms / 1000).toFixed(ms < 10000 ? 2 : 1) + " s";
  }
  function fmtNum(x, digits) {
    return x === null || x === undefined ? "–" : Number(x).toFixed(digits);
  }
  function emptyRow(tbody, cols, text) {
    var tr = el("tr", "empty-row"); var td = el("td", null, text);
    td.colSpan = cols; tr.appendChild(td); tbody.appendChild(tr);
  }

  // -- sections ------------------------------------------------------------

  function renderHeader() {
    $("node-id").textContent = view.node || "";
    document.title = "nvproxy " + (view.node || "") + " status";
    $("sum-nodes").textContent = "nodes " + view.nodes.length;
    $("sum-models").textContent = "models " + view.models.length;
    $("sum-inflight").textContent = "in flight " + view.inflight;
    $("sum-draining").hidden = !view.draining;
    $("drain").hidden = !!view.draining;
    $("undrain").hidden = !view.draining;
  }

  function renderNodes() {
    var box = $("nodes"); clear(box);
    $("nodes-count").textContent = view.nodes.length;
    view.nodes.forEach(function (node) {
      var card = el("div", "node" + (node.self ? " self" : "") + (node.draining ? " draining" : ""));
      card.dataset.node = node.id;
      var h = el("h3"); h.appendChild(el("span", "name", node.id));
      if (node.self) h.appendChild(el("span", "tag", "this node"));
      if (node.draining) h.appendChild(el("span", "tag drain", "draining"));
      card.appendChild(h);
      var ul = el("ul");
      Object.keys(node.engines).sort().forEach(function (engine) {
        var e = node.engines[engine];
        var li = el("li"); li.appendChild(el("span", null, engine));
        var text = e.models + (e.models === 1 ? " model" : " models");
        if (e.in_flight !== null && e.in_flight !== undefined) text += " · " + e.in_flight + " in flight";
        li.appendChild(el("b", null, text)); ul.appendChild(li);
      });
      var res = el("li"); res.appendChild(el("span", null, "reservations"));
      res.appendChild(el("b", null, node.reservations || 0)); ul.appendChild(res);
      card.appendChild(ul); box.appendChild(card);
    });
  }

  function renderModels() {
    var body = $("models"); clear(body);
    var filter = $("model-filter").value.trim().toLowerCase();
    $("models-count").textContent = view.models.length;
    var shown = 0;
    view.models.forEach(function (m) {
      var nodes = m.where.map(function (w) { return w.node; }).join(" ");
      if (filter && (m.name + " " + m.engine + " " + nodes).toLowerCase().indexOf(filter) < 0) return;
      shown++;
      var tr = el("tr"); tr.dataset.model = m.name;
      tr.appendChild(el("td", "model", m.name));
      tr.appendChild(el("td", null, m.engine));
      var td = el("td"); var where = el("div", "where");
      m.where.forEach(function (w) {
        var text = w.node;
        if (w.readiness !== "awake") {
          text += " · " + w.readiness;
          if (w.wake_estimate_s) text += " ~" + Math.round(w.wake_estimate_s) + " s";
        }
        var chip = el("span", "place r-" + w.readiness, text);
        chip.title = w.node + ": " + w.readiness +
          (w.wake_estimate_s ? " (wake estimate " + w.wake_estimate_s + " s)" : "");
        where.appendChild(chip);
      });
      td.appendChild(where); tr.appendChild(td); body.appendChild(tr);
    });
    if (!shown) emptyRow(body, 3, filter ? "no model matches" : "no node advertises a model");
  }

  function button(text, action) {
    var b = el("button", "btn", text); b.type = "button";
    b.addEventListener("click", function () { action(b); });
    return b;
  }

  function renderServices() {
    var body = $("services"); clear(body);
    $("services-section").hidden = view.services.length === 0;
    view.services.forEach(function (s) {
      var tr = el("tr"); tr.dataset.service = s.name;
      tr.appendChild(el("td", "model", s.name));
      tr.appendChild(el("td", null, s.model));
      var st = el("td"); st.appendChild(el("span", "place r-" + s.readiness, s.state +
        (s.sleep_depth && s.state !== "awake" ? " (" + s.sleep_depth + ")" : "")));
      tr.appendChild(st);
      tr.appendChild(el("td", "num", s.active_requests));
      tr.appendChild(el("td", "num", s.held_requests));
      tr.appendChild(el("td", "ago", s.last_activity ? ago(s.last_activity * 1000) : "–"));
      var act = el("td"); var btns = el("div", "btns");
      var name = encodeURIComponent(s.name);
      btns.appendChild(button("Wake", function (b) { call(b, "POST", "/admin/wake/" + name); }));
      btns.appendChild(button("Sleep", function (b) { call(b, "POST", "/admin/sleep/" + name + "?level=1"); }));
      btns.appendChild(button("Offload", function (b) { call(b, "POST", "/admin/sleep/" + name + "?level=2"); }));
      act.appendChild(btns); tr.appendChild(act); body.appendChild(tr);
    });
  }

  function renderWorkloads() {
    var body = $("workloads"); clear(body);
    view.workloads.forEach(function (w) {
      var tr = el("tr"); tr.dataset.workload = w.id;
      var when = el("td", "ago", ago(w.createdAt)); when.dataset.t = w.createdAt; tr.appendChild(when);
      tr.appendChild(el("td", "model", w.model));
      tr.appendChild(el("td", null, w.engine));
      tr.appendChild(el("td", "nowrap", w.node || "–"));
      var state = w.state + (w.truncated ? " (truncated)" : "");
      var st = el("td", "s-" + w.state, state); if (w.error) st.title = w.error; tr.appendChild(st);
      tr.appendChild(el("td", "num", fmtMs(w.ttftMs)));
      tr.appendChild(el("td", "num", fmtNum(w.tokensPerSecond, 1)));
      tr.appendChild(el("td", "num", fmtMs(w.durationMs)));
      tr.appendChild(el("td", "rid", w.requestId || ""));
      body.appendChild(tr);
    });
    if (!view.workloads.length) emptyRow(body, 9, "no workload yet");
  }

  // -- charts --------------------------------------------------------------

  function collect() {
    view.workloads.forEach(function (w) {
      if (w.completedAt && (w.ttftMs !== null || w.tokensPerSecond !== null)) {
        points.set(w.id + "@" + w.createdAt, { t: w.completedAt, ttft: w.ttftMs, tps: w.tokensPerSecond });
      }
    });
    var cutoff = serverNow() - WINDOW_MS;
    points.forEach(function (p, key) { if (p.t < cutoff) points.delete(key); });
  }

  var SVG = "http://www.w3.org/2000/svg";
  function svg(tag, attrs, text) {
    var e = document.createElementNS(SVG, tag);
    Object.keys(attrs).forEach(function (k) { e.setAttribute(k, attrs[k]); });
    if (text !== undefined) e.textContent = text;
    return e;
  }
  function niceMax(v) {
    if (!(v > 0)) return 1;
    var p = Math.pow(10, Math.floor(Math.log10(v)));
    var steps = [1, 2, 5, 10];
    for (var i = 0; i < steps.length; i++) if (steps[i] * p >= v) return steps[i] * p;
    return 10 * p;
  }
  function chart(id, key) {
    var box = $(id); clear(box);
    var W = 600, H = 160, L = 44, R = 8, B = 18, T = 8;
    var now = serverNow(), from = now - WINDOW_MS;
    var data = [];
    points.forEach(function (p) { if (p[key] !== null && p[key] !== undefined) data.push(p); });
    data.sort(function (a, b) { return a.t - b.t; });
    var max = niceMax(Math.max.apply(null, data.map(function (p) { return p[key]; }).concat([0])) * 1.05);
    for (var i = 0; i <= 4; i++) {
      var y = T + (H - T - B) * i / 4;
      box.appendChild(svg("line", { x1: L, x2: W - R, y1: y, y2: y, "class": "grid" }));
      var v = max * (4 - i) / 4;
      box.appendChild(svg("text", { x: L - 4, y: y + 4, "text-anchor": "end", "class": "axis" },
        v >= 100 ? Math.round(v) : +v.toFixed(2)));
    }
    [10, 5, 0].forEach(function (m) {
      var x = L + (W - R - L) * (1 - m / 10);
      box.appendChild(svg("text", { x: Math.min(x, W - 2), y: H - 4, "text-anchor": m ? "middle" : "end", "class": "axis" },
        m ? "-" + m + " min" : "now"));
    });
    if (!data.length) {
      box.appendChild(svg("text", { x: (W + L) / 2, y: H / 2, "text-anchor": "middle", "class": "empty" }, "no data yet"));
      return;
    }
    var xy = data.map(function (p) {
      var x = L + (W - R - L) * Math.min(1, Math.max(0, (p.t - from) / WINDOW_MS));
      var y = T + (H - T - B) * (1 - p[key] / max);
      return [x.toFixed(1), y.toFixed(1)];
    });
    xy.forEach(function (c) { box.appendChild(svg("circle", { cx: c[0], cy: c[1], r: 2.5, "class": "dot" })); });
  }

  // -- wiring --------------------------------------------------------------

  function render() {
    if (!view) return;
    renderHeader(); renderNodes(); renderModels(); renderServices(); renderWorkloads();
    collect(); chart("chart-ttft", "ttft"); chart("chart-tps", "tps");
  }

  function message(text, error) {
    var m = $("message"); m.textContent = text; m.hidden = !text;
    m.className = "message" + (error ? " error" : "");
  }

  function call(b, method, url) {
    if (b) b.disabled = true;
    message(method + " " + url + " …", false);
    fetch(url, { method: method, headers: { "content-type": "application/json" }, body: method === "GET" ? undefined : "{}" })
      .then(function (r) {
        return r.text().then(function (t) {
          var detail = t;
          try { var j = JSON.parse(t); detail = j.error || j.state || JSON.stringify(j); } catch (e) { /* text */ }
          message(method + " " + url + ": " + r.status + (detail ? " — " + detail : ""), !r.ok);
        });
      })
      .catch(function (e) { message(method + " " + url + " failed: " + e, true); })
      .then(function () { if (b) b.disabled = false; });
  }

  function connect() {
    var source = new EventSource("/admin/events");
    var conn = $("conn");
    source.addEventListener("open", function () { conn.textContent = "live"; conn.className = "conn on"; });
    source.addEventListener("error", function () { conn.textContent = "reconnecting…"; conn.className = "conn off"; });
    source.addEventListener("snapshot", function (e) {
      var data = JSON.parse(e.data);
      skew = data.now - Date.now(); view = data.view; render();
      document.body.dataset.seq = data.seq;
    });
    source.addEventListener("update", function (e) {
      var data = JSON.parse(e.data);
      if (!view) return;
      skew = data.now - Date.now();
      Object.keys(data.changed).forEach(function (k) { view[k] = data.changed[k]; });
      render();
      document.body.dataset.seq = data.seq;
      document.body.dataset.updates = Number(document.body.dataset.updates || 0) + 1;
    });
  }

  document.addEventListener("DOMContentLoaded", function () {
    var legend = $("legend");
    READINESS.forEach(function (r) { legend.appendChild(el("span", "place r-" + r, r)); });
    $("model-filter").addEventListener("input", function () { if (view) renderModels(); });
    $("drain").addEventListener("click", function () { call($("drain"), "POST", "/admin/drain"); });
    $("undrain").addEventListener("click", function () { call($("undrain"), "DELETE", "/admin/drain"); });
    setInterval(function () {
      if (!view) return;
      Array.prototype.forEach.call(document.querySelectorAll("#workloads td.ago"), function (td) {
        td.textContent = ago(Number(td.dataset.t));
      });
      collect(); chart("chart-ttft", "ttft"); chart("chart-tps", "tps");
    }, 5000);
    connect();
  });
})();
