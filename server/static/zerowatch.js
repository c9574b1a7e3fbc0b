/* zerowatch pages: draw the figures the server embedded, keep live runs up to date, and the
 * "compare selected" action. Data reaches the DOM only through textContent and Plotly. */
(function () {
  "use strict";

  function readJSON(id) {
    var el = document.getElementById(id);
    return el ? JSON.parse(el.textContent) : null;
  }

  var config = readJSON("zw-plot-config") || { responsive: true, displaylogo: false };

  function draw(figures, react) {
    if (typeof Plotly === "undefined") return;
    Object.keys(figures).forEach(function (key) {
      var div = document.getElementById("chart-" + key);
      if (!div) return;
      var fig = figures[key];
      if (react) {
        Plotly.react(div, fig.data, fig.layout, config);
      } else {
        Plotly.newPlot(div, fig.data, fig.layout, config);
        rowLinks(div);
      }
    });
  }

  // A chart whose layout.meta.rowLinks holds one address per row of its first trace (the
  // rank heatmap): a click on a row opens it.
  function rowLinks(div) {
    if (!div.on) return;
    div.on("plotly_click", function (ev) {
      var meta = div.layout && div.layout.meta;
      var links = meta && meta.rowLinks;
      var pt = ev && ev.points && ev.points[0];
      if (!links || !pt) return;
      var row = pt.data.y.indexOf(pt.y);
      if (row >= 0 && links[row]) window.location.href = links[row];
    });
  }

  // Swap traces for their spike-keeping versions from the series API (see pages._refine).
  // A live page re-fetches them at most every REFINE_MS; between fetches it keeps the last
  // refined points and appends the newer sampled ones, so a spike never blinks away.
  var REFINE_MS = 30000;
  var refined = {};  // "chart/trace" -> {steps, values, at}

  function applyRefined(r) {
    var got = refined[r.chart + "/" + r.trace];
    var div = document.getElementById("chart-" + r.chart);
    if (!got || !div || !div.data || !div.data[r.trace]) return;
    var x = got.steps.slice(), y = got.values.slice();
    var last = x.length ? x[x.length - 1] : -Infinity;
    var sx = div.data[r.trace].x || [], sy = div.data[r.trace].y || [];
    for (var i = 0; i < sx.length; i++) {
      if (sx[i] > last) { x.push(sx[i]); y.push(sy[i]); }
    }
    Plotly.restyle(div, { x: [x], y: [y] }, [r.trace]);
    div.setAttribute("data-refined", String(x.length));
  }

  function refine(list) {
    (list || []).forEach(function (r) {
      var key = r.chart + "/" + r.trace;
      if (refined[key] && Date.now() - refined[key].at < REFINE_MS) {
        applyRefined(r);
        return;
      }
      fetch(r.url, { headers: { Accept: "application/json" } })
        .then(function (resp) { return resp.ok ? resp.json() : null; })
        .then(function (body) {
          var s = body && body.series && body.series[0];
          if (!s) return;
          refined[key] = { steps: s.steps, values: s.values, at: Date.now() };
          applyRefined(r);
        })
        .catch(function () { /* the sampled trace stays */ });
    });
  }

  function setText(id, value) {
    var el = document.getElementById(id);
    if (el && value !== undefined && value !== null) el.textContent = String(value);
  }

  function live(body) {
    var url = body.getAttribute("data-live-url");
    if (!url) return;
    var lastStep = parseInt(body.getAttribute("data-last-step") || "-1", 10);
    var status = body.getAttribute("data-status");
    if (status !== "running" && status !== "stalled") return;
    var badge = document.querySelector("#run-status .badge");
    var dot = document.createElement("span");
    dot.className = "live-dot";
    dot.title = "live: updates every few seconds";
    if (badge) badge.parentNode.appendChild(dot);
    // One request at a time: the next poll is scheduled when the answer is in, so a slow
    // answer can never land after a newer one (and, say, turn "finished" back to "running").
    var every = parseInt(body.getAttribute("data-poll-ms") || "3000", 10);
    var done = false;
    function handle(msg) {
      if (!msg) return;
      if (msg.figures && Object.keys(msg.figures).length) {
        if (!document.getElementById("chart-" + Object.keys(msg.figures)[0])) {
          done = true;
          window.location.reload();  // first steps of an empty run: the layout changes
          return;
        }
        draw(msg.figures, true);
        refine(msg.refine);
      }
      lastStep = msg.last_step;
      var s = msg.summary || {};
      Object.keys(s).forEach(function (k) { setText("stat-" + k, s[k]); });
      if (badge && msg.status) {
        badge.textContent = msg.status;
        badge.className = "badge badge-" + msg.status;
        if (msg.status_color) badge.style.setProperty("--badge", msg.status_color);
      }
      if (msg.status !== "running" && msg.status !== "stalled") {
        done = true;
        dot.remove();
      }
    }
    function poll() {
      fetch(url + "?since=" + lastStep, { headers: { Accept: "application/json" } })
        .then(function (r) { return r.ok ? r.json() : null; })
        .then(handle)
        .catch(function () { /* the next poll retries */ })
        .then(function () { if (!done) setTimeout(poll, every); });
    }
    setTimeout(poll, every);
  }

  function compareSelection() {
    var form = document.getElementById("compare-form");
    if (!form) return;
    var button = document.getElementById("compare-selected");
    function selected() {
      return Array.prototype.map.call(
        form.querySelectorAll("input[name=runs]:checked"), function (c) { return c.value; });
    }
    form.addEventListener("change", function () {
      var n = selected().length;
      button.disabled = n < 1;
      setText("compare-hint", n ? n + " selected" : "Select two or more runs.");
    });
    form.addEventListener("submit", function (e) {
      e.preventDefault();
      var ids = selected();
      if (ids.length) {
        window.location.href = "/compare?runs=" + ids.map(encodeURIComponent).join(",");
      }
    });
  }

  document.addEventListener("DOMContentLoaded", function () {
    var figures = readJSON("zw-figures");
    if (figures) draw(figures, false);
    if (figures) refine(readJSON("zw-refine"));
    live(document.body);
    compareSelection();
  });
})();
