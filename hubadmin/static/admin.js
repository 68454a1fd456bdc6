// The admin page: polls api/servers every 2 s and renders rows as text (textContent only, never HTML:
// user names, server names and job names come from users).
'use strict';
const SVG = 'http://www.w3.org/2000/svg';

function el(tag, text, cls) {
  const e = document.createElement(tag);
  if (text !== undefined && text !== null) e.textContent = String(text);
  if (cls) e.className = cls;
  return e;
}

function fmtDuration(s) {
  if (s === null || s === undefined) return '—';
  if (s < 90) return Math.round(s) + ' s';
  if (s < 5400) return Math.round(s / 60) + ' min';
  return (s / 3600).toFixed(1) + ' h';
}

function spark(times, values, maxValue, color) {
  const w = 160, h = 28;
  const svg = document.createElementNS(SVG, 'svg');
  svg.setAttribute('class', 'spark');
  svg.setAttribute('width', String(w));
  svg.setAttribute('height', String(h));
  const pts = times.map((t, i) => [t, values[i]]).filter(p => p[1] !== null);
  if (pts.length === 0) return svg;
  const t0 = times[0], t1 = times[times.length - 1];
  const top = maxValue || Math.max(1, ...pts.map(p => p[1])) * 1.1;
  const span = Math.max(1e-9, t1 - t0);
  const d = pts.map((p, i) => {
    const x = times.length === 1 ? w : ((p[0] - t0) / span) * (w - 2) + 1;
    const y = h - 2 - (Math.min(p[1], top) / top) * (h - 4);
    return (i ? 'L' : 'M') + x.toFixed(1) + ' ' + y.toFixed(1);
  }).join(' ');
  const path = document.createElementNS(SVG, 'path');
  path.setAttribute('d', d);
  path.setAttribute('fill', 'none');
  path.setAttribute('stroke', color);
  path.setAttribute('stroke-width', '1.5');
  svg.appendChild(path);
  const title = document.createElementNS(SVG, 'title');
  const last = pts[pts.length - 1][1];
  title.textContent = maxValue ? 'now ' + last + '%' : 'now ' + Math.round(last) + ' MiB';
  svg.appendChild(title);
  return svg;
}

function cell(row, text, cls) {
  const td = el('td', text, cls);
  row.appendChild(td);
  return td;
}

function render(data) {
  const totals = document.querySelector('#totals tbody');
  totals.replaceChildren();
  for (const t of data.totals) {
    const tr = el('tr');
    cell(tr, t.model);
    cell(tr, t.held, 'num');
    cell(tr, t.busy, 'num');
    cell(tr, t.held - t.busy, 'num');
    cell(tr, t.free === null || t.free === undefined ? '—' : t.free, 'num');
    totals.appendChild(tr);
  }
  const body = document.querySelector('#servers tbody');
  body.replaceChildren();
  for (const s of data.servers) {
    const tr = el('tr');
    tr.dataset.server = s.user + '/' + s.server;
    cell(tr, s.user);
    cell(tr, s.server || '(default)');
    cell(tr, s.profile || '—');
    const names = s.gpus.length ? s.gpus.length + ' × ' + (s.gpus[0].label || s.gpus[0].name || s.gpu_model || '?') : 'none (CPU)';
    cell(tr, names, s.gpus.length ? 'gpus' : 'gpus muted');
    cell(tr).appendChild(spark(s.spark.t, s.spark.util, 100, '#1f77b4'));
    cell(tr).appendChild(spark(s.spark.t, s.spark.mem, 0, '#2ca02c'));
    // util_text: "n/a (MIG)" where NVML cannot measure a GPU (a MIG instance), never a 0 it did not read
    const now = (s.util_text || s.util.map(u => (u === null ? '—' : Math.round(u) + '%'))).join(' ');
    cell(tr, s.gpus.length ? now : '—', 'num util');
    cell(tr, s.gpus.length ? fmtDuration(s.idle_s) : '—', 'num');
    const jobGpus = j => (j.gpu_util && j.gpu_util.length
      ? ', GPUs ' + j.gpu_util.map(u => Math.round(u) + '%').join(' ') : '');
    cell(tr, s.jobs.length ? s.jobs.map(j => j.name + ' (' + j.state + jobGpus(j) + ')').join(', ') : '—', 'jobs');
    let cull = s.action || '—';
    let cls = 'muted';
    if (s.reason) {
      cull = s.reason; // "GPU utilization not measured (...: not measurable on a MIG instance); not culled"
    }
    if (s.cull_at) {
      cull = 'warned: stop in ' + fmtDuration(Math.max(0, s.cull_at - data.now));
      cls = 'warn';
    }
    if (s.error) {
      cull = s.error; // "no data (never reported); not culled", "last report refused: ..."
      cls = 'err';
    }
    const td = cell(tr, cull, cls);
    if (s.refusals) {
      // a reporter that sends bad reports now and then stays visible after its next good one
      td.title = s.refusals.count + ' reports refused; the last ' + fmtDuration(Math.max(0, data.now - s.refusals.at)) +
        ' ago: ' + s.refusals.why;
    }
    body.appendChild(tr);
  }
  const held = data.totals.reduce((a, t) => a + t.held, 0);
  document.getElementById('status').textContent =
    data.servers.length + ' servers, ' + held + ' GPUs held; updated ' + new Date(data.refreshed * 1000).toLocaleTimeString();
}

async function tick() {
  try {
    const xsrf = document.querySelector('meta[name="tfdist-xsrf"]').getAttribute('content');
    const r = await fetch('api/servers', { credentials: 'same-origin', headers: { 'X-XSRFToken': xsrf } });
    if (!r.ok) throw new Error(r.status + ' ' + (await r.text()));
    render(await r.json());
  } catch (e) {
    const s = document.getElementById('status');
    s.textContent = 'cannot load: ' + e.message;
    s.className = 'err';
  }
}

tick();
setInterval(tick, 2000);
