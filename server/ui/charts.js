// Line charts on a plain canvas: no library, no network.
//
//   const c = new LineChart(canvasElement, {unit: "tok/s", min: 0, max: 1});
//   c.push(Date.now(), {"position 1": 0.9, "position 2": 0.8});   // one point per series
//
// Series appear as they are first pushed; a missing value leaves a gap. The last
// `keep` points are kept; `points` counts every point pushed (tests read it).
"use strict";

const PALETTE = ["#2f6fde", "#e67e22", "#1a8a4a", "#8e44ad", "#c0392b", "#16a085", "#7f8c8d", "#d35400"];

class LineChart {
  constructor(canvas, opts = {}) {
    this.canvas = canvas;
    this.opts = Object.assign({keep: 180, min: 0, max: null, unit: "", step: false, format: null}, opts);
    this.times = [];
    this.series = new Map(); // name -> array of values (null: no value), aligned with times
    this.points = 0;
    canvas.dataset.points = "0";
  }

  push(t, values) {
    this.times.push(t);
    for (const [name, v] of Object.entries(values)) {
      if (!this.series.has(name)) this.series.set(name, new Array(this.times.length - 1).fill(null));
    }
    for (const [name, arr] of this.series) {
      const v = values[name];
      arr.push(v === undefined || v === null || !Number.isFinite(v) ? null : v);
      if (v !== undefined && v !== null && Number.isFinite(v)) this.points++;
    }
    if (this.times.length > this.opts.keep) {
      this.times.shift();
      for (const arr of this.series.values()) arr.shift();
    }
    this.canvas.dataset.points = String(this.points);
    this.draw();
  }

  latest(name) {
    const arr = this.series.get(name);
    return arr ? arr[arr.length - 1] : null;
  }

  fmt(v) {
    if (this.opts.format) return this.opts.format(v);
    if (Math.abs(v) >= 1e9) return (v / 1e9).toFixed(1) + "G";
    if (Math.abs(v) >= 1e6) return (v / 1e6).toFixed(1) + "M";
    if (Math.abs(v) >= 1e4) return (v / 1e3).toFixed(0) + "k";
    if (Math.abs(v) >= 100) return v.toFixed(0);
    if (Math.abs(v) >= 10) return v.toFixed(1);
    return v.toFixed(2);
  }

  draw() {
    const c = this.canvas, dpr = window.devicePixelRatio || 1;
    const w = c.clientWidth || 300, h = c.clientHeight || 130;
    if (c.width !== Math.round(w * dpr) || c.height !== Math.round(h * dpr)) {
      c.width = Math.round(w * dpr);
      c.height = Math.round(h * dpr);
    }
    const g = c.getContext("2d");
    g.setTransform(dpr, 0, 0, dpr, 0, 0);
    g.clearRect(0, 0, w, h);
    const left = 40, right = 6, top = 16, bottom = 14;
    const pw = w - left - right, ph = h - top - bottom;
    let lo = this.opts.min, hi = this.opts.max;
    if (hi === null) {
      hi = lo + 1e-9;
      for (const arr of this.series.values()) for (const v of arr) if (v !== null && v > hi) hi = v;
      hi = hi <= lo + 1e-9 ? lo + 1 : hi * 1.1;
    }
    // grid and labels
    g.font = "10px system-ui, sans-serif";
    g.fillStyle = "#6b7480";
    g.strokeStyle = "#eceff2";
    g.lineWidth = 1;
    for (let i = 0; i <= 2; i++) {
      const y = top + ph - (ph * i) / 2;
      g.beginPath(); g.moveTo(left, y); g.lineTo(left + pw, y); g.stroke();
      g.fillText(this.fmt(lo + ((hi - lo) * i) / 2), 2, y + 3);
    }
    const n = this.times.length;
    if (n > 1) {
      const span = Math.max(1, (this.times[n - 1] - this.times[0]) / 1000);
      g.fillText(`last ${span.toFixed(0)} s`, left, h - 2);
    }
    const x = (i) => left + (n <= 1 ? pw : (pw * i) / (n - 1));
    const y = (v) => top + ph - (ph * (Math.min(Math.max(v, lo), hi) - lo)) / (hi - lo);
    let k = 0, legendX = left;
    for (const [name, arr] of this.series) {
      const color = PALETTE[k++ % PALETTE.length];
      g.strokeStyle = color;
      g.lineWidth = 1.6;
      g.beginPath();
      let pen = false;
      for (let i = 0; i < arr.length; i++) {
        if (arr[i] === null) { pen = false; continue; }
        if (!pen) { g.moveTo(x(i), y(arr[i])); pen = true; continue; }
        if (this.opts.step) g.lineTo(x(i), y(arr[i - 1]));
        g.lineTo(x(i), y(arr[i]));
      }
      g.stroke();
      const last = arr[arr.length - 1];
      const label = `${name}${last === null ? "" : " " + this.fmt(last)}`;
      g.fillStyle = color;
      g.fillText(label, legendX, 10);
      legendX += g.measureText(label).width + 12;
    }
    if (this.series.size === 0) {
      g.fillStyle = "#9aa3ad";
      g.fillText("waiting for data", left + 6, top + ph / 2);
    }
  }
}

window.LineChart = LineChart;
