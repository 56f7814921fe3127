/* msprobe report viewer: dump trees, compare trees, monitor charts. Plain DOM, no libraries, no network.
   The data sits in the JSON element #report-data; tree nodes are built only when their
   parent is expanded (PAGE children at a time), charts only when scrolled into view. */
(function () {
  "use strict";
  var PAGE = 200;
  var VERDICTS = ["pass", "warning", "error", "unmatched"];
  var COLORS = ["#1d4ed8", "#d97706", "#059669", "#7c3aed", "#db2777", "#0891b2", "#65a30d", "#9f1239"];
  var STAT_HEAD = ["path", "dtype", "shape", "Max", "Min", "Mean", "Norm", "md5 / file"];

  function el(tag, cls, text) {
    var e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined && text !== null) e.textContent = text;
    return e;
  }
  function isBad(v) { return v === "NaN" || v === "Inf" || v === "-Inf"; }
  function fmt(v) {
    if (v === null || v === undefined) return "";
    if (typeof v === "number") {
      if (Number.isInteger(v)) return String(v);
      var a = Math.abs(v);
      return (a !== 0 && (a < 1e-4 || a >= 1e6)) ? v.toExponential(4) : String(+v.toPrecision(6));
    }
    return String(v);
  }
  function table(head, rows, numFrom) {
    var t = el("table"), tr = el("tr");
    head.forEach(function (h) { tr.appendChild(el("th", null, h)); });
    t.appendChild(tr);
    rows.forEach(function (r) {
      var row = el("tr");
      r.forEach(function (v, k) {
        var td = el("td", k >= numFrom && typeof v !== "string" ? "num" : null, fmt(v));
        if (isBad(v)) td.className = "bad";
        row.appendChild(td);
      });
      t.appendChild(row);
    });
    return t;
  }
  function section(host, title, content) {
    host.appendChild(el("h3", null, title));
    if (content) host.appendChild(content);
  }

  /* ------------------------------------------------------------------ lazy tree */
  function Tree(host, data, opts) {
    var n = data.names.length, i, p;
    this.d = data; this.opts = opts || {}; this.host = host;
    this.kids = new Array(n); this.roots = []; this.el = new Array(n); this.selected = -1;
    for (i = 0; i < n; i++) {
      p = data.parent[i];
      if (p < 0 || p >= n || p === i) this.roots.push(i);
      else (this.kids[p] || (this.kids[p] = [])).push(i);
    }
    this.nan = {};
    (data.nan || []).forEach(function (k) { this.nan[k] = true; }, this);
    this.rootUl = el("ul", "tree");
    host.appendChild(this.rootUl);
    this.renderList(this.rootUl, this.roots, 0);
    var self = this;
    host.addEventListener("click", function (e) { self.onClick(e); });
    host.addEventListener("dblclick", function (e) {
      var li = e.target.closest("li[data-i]");
      if (li) self.toggle(+li.dataset.i);
    });
  }
  Tree.prototype.renderList = function (ul, ids, from) {
    var end = Math.min(ids.length, from + PAGE), frag = document.createDocumentFragment(), k;
    for (k = from; k < end; k++) frag.appendChild(this.node(ids[k]));
    if (end < ids.length) {
      var more = el("li", "more", "show " + Math.min(PAGE, ids.length - end) + " more (" + (ids.length - end) + " left)");
      frag.appendChild(more);
    }
    ul._ids = ids; ul._shown = end;
    ul.appendChild(frag);
  };
  Tree.prototype.node = function (i) {
    var li = el("li"), row = el("div", "row"), kids = this.kids[i];
    li.dataset.i = i;
    row.appendChild(el("span", "tog", kids ? "\u25b8" : "\u00b7"));
    row.appendChild(el("span", "name", this.d.names[i]));
    if (kids) row.appendChild(el("span", "count", String(kids.length)));
    if (this.nan[i]) row.appendChild(el("span", "badge nan", "NaN/Inf"));
    if (this.opts.decorate) this.opts.decorate(i, row);
    li.appendChild(row);
    this.el[i] = li;
    return li;
  };
  Tree.prototype.childList = function (i) {
    var li = this.el[i];
    return li && li.lastChild.tagName === "UL" ? li.lastChild : null;
  };
  Tree.prototype.toggle = function (i, open) {
    var li = this.el[i];
    if (!li || !this.kids[i]) return;
    var ul = this.childList(i);
    var want = open === undefined ? !(ul && !ul.hidden) : open;
    if (want && !ul) { ul = el("ul"); li.appendChild(ul); this.renderList(ul, this.kids[i], 0); }
    if (ul) ul.hidden = !want;
    li.firstChild.firstChild.textContent = want ? "\u25be" : "\u25b8";
  };
  Tree.prototype.showMore = function (ul) {
    var more = ul.lastChild;
    if (more && more.className === "more") ul.removeChild(more);
    this.renderList(ul, ul._ids, ul._shown);
  };
  Tree.prototype.ensureShown = function (ul, i) {
    var pos = ul._ids.indexOf(i);
    while (pos >= ul._shown) this.showMore(ul);
  };
  Tree.prototype.chain = function (i) {
    var out = [], p = this.d.parent[i], guard = this.d.names.length;
    while (p >= 0 && guard-- > 0) { out.push(p); p = this.d.parent[p]; }
    return out;
  };
  Tree.prototype.reveal = function (i, scroll) {
    if (i < 0 || i >= this.d.names.length) return;
    var chain = this.chain(i).reverse(), ul = this.rootUl, k;
    for (k = 0; k < chain.length; k++) {
      this.ensureShown(ul, chain[k]);
      this.toggle(chain[k], true);
      ul = this.childList(chain[k]);
    }
    this.ensureShown(ul, i);
    this.select(i, scroll !== false);
  };
  Tree.prototype.select = function (i, scroll) {
    if (this.selected >= 0 && this.el[this.selected]) this.el[this.selected].firstChild.classList.remove("sel");
    this.selected = i;
    var li = this.el[i];
    if (!li) return;
    li.firstChild.classList.add("sel");
    if (scroll) li.firstChild.scrollIntoView({ block: "center" });
    if (this.opts.onSelect) this.opts.onSelect(i);
  };
  Tree.prototype.onClick = function (e) {
    var t = e.target, li;
    if (t.classList.contains("more")) { this.showMore(t.parentNode); return; }
    li = t.closest("li[data-i]");
    if (!li) return;
    if (t.classList.contains("tog")) { this.toggle(+li.dataset.i); return; }
    this.select(+li.dataset.i, false);
  };
  Tree.prototype.lower = function () {
    return this._lower || (this._lower = this.d.names.map(function (s) { return s.toLowerCase(); }));
  };

  /* ------------------------------------------------------------------ search */
  function search(input, results, trees, onPick) {
    var timer = null;
    function run() {
      var q = input.value.trim().toLowerCase(), found = 0, total = 0;
      results.textContent = "";
      if (!q) return;
      trees().forEach(function (tree, side) {
        var lower = tree.lower(), i;
        for (i = 0; i < lower.length; i++) {
          if (lower[i].indexOf(q) < 0) continue;
          total++;
          if (found >= 200) continue;
          var li = el("li", null, tree.d.names[i]);
          li.dataset.i = i; li.dataset.side = side;
          results.appendChild(li);
          found++;
        }
      });
      results.insertBefore(el("li", "count", total + " match" + (total === 1 ? "" : "es") +
        (total > found ? " (first " + found + " shown)" : "")), results.firstChild);
    }
    input.addEventListener("input", function () { clearTimeout(timer); timer = setTimeout(run, 120); });
    input.addEventListener("keydown", function (e) {
      if (e.key !== "Enter") return;
      run();
      var first = results.querySelector("li[data-i]");
      if (first) first.click();
    });
    results.addEventListener("click", function (e) {
      var li = e.target.closest("li[data-i]");
      if (li) onPick(+li.dataset.i, +li.dataset.side);
    });
  }

  /* ------------------------------------------------------------------ record details */
  function recordDetail(host, tree, i, extra) {
    var d = tree.d;
    host.textContent = "";
    host.appendChild(el("div", "name", d.names[i]));
    if (extra) extra(host);
    var leaves = d.leaves[i] || [];
    section(host, "Tensors and arguments (" + leaves.length + ")", leaves.length ? table(STAT_HEAD, leaves, 3) : el("div", "meta", "no data recorded for this node"));
    var chain = tree.chain(i);
    if (chain.length) {
      var div = el("div");
      chain.forEach(function (p, k) {
        if (k) div.appendChild(document.createTextNode(" \u2190 "));
        var a = el("span", "link", d.names[p]);
        a.addEventListener("click", function () { tree.reveal(p); });
        div.appendChild(a);
      });
      section(host, "Parent chain (innermost first)", div);
    }
    var s = d.stack[i];
    if (s >= 0) {
      var note = d.stack_from[i] ? " (" + d.stack_from[i] + ")" : "";
      section(host, "Stack, innermost last" + note, el("pre", "stack", d.stacks[s].join("\n")));
    } else {
      section(host, "Stack", el("div", "meta", "stack.json has no stack for this record"));
    }
  }

  function header(title, meta) {
    var h = el("header");
    h.appendChild(el("h1", null, title));
    if (meta) h.appendChild(el("span", "meta", meta));
    document.body.appendChild(h);
    return h;
  }
  function picker(h, labels, selected, onChange) {
    if (labels.length < 2) return;
    var s = el("select");
    labels.forEach(function (l, k) { var o = el("option", null, l); o.value = k; s.appendChild(o); });
    s.value = selected;
    s.addEventListener("change", function () { onChange(+s.value); });
    h.appendChild(s);
  }
  function pane(title) {
    var p = el("div", "pane");
    p.appendChild(el("h2", null, title));
    var results = el("ul", "results");
    p.appendChild(results);
    var body = el("div");
    p.appendChild(body);
    return { pane: p, body: body, results: results };
  }

  /* ------------------------------------------------------------------ dump view */
  function dumpView(R) {
    var D = R.data, h = header(R.title, D.units.length + " rank folder(s)"), cur = null;
    var box = el("input"); box.type = "search"; box.placeholder = "search records (Enter jumps)"; box.id = "search";
    picker(h, D.units.map(function (u) { return u.label + " (" + u.names.length + " nodes)"; }), D.selected, show);
    h.appendChild(box);
    if (D.banner) document.body.appendChild(banner(D.banner, function (unit, node) { show(unit); cur.reveal(node); }));
    var main = el("main"), left = pane("Module tree (construct.json); double-click or \u25b8 expands"),
        detail = el("div", "detail");
    main.appendChild(left.pane); main.appendChild(detail);
    document.body.appendChild(main);
    search(box, left.results, function () { return [cur]; }, function (i) { cur.reveal(i); });
    var shown = -1;
    function show(k) {
      if (k === shown) return;
      shown = k;
      left.body.textContent = ""; left.results.textContent = ""; detail.textContent = "";
      var unit = D.units[k];
      cur = new Tree(left.body, unit, {
        onSelect: function (i) { recordDetail(detail, cur, i); },
        decorate: function (i, row) { if (D.highlight && D.highlight.unit === k && D.highlight.node === i) row.classList.add("mark"); }
      });
      detail.appendChild(el("div", "meta", unit.path + "  task " + unit.task + ", level " + unit.level +
        " \u2014 click a node for its statistics, parent chain and stack"));
    }
    show(D.selected);
    if (D.highlight && D.highlight.unit === D.selected) cur.reveal(D.highlight.node);
  }

  function banner(b, go) {
    var div = el("div", "banner" + (b.ok ? " ok" : ""));
    div.id = "banner";
    var head = el("div");
    head.appendChild(el("b", null, b.title + ": "));
    if (b.link) {
      var a = el("span", "link", b.text);
      a.addEventListener("click", function () { go(b.link[0], b.link[1]); });
      head.appendChild(a);
    } else head.appendChild(document.createTextNode(b.text));
    div.appendChild(head);
    if (b.items && b.items.length) {
      var ul = el("ul");
      b.items.forEach(function (it) {
        var li = el("li");
        if (it.link) {
          var a = el("span", "link", it.text);
          a.addEventListener("click", function () { go(it.link[0], it.link[1]); });
          li.appendChild(a);
        } else li.textContent = it.text;
        ul.appendChild(li);
      });
      div.appendChild(ul);
    }
    return div;
  }

  /* ------------------------------------------------------------------ compare view */
  function compareView(R) {
    var C = R.data, h = header(R.title, (C.target || "") + "  vs  " + (C.golden || ""));
    var legend = el("span", "legend");
    VERDICTS.forEach(function (v) { legend.appendChild(el("span", v, v)); });
    var box = el("input"); box.type = "search"; box.placeholder = "search records (Enter jumps)"; box.id = "search";
    var start = C.first_pair === null || C.first_pair === undefined ? 0 : C.first_pair;
    picker(h, C.pairs.map(function (p) { return p.label + (p.divergence ? " (diverges)" : ""); }), start, show);
    h.appendChild(box); h.appendChild(legend);
    var top = el("div"); document.body.appendChild(top);
    var main = el("main"), left = pane("Target"), right = pane("Golden"), detail = el("div", "detail");
    main.appendChild(left.pane); main.appendChild(right.pane); main.appendChild(detail);
    document.body.appendChild(main);
    var P = null, T = null, G = null;
    search(box, left.results, function () { return [T, G]; }, function (i, side) { pick(side === 0 ? "t" : "g", i, true); });

    function errorAncestors(data, verdict) {
      var mark = {}, n = data.names.length;
      verdict.forEach(function (v, i) {
        if (v !== 2) return;
        for (var p = data.parent[i], guard = n; p >= 0 && guard-- > 0 && !mark[p]; p = data.parent[p]) mark[p] = true;
      });
      return mark;
    }
    function decorator(verdictOf, marks, divIndex) {
      return function (i, row) {
        var v = verdictOf[i];
        if (v >= 0) row.classList.add("v-" + VERDICTS[v]);
        if (marks[i] && v !== 2) row.appendChild(el("span", "badge err", "contains errors"));
        if (i === divIndex) row.classList.add("mark");
      };
    }
    function pick(side, i, scroll) {
      var other = side === "t" ? P.t_match[i] : P.g_match[i];
      var mine = side === "t" ? T : G, theirs = side === "t" ? G : T;
      if (mine.selected !== i) mine.reveal(i, scroll);
      if (other >= 0 && theirs.selected !== other) theirs.reveal(other, scroll);
      compareDetail(side, i, other);
    }
    function compareDetail(side, i, other) {
      var ti = side === "t" ? i : other, gi = side === "t" ? other : i;
      var rows = P.rows[ti >= 0 ? "t" + ti : "g" + gi] || [];
      var div = P.divergence && P.divergence.t === ti && ti >= 0 ? P.divergence : null;
      recordDetail(detail, side === "t" ? T : G, i, function (host) {
        var v = side === "t" ? P.t_verdict[i] : P.g_verdict[i];
        host.appendChild(el("div", null, "result: " + (v >= 0 ? VERDICTS[v] : "not compared") +
          (other >= 0 ? "  \u2014 paired with " + (side === "t" ? G : T).d.names[other] : "  \u2014 no counterpart")));
        if (div) host.appendChild(el("div", "bad", "first divergence" + (div.inputs_differ ?
          ": its inputs already differ (made outside the dumped calls)" : "") + (div.parent ? "; parent " + div.parent : "")));
        if (rows.length) section(host, "Compared tensors", table(["path", "result", "message"].concat(P.columns), rows, 3));
      });
      if (side === "t" && ti >= 0 && !T.d.stacks.length && div && div.stack.length) {
        section(detail, "Stack (from compare_summary.json), innermost last", el("pre", "stack", div.stack.join("\n")));
      }
    }
    var shown = -1;
    function show(k) {
      if (k === shown) return;
      shown = k; P = C.pairs[k];
      [left, right].forEach(function (p) { p.body.textContent = ""; p.results.textContent = ""; });
      detail.textContent = ""; top.textContent = "";
      var div = P.divergence;
      T = new Tree(left.body, P.target, { decorate: decorator(P.t_verdict, errorAncestors(P.target, P.t_verdict), div ? div.t : -1),
        onSelect: function (i) { pick("t", i, false); } });
      G = new Tree(right.body, P.golden, { decorate: decorator(P.g_verdict, errorAncestors(P.golden, P.g_verdict), div ? div.g : -1),
        onSelect: function (i) { pick("g", i, false); } });
      var counts = P.counts || {};
      var text = Object.keys(counts).map(function (k) { return counts[k] + " " + k; }).join(", ");
      if (div) {
        var items = div.rows.slice(0, 6).map(function (r) { return { text: (r[0] || "record") + ": " + r[1] }; });
        if (div.parent) items.push({ text: "parent module: " + div.parent });
        top.appendChild(banner({ title: "First divergence (" + P.label + ")", text: div.record, link: ["t", div.t], items: items },
          function (side, i) { pick(side, i, true); }));
      } else {
        top.appendChild(banner({ ok: true, title: "No divergence", text: P.label + ": " + text }, function () {}));
      }
      if (div && div.t >= 0) pick("t", div.t, true);
      else if (div && div.g >= 0) pick("g", div.g, true);
    }
    show(start);
  }

  /* ------------------------------------------------------------------ monitor view */
  /* First the run at a glance (a heat map: modules down, steps across, each cell how far the module's norms
     are from their own medians, alerts marked), then each alert with the few series that matter (its origin
     and its neighbours), then every series behind a search box, built only when opened. */
  function monitorView(R) {
    var M = R.data, G = M.glance, A = M.anomalies;
    var h = header(R.title, M.charts.length + " series, " + G.modules.length + " modules, " + A.length + " alerts");
    var byChart = {};
    A.forEach(function (a) { if (a.chart >= 0) (byChart[a.chart] || (byChart[a.chart] = [])).push(a); });
    var first = A[0];
    if (first) {
      document.body.appendChild(banner({ title: "First anomaly", text: describeAlert(first), link: [first.chart, 0],
        items: [{ text: A.length + " alerts in all (below the heat map)" }] }, function (k) { focusChart(k); }));
    } else {
      document.body.appendChild(banner({ ok: true, title: "No anomalies", text: "no anomalies.json entries under this folder" }, function () {}));
    }
    var page = el("div", "monitor");
    document.body.appendChild(page);
    var glance = el("section", "glance"); glance.id = "glance";
    glance.appendChild(el("h2", null, "Run at a glance: how far each module's norms are from their own median over the run (\u00d7 factor); \u25c6 an alert"));
    page.appendChild(glance);
    heatmap(glance, G, A, function (k) { focusChart(k); });
    var alerts = el("section", "alerts"); alerts.id = "alerts";
    page.appendChild(alerts);
    A.slice(0, 20).forEach(function (a, n) {
      var card = el("div", "alert");
      var head = el("div", "alert-head");
      head.appendChild(el("b", null, "Alert " + (n + 1) + " \u00b7 step " + a.step + " \u00b7 rank " + a.rank + ": "));
      head.appendChild(document.createTextNode(describeAlert(a)));
      card.appendChild(head);
      if (a.capture) card.appendChild(el("div", "capture", "evidence (dump of the next step, open with compare/parse/report): " + a.capture));
      var grid = el("div", "grid");
      (a.related || []).forEach(function (k) {
        var c = M.charts[k], box = el("div", "chart" + (k === a.chart ? " origin" : ""));
        box.appendChild(el("div", "title", c.name + "  " + c.metric + (k === a.chart ? "  (origin)" : "")));
        box.appendChild(chartSvg(c, byChart[k] || []));
        grid.appendChild(box);
      });
      card.appendChild(grid);
      alerts.appendChild(card);
    });
    if (A.length > 20) alerts.appendChild(el("div", "meta", (A.length - 20) + " more alerts: see the table under all series"));
    var all = el("details", "all"); all.id = "all-series";
    var sum = el("summary", null, "All series (" + M.charts.length + " charts) ");
    var box = el("input"); box.type = "search"; box.placeholder = "filter by name or metric"; box.id = "search";
    sum.appendChild(box);
    all.appendChild(sum);
    page.appendChild(all);
    var host = el("div", "charts"), cards = [], built = false, observer = null;
    all.appendChild(host);
    box.addEventListener("click", function (e) { e.stopPropagation(); });
    box.addEventListener("keydown", function (e) { if (e.key === " ") e.stopPropagation(); });
    box.addEventListener("input", function () { if (!all.open) all.open = true; build(); filter(); });
    all.addEventListener("toggle", function () { if (all.open) build(); });
    function build() {
      if (built) return;
      built = true;
      if (A.length) {
        var wrap = el("details", "anomalies"), s2 = el("summary", null, "Alerts in order (" + A.length + ")");
        wrap.appendChild(s2);
        wrap.appendChild(table(["#", "step", "rank", "micro", "stage", "kind", "name", "metric", "value", "rule", "evidence"],
          A.slice(0, 500).map(function (a, k) {
            return [k + 1, a.step, a.rank, a.micro_step, a.stage, a.kind, a.name, a.metric, a.value, a.rule, a.capture || ""];
          }), 8));
        host.appendChild(wrap);
      }
      var groups = {}, order = [];
      M.charts.forEach(function (c, k) {
        if (!groups[c.name]) { groups[c.name] = []; order.push(c.name); }
        groups[c.name].push(k);
      });
      observer = "IntersectionObserver" in window ? new IntersectionObserver(function (entries) {
        entries.forEach(function (e) { if (e.isIntersecting) { draw(e.target); observer.unobserve(e.target); } });
      }, { root: page, rootMargin: "300px" }) : null;
      order.forEach(function (name) {
        var g = el("div", "group"), grid = el("div", "grid");
        g.appendChild(el("h2", null, name));
        g.appendChild(grid);
        groups[name].forEach(function (k) {
          var c = M.charts[k], card = el("div", "chart" + (byChart[k] ? " has-anomaly" : ""));
          card.dataset.k = k;
          card._text = (c.name + " " + c.metric).toLowerCase();
          card.appendChild(el("div", "title", c.metric + (byChart[k] ? "  \u26a0 " + byChart[k].length : "")));
          grid.appendChild(card);
          cards[k] = card;
          if (observer) observer.observe(card); else draw(card);
        });
        host.appendChild(g);
      });
    }
    function filter() {
      var q = box.value.trim().toLowerCase();
      cards.forEach(function (card) { card.classList.toggle("hidden", q !== "" && card._text.indexOf(q) < 0); });
      Array.prototype.forEach.call(host.querySelectorAll(".group"), function (g) {
        g.classList.toggle("hidden", !g.querySelector(".chart:not(.hidden)"));
      });
    }
    function focusChart(k) {
      all.open = true;
      build();
      var card = cards[k];
      if (!card) return;
      box.value = ""; filter();
      cards.forEach(function (c) { c.classList.remove("focus"); });
      card.classList.add("focus");
      draw(card);
      card.scrollIntoView({ block: "center" });
    }
    function draw(card) {
      if (card._drawn) return;
      card._drawn = true;
      card.appendChild(chartSvg(M.charts[+card.dataset.k], byChart[+card.dataset.k] || []));
    }
  }

  function describeAlert(a) {
    var where = a.module ? " in module '" + a.module + "'" : "";
    var was = typeof a.baseline === "number" ? ", was " + fmt(a.baseline) : "";
    var spread = a.reached > 1 ? "; reached " + a.reached + " tensors" + (a.last_step !== null && a.last_step !== undefined &&
      a.last_step !== a.step ? " through step " + a.last_step : "") : "";
    return a.stage + " " + a.kind + " '" + a.name + "'" + where + ": " + a.metric + "=" + fmt(a.value) + was +
      " (" + a.rule + spread + ")";
  }

  var HEAT = [[255, 255, 255], [254, 240, 138], [251, 146, 60], [220, 38, 38], [127, 29, 29]];
  function heatColor(d) {
    if (d === null || d === undefined) return "#f3f4f6";
    if (d < 0) return "#6b21a8";  /* NaN/Inf */
    var t = Math.min(1, d / Math.log(100)) * (HEAT.length - 1), i = Math.min(HEAT.length - 2, Math.floor(t)), f = t - i;
    var c = HEAT[i].map(function (v, j) { return Math.round(v + (HEAT[i + 1][j] - v) * f); });
    return "rgb(" + c.join(",") + ")";
  }
  function heatmap(host, G, A, onPick) {
    var rows = G.modules.length, cols = G.columns.length;
    if (!rows || !cols) { host.appendChild(el("div", "meta", "no norm series to draw")); return; }
    var LABEL = 190, AXIS = 16, width = Math.max(600, Math.min(host.clientWidth || 1200, 1600));
    var rh = Math.max(3, Math.min(14, Math.floor(300 / rows))), cw = (width - LABEL) / cols;
    var canvas = el("canvas"); canvas.id = "heatmap";
    var ratio = window.devicePixelRatio || 1, height = rows * rh + AXIS;
    canvas.width = width * ratio; canvas.height = height * ratio;
    canvas.style.width = width + "px"; canvas.style.height = height + "px";
    var g = canvas.getContext("2d");
    g.scale(ratio, ratio);
    g.font = Math.min(11, rh) + "px system-ui, sans-serif"; g.textBaseline = "middle"; g.textAlign = "right";
    for (var r = 0; r < rows; r++) {
      if (rh >= 8 || r % Math.ceil(8 / rh) === 0) { g.fillStyle = "#374151"; g.fillText(G.modules[r], LABEL - 4, r * rh + rh / 2); }
      for (var c = 0; c < cols; c++) {
        g.fillStyle = heatColor(G.cells[r][c]);
        g.fillRect(LABEL + c * cw, r * rh, Math.ceil(cw), rh);
      }
    }
    g.textAlign = "left"; g.fillStyle = "#6b7280"; g.font = "10px system-ui, sans-serif";
    var every = Math.max(1, Math.ceil(60 / cw));
    for (c = 0; c < cols; c += every) g.fillText("" + G.columns[c], LABEL + c * cw, rows * rh + AXIS / 2);
    A.forEach(function (a) {
      if (a.column < 0) return;
      var x = LABEL + a.column * cw + cw / 2, y = a.row >= 0 ? a.row * rh + rh / 2 : rh / 2, s = Math.max(4, Math.min(7, rh / 2 + 2));
      g.beginPath(); g.moveTo(x, y - s); g.lineTo(x + s, y); g.lineTo(x, y + s); g.lineTo(x - s, y); g.closePath();
      g.fillStyle = "#111827"; g.fill(); g.strokeStyle = "#fff"; g.lineWidth = 1; g.stroke();
    });
    function cellAt(e) {
      var b = canvas.getBoundingClientRect(), x = e.clientX - b.left - LABEL, y = e.clientY - b.top;
      var c2 = Math.floor(x / cw), r2 = Math.floor(y / rh);
      return (c2 >= 0 && c2 < cols && r2 >= 0 && r2 < rows) ? [r2, c2] : null;
    }
    canvas.addEventListener("mousemove", function (e) {
      var at = cellAt(e);
      if (!at) { canvas.title = ""; return; }
      var d = G.cells[at[0]][at[1]], k = G.worst[at[0]][at[1]];
      var how = d === null ? "no data" : d < 0 ? "NaN/Inf" : "\u00d7" + fmt(+Math.exp(d).toPrecision(3)) + " from its median";
      canvas.title = G.modules[at[0]] + ", step " + G.columns[at[1]] + (G.per > 1 ? "+" : "") + ": " + how +
        (k >= 0 ? " (" + k + ")" : "") + " \u2014 click for its chart";
    });
    canvas.addEventListener("click", function (e) {
      var at = cellAt(e);
      if (at && G.worst[at[0]][at[1]] >= 0) onPick(G.worst[at[0]][at[1]]);
    });
    host.appendChild(canvas);
    var legend = el("div", "heat-legend");
    [0, Math.log(1.5), Math.log(3), Math.log(10), Math.log(100)].forEach(function (d) {
      var sw = el("span", "swatch"); sw.style.background = heatColor(d);
      legend.appendChild(sw); legend.appendChild(document.createTextNode("\u00d7" + fmt(+Math.exp(d).toPrecision(2)) + " "));
    });
    var bad = el("span", "swatch"); bad.style.background = heatColor(-1);
    legend.appendChild(bad); legend.appendChild(document.createTextNode("NaN/Inf"));
    host.appendChild(legend);
  }

  var SVGNS = "http://www.w3.org/2000/svg";
  function svg(tag, attrs, text) {
    var e = document.createElementNS(SVGNS, tag), k;
    for (k in attrs) e.setAttribute(k, attrs[k]);
    if (text !== undefined) e.textContent = text;
    return e;
  }
  function tick(v) {
    var a = Math.abs(v);
    return (a !== 0 && (a < 1e-3 || a >= 1e5)) ? v.toExponential(2) : String(+v.toPrecision(4));
  }
  function chartSvg(c, anomalies) {
    var W = 328, H = 150, L = 58, Rm = 6, T = 10, B = 20;
    var ranks = Object.keys(c.series), xs = [], ys = [];
    ranks.forEach(function (r) {
      c.series[r].forEach(function (p) { xs.push(p[0]); if (typeof p[1] === "number") ys.push(p[1]); });
    });
    var x0 = Math.min.apply(null, xs), x1 = Math.max.apply(null, xs);
    var y0 = ys.length ? Math.min.apply(null, ys) : 0, y1 = ys.length ? Math.max.apply(null, ys) : 1;
    if (x1 === x0) { x0 -= 1; x1 += 1; }
    if (y1 === y0) { y0 -= 1; y1 += 1; }
    function X(s) { return L + (s - x0) / (x1 - x0) * (W - L - Rm); }
    function Y(v) { return typeof v === "number" ? T + (1 - (v - y0) / (y1 - y0)) * (H - T - B) : T - 4; }
    var s = svg("svg", { viewBox: "0 0 " + W + " " + H, role: "img" });
    s.appendChild(svg("title", {}, c.name + " " + c.metric));
    s.appendChild(svg("line", { x1: L, y1: H - B, x2: W - Rm, y2: H - B, stroke: "#c6cbd2" }));
    s.appendChild(svg("line", { x1: L, y1: T, x2: L, y2: H - B, stroke: "#c6cbd2" }));
    s.appendChild(svg("text", { x: L - 3, y: T + 4, "text-anchor": "end" }, tick(y1)));
    s.appendChild(svg("text", { x: L - 3, y: H - B, "text-anchor": "end" }, tick(y0)));
    s.appendChild(svg("text", { x: L, y: H - 6 }, "step " + fmt(x0)));
    s.appendChild(svg("text", { x: W - Rm, y: H - 6, "text-anchor": "end" }, "step " + fmt(x1)));
    ranks.forEach(function (r, k) {
      var color = COLORS[k % COLORS.length], pts = [], seg = [];
      c.series[r].forEach(function (p) {
        if (typeof p[1] === "number") { seg.push(X(p[0]).toFixed(1) + "," + Y(p[1]).toFixed(1)); return; }
        if (seg.length) { pts.push(seg); seg = []; }
        var m = svg("path", { d: "M" + X(p[0]) + " " + (T - 6) + "l4 7h-8z", fill: "#b91c1c" });
        m.appendChild(svg("title", {}, "rank " + r + " step " + p[0] + ": " + p[1]));
        s.appendChild(m);
      });
      if (seg.length) pts.push(seg);
      pts.forEach(function (sg) {
        s.appendChild(svg("polyline", { points: sg.join(" "), fill: "none", stroke: color, "stroke-width": 1.5 }));
      });
      if (ranks.length > 1) s.appendChild(svg("text", { x: W - Rm - 40 * (ranks.length - k), y: T + 2, fill: color }, "rank " + r));
    });
    anomalies.forEach(function (a) {
      var v = typeof a.value === "number" ? a.value : null;
      var dot = svg("circle", { cx: X(a.step), cy: v === null ? T - 2 : Y(v), r: 4, fill: "none", stroke: "#b91c1c", "stroke-width": 2, "class": "anomaly" });
      dot.appendChild(svg("title", {}, "anomaly: rank " + a.rank + " step " + a.step + " " + a.metric + "=" + fmt(a.value) + " (" + a.rule + ")"));
      s.appendChild(dot);
    });
    return s;
  }

  /* ------------------------------------------------------------------ start */
  function start() {
    var R = JSON.parse(document.getElementById("report-data").textContent);
    document.title = R.title;
    if (R.kind === "dump") dumpView(R);
    else if (R.kind === "compare") compareView(R);
    else if (R.kind === "monitor") monitorView(R);
    document.body.dataset.ready = "1";
    window.__reportReadyMs = performance.now();
  }
  try { start(); } catch (err) {
    var box = document.getElementById("error");
    box.style.display = "block";
    box.textContent = "The report could not be shown: " + err;
    throw err;
  }
})();
