// The FlexMARL web view: one page over the JSON API of controller/view/server.py.
// It polls the run's header, appends new metrics rows to the agents' curves (uPlot), draws
// the workers' busy grid on a uPlot chart's canvas, and pages the lists (Grid.js) from the
// server; nothing here holds a whole log. `window.flexmarlView` is its state, for tests.
"use strict";
(() => {
  const $ = (sel) => document.querySelector(sel);
  const state = {
    header: null, epoch: -1, trainRows: 0, evalRows: 0, agents: [], latest: {},
    series: {}, evalSeries: [], charts: {}, timeline: null, timelineWindow: null, syncs: [], syncRows: 0, syncEpoch: -1,
    tab: "agents", grids: {}, seen: "", errors: [],
  };
  window.flexmarlView = state;

  const CURVES = ["reward", "samples_s", "staleness", "mismatch", "loss", "grad_norm"];
  const FROM_ZERO = new Set(["samples_s", "staleness"]);  // never below 0: their axis starts there
  const STEP_INCRS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000];  // whole steps on the x axis
  const PALETTE = ["#4a6fd8", "#e07b39", "#3c9a5f", "#c0392b", "#8e5cc4", "#8c6d31", "#d35fa8", "#7f8c8d",
                   "#b5a82a", "#2aa1b5"];
  const color = (i) => i < PALETTE.length ? PALETTE[i] : `hsl(${(i * 47) % 360}, 55%, 45%)`;
  function colorOf(agent) {  // an agent's colour on every chart: by its place among the run's agents
    const named = state.header ? state.header.agents : [];
    const i = named.indexOf(agent);
    return color(i >= 0 ? i : named.length + Math.max(0, state.agents.indexOf(agent)));
  }
  const ROLE_RGB = { rollout: [74, 111, 216], trainer: [224, 123, 57] };

  async function api(path) {
    const response = await fetch(path, { cache: "no-store" });
    if (!response.ok) throw new Error(`${path}: ${response.status} ${await response.text()}`);
    return path.startsWith("api/config") ? response.text() : response.json();
  }
  function num(v, digits = 3) {
    if (v === null || v === undefined) return "-";
    if (v !== 0 && Math.abs(v) < 10 ** -digits) return v.toExponential(2);
    if (Math.abs(v) >= 1000) return count(Math.round(v));
    return String(+v.toFixed(digits));
  }
  function count(n) {  // 12345 -> "12,345" (no Intl: the page's locale is whatever the browser says)
    return String(n).replace(/\B(?=(\d{3})+(?!\d))/g, ",");
  }
  function text(tag, content, cls) {
    const el = document.createElement(tag);
    if (content !== undefined) el.textContent = content;
    if (cls) el.className = cls;
    return el;
  }
  function report(error) {
    state.errors.push(String(error));
    console.error(error);
  }

  // ---------------------------------------------------------------- header and tabs

  async function pollHeader() {
    const h = await api("api/run");
    const first = state.header === null;
    state.header = h;
    $("#run-dir").textContent = h.run_dir;
    const status = $("#status");
    const stale = !h.finished && h.written_s_ago !== null && h.written_s_ago > 300;
    status.textContent = h.finished ? "finished" : stale ? "stopped?" : "running";
    status.className = `pill ${h.finished ? "finished" : stale ? "stopped" : "running"}`;
    $("#step").textContent = h.steps ? `step ${h.step} of ${h.steps}` : `step ${h.step}`;
    const facts = [`${h.agents.length} agents`, `${h.workers} workers`, h.mode ? `${h.mode}, K = ${h.max_staleness}` : "",
                   `${count(h.samples)} samples`, `${count(h.episodes)} episodes`,
                   `${num(h.training_s, 1)} s training`].filter(Boolean);
    $("#facts").textContent = facts.join(" · ");
    const log = h.log;
    const reading = !log.caught_up && log.bytes > 0;
    $("#reading").hidden = !reading && !log.problem;
    $("#reading-bar").style.width = `${log.bytes ? (100 * log.bytes_read / log.bytes).toFixed(1) : 0}%`;
    $("#reading-text").textContent = log.problem ? `the log: ${log.problem}` :
      `reading the event log: ${(log.bytes_read / 1e6).toFixed(1)} of ${(log.bytes / 1e6).toFixed(1)} MB, ` +
      `${count(log.events)} events`;
    if (first) fillFilters(h);
    const seen = `${h.epoch}/${log.events}/${h.step}/${h.samples}`;
    if (seen !== state.seen) {
      state.seen = seen;
      await pollAgents();
      if (state.tab === "cluster") await refreshCluster(false);
    }
    return h;
  }

  function showTab() {
    const hash = decodeURIComponent(location.hash.slice(1));
    let tab = hash.split(/[=&]/)[0] || "agents";
    if (tab === "episode") tab = "episodes";
    state.tab = tab;
    for (const section of document.querySelectorAll("main > section")) section.hidden = section.dataset.tab !== tab;
    for (const link of document.querySelectorAll("nav a")) link.classList.toggle("active", link.dataset.tab === tab);
    if (tab === "agents") resizeCharts();
    if (tab === "cluster") refreshCluster(true).catch(report);
    if (tab === "episodes") {
      if (!state.grids.samples) samplesTable();
      const params = new URLSearchParams(hash.startsWith("episode=") ? hash : "");
      if (params.get("episode")) openEpisode(params.get("episode"), params.get("sample")).catch(report);
    }
    if (tab === "config") api("api/config").then((t) => { $("#config-text").textContent = t; }).catch(report);
  }

  // ---------------------------------------------------------------- agents

  async function pollAgents() {
    const q = `api/agents?epoch=${state.epoch}&train=${state.trainRows}&eval=${state.evalRows}`;
    const d = await api(q);
    if (d.from_start) {
      state.series = {};
      state.evalSeries = [];
      for (const chart of Object.values(state.charts)) chart.destroy();
      state.charts = {};
    }
    state.epoch = d.epoch;
    state.agents = d.agents;
    state.trainRows = d.train_rows;
    state.evalRows = d.eval_rows;
    state.latest = d.latest;
    const t = d.train;
    for (const curve of CURVES) {
      const per = state.series[curve] || (state.series[curve] = []);
      for (let i = 0; i < t.step.length; i++) {
        const a = t.agent[i];
        (per[a] || (per[a] = new Map())).set(t.step[i], t[curve][i]);
      }
    }
    for (let i = 0; i < d.eval.step.length; i++) {
      const a = d.eval.agent[i];
      (state.evalSeries[a] || (state.evalSeries[a] = new Map())).set(d.eval.step[i], d.eval.reward[i]);
    }
    drawCharts();
    agentsTable();
  }

  function chartData(curve) {
    const per = state.series[curve] || [];
    const withEval = curve === "reward";
    const steps = new Set();
    for (const m of per) if (m) for (const s of m.keys()) steps.add(s);
    if (withEval) for (const m of state.evalSeries) if (m) for (const s of m.keys()) steps.add(s);
    const xs = [...steps].sort((a, b) => a - b);
    const columns = [xs];
    const labels = [];
    state.agents.forEach((agent, a) => {
      const m = per[a] || new Map();
      columns.push(xs.map((x) => (m.has(x) ? m.get(x) : null)));
      labels.push({ label: agent, a, dash: false });
    });
    if (withEval) {
      state.agents.forEach((agent, a) => {
        const m = state.evalSeries[a];
        if (!m || !m.size) return;
        columns.push(xs.map((x) => (m.has(x) ? m.get(x) : null)));
        labels.push({ label: `${agent} (held-out)`, a, dash: true });
      });
    }
    return { columns, labels };
  }

  function drawCharts() {
    if (!state.agents.length) return;
    for (const curve of CURVES) {
      const { columns, labels } = chartData(curve);
      const el = $(`#chart-${curve}`);
      const old = state.charts[curve];
      const key = labels.map((l) => l.label).join("|");
      if (old && old._key === key) {
        old.setData(columns);
        continue;
      }
      if (old) old.destroy();
      const few = columns[0].length < 80;
      const chart = new uPlot({
        width: Math.max(300, el.clientWidth || 460), height: 220,
        scales: { x: { time: false }, y: FROM_ZERO.has(curve) ? { range: (u, lo, hi) => [0, hi > 0 ? hi * 1.1 : 1] } : {} },
        axes: [{ label: "step", size: 36, incrs: STEP_INCRS },
               { size: 64, values: (u, splits) => splits.map((v) => num(v, 3)) }],
        legend: { live: true },
        series: [{ label: "step" }, ...labels.map((l) => ({
          label: l.label, stroke: colorOf(state.agents[l.a]), width: 1.5, spanGaps: true, dash: l.dash ? [5, 4] : undefined,
          points: { show: few || l.dash, size: 4 }, value: (u, v) => num(v, 4),
        }))],
      }, columns, el);
      chart._key = key;
      chart._curve = curve;
      state.charts[curve] = chart;
    }
  }

  function resizeCharts() {
    for (const chart of Object.values(state.charts)) {
      const el = chart.root.parentElement;
      if (el && el.clientWidth) chart.setSize({ width: el.clientWidth, height: 220 });
    }
  }

  function agentsTable() {
    const named = state.header && state.header.agents.length ? state.header.agents : [];
    const agents = [...named, ...state.agents.filter((a) => !named.includes(a))].filter((a) => state.latest[a]);
    const rows = agents.map((agent) => {
      const last = state.latest[agent] || {};
      return [agent, last.step ?? "-", num(last.reward), num(last.samples_s, 1), num(last.staleness, 2),
              num(last.mismatch, 6), num(last.loss, 4), num(last.grad_norm, 4)];
    });
    const columns = ["agent", "step", "reward", "samples/s", "staleness", "mismatch", "loss", "grad norm"];
    if (!state.grids.agents) {
      state.grids.agents = new gridjs.Grid({ columns, data: rows, sort: true, pagination: { limit: 16 } })
        .render($("#agents-table"));
    } else {
      state.grids.agents.updateConfig({ data: rows }).forceRender();
    }
  }

  // ---------------------------------------------------------------- cluster

  async function refreshCluster(tables) {
    await loadTimeline();
    await loadSyncs();
    if (tables || !state.grids.workers) await workersTable();
    if (!state.grids.happenings) happeningsTable();
  }

  async function loadTimeline() {
    const el = $("#timeline");
    const width = Math.max(400, el.clientWidth - 16);
    const columns = Math.max(50, Math.min(1000, width - 140));
    const w = state.timelineWindow;
    const d = await api(`api/timeline?columns=${columns}` + (w ? `&t0=${w[0]}&t1=${w[1]}` : ""));
    const raw = atob(d.busy);
    d.cells = new Uint8Array(raw.length);
    for (let i = 0; i < raw.length; i++) d.cells[i] = raw.charCodeAt(i);
    d.image = gridImage(d);
    state.timeline = d;
    const rows = d.workers.length;
    const height = Math.max(160, Math.min(640, 40 + rows * 14));
    if (state.charts.timeline) state.charts.timeline.destroy();
    const chart = new uPlot({
      width, height, legend: { show: false },
      scales: { x: { time: false, min: d.t0, max: d.t1, auto: false }, y: { min: 0, max: Math.max(rows, 1), auto: false, dir: -1 } },
      axes: [{ label: "seconds since the run started", size: 36 },
             { size: 120, splits: () => rowSplits(rows),
               values: (u, splits) => splits.map((s) => (d.workers[Math.floor(s)] || {}).worker || "") }],
      cursor: { drag: { x: true, y: false, setScale: false }, points: { show: false } },
      series: [{}, { label: "busy", stroke: "transparent" }],
      hooks: { draw: [drawGrid], setSelect: [zoomTimeline], setCursor: [timelineReadout] },
    }, [[d.t0, d.t1], [null, null]], el);
    state.charts.timeline = chart;
  }

  async function loadSyncs() {
    const epoch = state.header ? state.header.epoch : 0;
    if (epoch !== state.syncEpoch) { state.syncs = []; state.syncRows = 0; state.syncEpoch = epoch; }
    const d = await api(`api/syncs?since=${state.syncRows}`);
    state.syncRows = d.rows;
    d.version.forEach((version, i) => {
      const a = d.agent[i];
      (state.syncs[a] || (state.syncs[a] = new Map())).set(version, d.seconds[i]);
    });
    const versions = [...new Set(state.syncs.flatMap((m) => (m ? [...m.keys()] : [])))].sort((x, y) => x - y);
    const columns = [versions, ...d.agents.map((_, a) => versions.map((v) => (state.syncs[a] && state.syncs[a].has(v) ? state.syncs[a].get(v) : null)))];
    const old = state.charts.syncs, el = $("#chart-syncs");
    if (old && old._key === d.agents.join("|")) { old.setData(columns); return; }
    if (old) old.destroy();
    const chart = new uPlot({
      width: Math.max(300, el.clientWidth || 460), height: 200,
      scales: { x: { time: false }, y: { range: (u, lo, hi) => [0, hi > 0 ? hi * 1.1 : 1] } },
      axes: [{ label: "version", size: 36, incrs: STEP_INCRS }, { size: 64, values: (u, splits) => splits.map((v) => num(v, 3)) }],
      series: [{ label: "version" }, ...d.agents.map((agent, a) => ({
        label: agent, stroke: colorOf(agent), width: 1.5, spanGaps: true, points: { show: versions.length < 80, size: 4 },
        value: (u, v) => num(v, 4) }))],
    }, columns, el);
    chart._key = d.agents.join("|");
    state.charts.syncs = chart;
  }

  function rowSplits(rows) {
    const step = Math.max(1, Math.ceil(rows / 24));
    const out = [];
    for (let r = 0; r < rows; r += step) out.push(r + 0.5);  // a label in the middle of its row
    return out;
  }

  function gridImage(d) {
    const rows = d.workers.length, cols = d.columns;
    const canvas = document.createElement("canvas");
    canvas.width = cols;
    canvas.height = Math.max(rows, 1);
    if (!rows) return canvas;
    const ctx = canvas.getContext("2d");
    const image = ctx.createImageData(cols, rows);
    for (let r = 0; r < rows; r++) {
      const rgb = ROLE_RGB[d.workers[r].role] || [120, 120, 120];
      for (let c = 0; c < cols; c++) {
        const v = d.cells[r * cols + c] / 255, at = 4 * (r * cols + c);
        image.data[at] = 255 - (255 - rgb[0]) * v;
        image.data[at + 1] = 255 - (255 - rgb[1]) * v;
        image.data[at + 2] = 255 - (255 - rgb[2]) * v;
        image.data[at + 3] = 255;
      }
    }
    ctx.putImageData(image, 0, 0);
    return canvas;
  }

  function drawGrid(u) {
    const d = state.timeline;
    if (!d || !d.workers.length) return;
    const ctx = u.ctx;
    const top = u.valToPos(0, "y", true), bottom = u.valToPos(d.workers.length, "y", true);
    ctx.save();
    ctx.imageSmoothingEnabled = false;
    ctx.drawImage(d.image, u.bbox.left, Math.min(top, bottom), u.bbox.width, Math.abs(bottom - top));
    ctx.restore();
  }

  function zoomTimeline(u) {
    if (u.select.width < 3) return;
    const t0 = u.posToVal(u.select.left, "x"), t1 = u.posToVal(u.select.left + u.select.width, "x");
    u.setSelect({ left: 0, width: 0, top: 0, height: 0 }, false);
    state.timelineWindow = [Math.max(0, t0), t1];
    loadTimeline().catch(report);
  }

  function timelineReadout(u) {
    const d = state.timeline;
    const { left, top } = u.cursor;
    if (!d || left === null || left < 0 || top < 0) { $("#timeline-readout").textContent = ""; return; }
    const t = u.posToVal(left, "x"), row = Math.floor(u.posToVal(top, "y"));
    const col = Math.floor((t - d.t0) / (d.t1 - d.t0) * d.columns);
    const worker = d.workers[row];
    if (!worker || col < 0 || col >= d.columns) { $("#timeline-readout").textContent = ""; return; }
    const busy = d.cells[row * d.columns + col] / 255;
    $("#timeline-readout").textContent = `${worker.worker} at ${num(t, 2)} s: ${(100 * busy).toFixed(0)}% busy`;
  }

  async function workersTable() {
    const rows = (await api("api/workers")).map((w) => [w.worker, w.role, num(w.busy_s, 2), num(w.idle_s, 2),
      `${(100 * w.utilization).toFixed(1)}%`, w.restarts, w.alive ? "yes" : "no"]);
    const columns = ["worker", "role", "busy s", "idle s", "busy", "restarts", "alive"];
    if (!state.grids.workers) {
      state.grids.workers = new gridjs.Grid({ columns, data: rows, sort: true, search: true, pagination: { limit: 16 } })
        .render($("#workers-table"));
    } else {
      state.grids.workers.updateConfig({ data: rows }).forceRender();
    }
  }

  function happeningsUrl() {
    const kind = $("#happening-kind").value, newest = $("#happening-newest").checked;
    return `api/happenings?kind=${encodeURIComponent(kind)}${newest ? "&order=newest" : ""}`;
  }

  function happeningsTable() {
    const config = {
      columns: ["t (s)", "kind", "who", "what", "seconds"],
      server: { url: happeningsUrl(), then: (d) => d.rows.map((r) => [num(r.t, 2), r.kind, r.who, r.what, num(r.seconds, 3)]),
                total: (d) => d.total },
      pagination: { limit: 15, server: { url: (prev, page, limit) => `${prev}&offset=${page * limit}&limit=${limit}` } },
    };
    state.grids.happenings = new gridjs.Grid(config).render($("#happenings-table"));
    const refresh = () => state.grids.happenings.updateConfig({ server: { ...config.server, url: happeningsUrl() } }).forceRender();
    $("#happening-kind").onchange = refresh;
    $("#happening-newest").onchange = refresh;
  }

  // ---------------------------------------------------------------- episodes

  function fillFilters(h) {
    const agents = $("#sample-filters select[name=agent]");
    for (const agent of h.agents) agents.append(new Option(agent, agent));
    const statuses = $("#sample-filters select[name=status]");
    for (const s of h.lists.statuses) statuses.append(new Option(s, s));
    const kinds = $("#happening-kind");
    for (const k of h.lists.happenings) kinds.append(new Option(k, k));
  }

  function samplesUrl() {
    const form = new FormData($("#sample-filters"));
    const q = new URLSearchParams();
    for (const [k, v] of form.entries()) if (v !== "") q.set(k, v);
    return `api/samples?${q}`;
  }

  function samplesTable() {
    const config = {
      columns: ["step", "agent", "episode", "member", "reward", "advantage", "version", "instance", "status", "text",
                { name: "sample", hidden: true }],
      server: { url: samplesUrl(), total: (d) => d.total,
                then: (d) => d.rows.map((r) => [r.step, r.agent, r.episode, r.member, num(r.reward), num(r.advantage),
                  r.versions.join(", ") || "-", r.instances.join(", ") || "-", r.status, r.text ? "yes" : "",
                  r.sample]) },
      pagination: { limit: 20, server: { url: (prev, page, limit) => `${prev}&offset=${page * limit}&limit=${limit}` } },
    };
    const grid = new gridjs.Grid(config).render($("#samples-table"));
    grid.on("rowClick", (event, row) => {
      const episode = row.cells[2].data, sample = row.cells[10].data;
      location.hash = `episode=${encodeURIComponent(episode)}&sample=${encodeURIComponent(sample)}`;
    });
    $("#sample-filters").onsubmit = (event) => {
      event.preventDefault();
      grid.updateConfig({ server: { ...config.server, url: samplesUrl() } }).forceRender();
    };
    state.grids.samples = grid;
  }

  async function openEpisode(name, chosen) {
    const d = await api(`api/episode?name=${encodeURIComponent(name)}`);
    const box = $("#episode");
    box.hidden = false;
    box.replaceChildren();
    const head = text("div", undefined, "episode-head");
    const samples = d.groups.reduce((n, g) => n + g.members.length, 0);
    head.append(text("h2", `Episode ${d.episode}`),
                text("span", `step ${d.groups.length ? d.groups[0].step : "-"} · ${d.groups.length} groups · ${samples} samples`));
    box.append(head);
    // A group sits under the group of the longest branch that starts its own (its caller's).
    const nodes = d.groups.map((g) => ({ g, key: g.branch.join("."), children: [] }));
    const roots = [];
    const within = (outer, inner) => outer.length < inner.length && outer.every((b, k) => b === inner[k]);
    nodes.forEach((node, i) => {
      let parent = null;
      nodes.forEach((other, j) => {
        if (!within(other.g.branch, node.g.branch)) return;
        const deeper = !parent || other.g.branch.length > parent.g.branch.length;
        if (deeper || (other.g.branch.length === parent.g.branch.length && j < i)) parent = other;
      });
      (parent ? parent.children : roots).push(node);
    });
    const order = (a, b) => (a.key < b.key ? -1 : a.key > b.key ? 1 : 0);
    const render = (node) => {
      const { g } = node;
      const el = text("div", undefined, "group");
      el.dataset.group = g.group;
      const head = text("div", undefined, "group-head");
      head.append(text("span", g.agent, "agent"), text("span", `branch (${g.branch.join(", ")})`),
                  text("span", `step ${g.step}`), text("span", `${g.members.length} samples`), text("span", g.group, "id"));
      el.append(head);
      const members = text("div", undefined, "members");
      for (const m of g.members) members.append(memberCard(m, m.sample === chosen));
      el.append(members);
      if (node.children.length) {
        const kids = text("div", undefined, "children");
        for (const child of node.children.sort(order)) kids.append(render(child));
        el.append(kids);
      }
      return el;
    };
    for (const root of roots.sort(order)) box.append(render(root));
    const mark = box.querySelector(".member.chosen");
    if (mark) mark.scrollIntoView({ block: "center" });
    state.episode = d;
  }

  function memberCard(m, chosen) {
    const trained = m.status === "trained", dropped = m.status === "dropped";
    const card = text("div", undefined, `member${chosen ? " chosen" : ""}${trained ? " trained" : ""}${dropped ? " dropped" : ""}`);
    card.dataset.sample = m.sample;
    const numbers = text("div", undefined, "numbers");
    const status = trained ? `trained into v${m.trained_into}` : dropped ? `dropped: ${m.dropped}` :
      m.status === "in micro-batch" ? `in a micro-batch for v${m.trained_into}` : m.status;
    for (const [k, v] of [["member", `#${m.member}`], ["reward", num(m.reward)], ["advantage", num(m.advantage)],
                          ["version", m.versions.join(", ") || "-"], ["instance", m.instances.join(", ") || "-"],
                          ["", status]]) {
      numbers.append(text("span", k), text("span", v));
    }
    card.append(numbers);
    if (m.turns) {
      const turns = text("div", undefined, "turns");
      for (const t of m.turns) {
        const turn = text("div", undefined, "turn");
        const version = t.version !== undefined && t.version !== null ? ` (v${t.version})` : "";
        turn.append(text("span", `${t.role}${version}: `, "role"), text("pre", t.text));
        turns.append(turn);
      }
      card.append(turns);
    }
    return card;
  }

  // ---------------------------------------------------------------- start

  async function loop() {
    for (;;) {
      let wait = 1500;
      try {
        const h = await pollHeader();
        wait = h.log.caught_up ? (h.finished ? 5000 : 1500) : 300;
      } catch (error) {
        $("#status").textContent = "cannot reach the view";
        $("#status").className = "pill stopped";
        report(error);
        wait = 3000;
      }
      await new Promise((resolve) => setTimeout(resolve, wait));
    }
  }

  window.addEventListener("hashchange", showTab);
  window.addEventListener("resize", resizeCharts);
  $("#timeline-all").onclick = () => { state.timelineWindow = null; loadTimeline().catch(report); };
  $("#timeline").addEventListener("dblclick", () => { state.timelineWindow = null; loadTimeline().catch(report); });
  showTab();
  loop();
})();
