/**
 * DOM rendering of the panel, as plain functions of the model's state.
 * Job names, messages and log lines are user text: they only ever go through `textContent`
 * (never innerHTML), so `<img src=x onerror=...>` in a name is shown, not run.
 */
import { IJobDetail, IJobSummary, Series, TERMINAL, taskSeries } from './model';

const SVG = 'http://www.w3.org/2000/svg';

function el<K extends keyof HTMLElementTagNameMap>(
  doc: Document,
  tag: K,
  cls?: string,
  text?: string
): HTMLElementTagNameMap[K] {
  const e = doc.createElement(tag);
  if (cls) {
    e.className = cls;
  }
  if (text !== undefined) {
    e.textContent = text;
  }
  return e;
}

/** A 0-100 % sparkline as an SVG polyline; null values break nothing (they plot as 0). */
export function sparkline(doc: Document, series: Series, width = 80, height = 16): SVGSVGElement {
  const svg = doc.createElementNS(SVG, 'svg') as SVGSVGElement;
  svg.setAttribute('class', 'tfdist-spark');
  svg.setAttribute('width', String(width));
  svg.setAttribute('height', String(height));
  svg.setAttribute('viewBox', `0 0 ${width} ${height}`);
  const n = series.length;
  if (n > 0) {
    const pts = series.map((v, i) => {
      const x = n === 1 ? width : (i * width) / (n - 1);
      const y = height - (Math.max(0, Math.min(100, v ?? 0)) / 100) * (height - 1) - 0.5;
      return `${x.toFixed(1)},${y.toFixed(1)}`;
    });
    const line = doc.createElementNS(SVG, 'polyline');
    line.setAttribute('points', pts.join(' '));
    line.setAttribute('fill', 'none');
    line.setAttribute('stroke', 'currentColor');
    svg.appendChild(line);
  }
  return svg;
}

export function renderJobList(
  container: HTMLElement,
  jobs: IJobSummary[],
  history: Map<string, Series>,
  selected: string | null,
  onSelect: (name: string) => void
): void {
  const doc = container.ownerDocument;
  container.replaceChildren();
  if (jobs.length === 0) {
    container.appendChild(el(doc, 'div', 'tfdist-empty', 'No distributed jobs yet. Run a %%tfdist cell.'));
    return;
  }
  const list = el(doc, 'ul', 'tfdist-joblist');
  for (const j of jobs) {
    const li = el(doc, 'li', 'tfdist-job');
    li.dataset.state = j.state;
    if (j.name === selected) {
      li.classList.add('tfdist-selected');
    }
    li.title = j.message || j.state;
    li.appendChild(el(doc, 'span', 'tfdist-job-name', j.name));
    li.appendChild(el(doc, 'span', `tfdist-state tfdist-state-${safeClass(j.state)}`, j.state));
    const kind = j.gpu_util.length > 0 ? `GPU×${j.gpu_util.length}` : 'CPU';
    li.appendChild(el(doc, 'span', 'tfdist-kind', kind));
    li.appendChild(sparkline(doc, history.get(j.name) ?? []));
    li.addEventListener('click', () => onSelect(j.name));
    list.appendChild(li);
  }
  container.appendChild(list);
}

export function renderJobDetail(
  container: HTMLElement,
  detail: IJobDetail | null,
  name: string | null,
  stopping: boolean,
  onStop: (name: string) => void,
  onBack: () => void
): void {
  const doc = container.ownerDocument;
  container.replaceChildren();
  if (name === null) {
    return;
  }
  const head = el(doc, 'div', 'tfdist-detail-head');
  const back = el(doc, 'button', 'jp-Button tfdist-back', '←');
  back.title = 'Back to the job list';
  back.addEventListener('click', onBack);
  head.appendChild(back);
  head.appendChild(el(doc, 'span', 'tfdist-detail-name', name));
  const state = detail?.state ?? '…';
  head.appendChild(el(doc, 'span', `tfdist-state tfdist-state-${safeClass(state)}`, state));
  const stop = el(doc, 'button', 'jp-Button jp-mod-warn tfdist-stop', stopping ? 'Stopping…' : 'Stop');
  stop.disabled = stopping || detail === null || TERMINAL.includes(state);
  stop.addEventListener('click', () => onStop(name));
  head.appendChild(stop);
  container.appendChild(head);
  if (!detail) {
    container.appendChild(el(doc, 'div', 'tfdist-empty', 'Loading…'));
    return;
  }
  if (detail.message) {
    container.appendChild(el(doc, 'div', 'tfdist-message', detail.message));
  }
  const tasks = el(doc, 'table', 'tfdist-tasks');
  const series = taskSeries(detail);
  const taskNames = Object.keys(detail.tasks).sort();
  for (const t of series.keys()) {
    if (!taskNames.includes(t)) {
      taskNames.push(t);
    }
  }
  for (const t of taskNames) {
    const tr = el(doc, 'tr', 'tfdist-task');
    tr.appendChild(el(doc, 'td', 'tfdist-task-name', t));
    tr.appendChild(el(doc, 'td', 'tfdist-task-state', detail.tasks[t]?.state ?? ''));
    const charts = el(doc, 'td', 'tfdist-task-charts');
    for (const [dev, s] of series.get(t) ?? new Map<string, Series>()) {
      const box = el(doc, 'span', 'tfdist-chart');
      box.appendChild(el(doc, 'span', 'tfdist-chart-label', dev));
      box.appendChild(sparkline(doc, s, 120, 24));
      const last = s.length ? s[s.length - 1] : null;
      box.appendChild(el(doc, 'span', 'tfdist-chart-value', last === null ? '–' : `${Math.round(last)}%`));
      charts.appendChild(box);
    }
    tr.appendChild(charts);
    tasks.appendChild(tr);
  }
  container.appendChild(tasks);
  const logs = el(doc, 'pre', 'tfdist-logs');
  const lines: string[] = [];
  for (const [task, ls] of Object.entries(detail.logs)) {
    for (const line of ls) {
      lines.push(`[${task}] ${line}`);
    }
  }
  logs.textContent = lines.join('\n');
  container.appendChild(logs);
}

/** State names come from the server; keep class names to [a-z-] whatever they hold. */
function safeClass(s: string): string {
  return s.toLowerCase().replace(/[^a-z-]/g, '');
}
