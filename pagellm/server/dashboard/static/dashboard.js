// pagellm live dashboard: polls /dashboard/data once a second and redraws six uPlot charts.
// State is exposed as window.pagellmDashboard (the charts, the last payload, the poll count) for tests and debugging.
"use strict";
(function () {
  const COLORS = { a: "#4cc2ff", b: "#f5a524", c: "#3ecf8e", d: "#f25f5c" };
  const state = { charts: {}, last: null, polls: 0, errors: 0 };
  window.pagellmDashboard = state;

  const percent = (v) => (v == null ? null : 100 * v);
  const ms = (v) => (v == null ? null : 1000 * v);
  const clock = (t) => new Date(t * 1000).toLocaleTimeString([], { hour: "2-digit", minute: "2-digit", second: "2-digit" });
  const fmt = (v, digits = 1) => (v == null || Number.isNaN(v) ? "–" : Number(v).toFixed(digits));

  // Each chart: its element, its series (label, colour, how to read it from the payload), axis bounds.
  const SPECS = {
    throughput: { el: "chart-throughput", series: [
      ["generation", COLORS.a, (s) => s.generation_tokens_per_s],
      ["prompt", COLORS.b, (s) => s.prompt_tokens_per_s]] },
    requests: { el: "chart-requests", series: [
      ["running", COLORS.c, (s) => s.running],
      ["waiting", COLORS.d, (s) => s.waiting]] },
    kv: { el: "chart-kv", range: [0, 100], series: [
      ["KV usage %", COLORS.a, (s) => s.kv_cache_usage.map(percent)]] },
    hit: { el: "chart-hit", range: [0, 100], series: [
      ["hit rate %", COLORS.c, (s) => s.prefix_cache_hit_rate.map(percent)]] },
    ttft: { el: "chart-ttft", series: [
      ["p50", COLORS.a, (s) => s.ttft_p50.map(ms)],
      ["p95", COLORS.d, (s) => s.ttft_p95.map(ms)]] },
    tpot: { el: "chart-tpot", series: [
      ["p50", COLORS.a, (s) => s.tpot_p50.map(ms)],
      ["p95", COLORS.d, (s) => s.tpot_p95.map(ms)]] },
  };

  function makeChart(spec) {
    const el = document.getElementById(spec.el);
    const axis = { stroke: "#8a96a3", grid: { stroke: "#26303b", width: 1 }, ticks: { stroke: "#26303b" } };
    const opts = {
      width: el.clientWidth || 400, height: 210,
      scales: { x: { time: true }, y: spec.range ? { range: spec.range } : { range: (u, lo, hi) => [0, Math.max(1, hi * 1.1)] } },
      // One clock-time label per tick (uPlot's default adds a second, date row that crowds small charts).
      axes: [{ ...axis, space: 70, values: (u, ticks) => ticks.map(clock) }, { ...axis, size: 56 }],
      series: [{}].concat(spec.series.map(([label, stroke]) => ({
        label, stroke, width: 2, fill: stroke + "22", spanGaps: false, points: { show: false } }))),
      legend: { live: true },
    };
    const empty = [[]].concat(spec.series.map(() => []));
    return new uPlot(opts, empty, el);
  }

  function render(payload) {
    const s = payload.series;
    for (const [name, spec] of Object.entries(SPECS)) {
      state.charts[name].setData([s.time].concat(spec.series.map(([, , read]) => read(s))));
    }
    const at = (k) => s[k][s[k].length - 1];
    const recent = (k, n) => s[k].slice(-n).filter((v) => v != null);
    const mean = (xs) => (xs.length ? xs.reduce((a, b) => a + b, 0) / xs.length : null);
    // Tokens arrive once per engine step, so the tiles show a 5-second mean rather than one jumpy second.
    document.getElementById("tile-gen").textContent = fmt(mean(recent("generation_tokens_per_s", 5)));
    document.getElementById("tile-prompt").textContent = fmt(mean(recent("prompt_tokens_per_s", 5)));
    document.getElementById("tile-reqs").textContent = `${at("running")} / ${at("waiting")}`;
    document.getElementById("tile-kv").textContent = fmt(percent(at("kv_cache_usage"))) + "%";
    const hit = at("prefix_cache_hit_rate");
    document.getElementById("tile-hit").textContent = hit == null ? "–" : fmt(percent(hit)) + "%";
    const ttft = at("ttft_p95");
    document.getElementById("tile-ttft").textContent = ttft == null ? "–" : fmt(ms(ttft), 0) + " ms";
    document.getElementById("tile-done").textContent = String(payload.total_finished);
    document.getElementById("model").textContent = payload.model_name;
    const status = document.getElementById("status");
    const busy = at("running") + at("waiting") > 0;
    status.textContent = payload.stats_enabled ? (busy ? "● serving" : "○ idle") : "stats disabled";
    status.className = "status " + (busy ? "live" : "idle");
  }

  async function poll() {
    const windowS = document.getElementById("window").value;
    try {
      const response = await fetch(`/dashboard/data?window=${windowS}`, { cache: "no-store" });
      if (!response.ok) throw new Error(`HTTP ${response.status}`);
      state.last = await response.json();
      state.polls += 1;
      render(state.last);
    } catch (err) {
      state.errors += 1;
      const status = document.getElementById("status");
      status.textContent = "server unreachable";
      status.className = "status down";
    }
  }

  function resize() {
    for (const [name, spec] of Object.entries(SPECS)) {
      const el = document.getElementById(spec.el);
      state.charts[name].setSize({ width: el.clientWidth, height: 210 });
    }
  }

  for (const [name, spec] of Object.entries(SPECS)) state.charts[name] = makeChart(spec);
  window.addEventListener("resize", resize);
  document.getElementById("window").addEventListener("change", poll);
  poll();
  setInterval(poll, 1000);
})();
