/**
 * DOM rendering of the panel, as plain functions of the model's state.
 * Job names, messages and log lines are user text: they only ever go through `textContent`
 * (never innerHTML), so `<img src=x onerror=...>` in a name is shown, not run.
 */
import { IJobDetail, IJobSummary, Series, TERMINAL, detachedText, stateWord, stopUnavailable, taskSeries } from './model';

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
    line.setAttribute('vector-effect', 'non-scaling-stroke');
    svg.appendChild(line);
  }
  return svg;
}

interface IListState {
  list: HTMLUListElement;
  rows: Map<string, HTMLLIElement>;
  onSelect: (name: string) => void;
}

// The rows live across the 1 Hz refreshes: a row rebuilt between a press and its release gets no click
// (the click goes to their common ancestor), so a user's click on a job was sometimes lost under load.
const listStates = new WeakMap<HTMLElement, IListState>();

function jobRow(doc: Document, name: string, state: IListState): HTMLLIElement {
  const li = el(doc, 'li', 'tfdist-job');
  li.appendChild(el(doc, 'span', 'tfdist-job-name', name));
  const row = el(doc, 'span', 'tfdist-job-row');
  row.appendChild(el(doc, 'span', 'tfdist-state'));
  row.appendChild(el(doc, 'span', 'tfdist-kind'));
  row.appendChild(sparkline(doc, []));
  li.appendChild(row);
  li.addEventListener('click', () => state.onSelect(name));
  return li;
}

function updateRow(li: HTMLLIElement, j: IJobSummary, series: Series, selected: boolean): void {
  li.classList.toggle('tfdist-selected', selected);
  const word = stateWord(j);
  li.dataset.state = word;
  // the full name wraps (a narrow panel must still tell jobs apart) and is the tooltip's first line
  const detached = detachedText(j);
  // a queued job's message is its sentence ("queued: 3rd in team-a, about 20 min")
  const said = word === 'queued' ? j.message : `${word}${j.message ? `: ${j.message}` : ''}`;
  li.title = [j.name, said, ...(detached ? [detached] : [])].join('\n');
  const state = li.querySelector('.tfdist-state') as HTMLElement;
  state.className = `tfdist-state tfdist-state-${safeClass(word)}`;
  state.textContent = word;
  state.title = j.queue ? j.message : '';
  const kind = li.querySelector('.tfdist-kind') as HTMLElement;
  let badge = li.querySelector('.tfdist-detached') as HTMLElement | null;
  if (detached && !badge) {
    badge = el(li.ownerDocument, 'span', 'tfdist-detached', 'detached');
    kind.before(badge);
  } else if (!detached && badge) {
    badge.remove();
    badge = null;
  }
  if (badge) {
    badge.title = detached ?? '';
  }
  kind.textContent = j.gpu_util.length > 0 ? `GPU×${j.gpu_util.length}` : 'CPU';
  const spark = li.querySelector('.tfdist-spark') as SVGSVGElement;
  spark.replaceChildren(...Array.from(sparkline(li.ownerDocument, series).childNodes));
}

export function renderJobList(
  container: HTMLElement,
  jobs: IJobSummary[],
  history: Map<string, Series>,
  selected: string | null,
  onSelect: (name: string) => void
): void {
  const doc = container.ownerDocument;
  if (jobs.length === 0) {
    listStates.delete(container);
    container.replaceChildren(el(doc, 'div', 'tfdist-empty', 'No distributed jobs yet. Run a %%tfdist cell.'));
    return;
  }
  let state = listStates.get(container);
  if (!state || state.list.parentNode !== container) {
    state = { list: el(doc, 'ul', 'tfdist-joblist'), rows: new Map(), onSelect };
    listStates.set(container, state);
    container.replaceChildren(state.list);
  }
  state.onSelect = onSelect;
  const ordered: HTMLLIElement[] = [];
  const rows = new Map<string, HTMLLIElement>();
  for (const j of jobs) {
    const li = state.rows.get(j.name) ?? jobRow(doc, j.name, state);
    updateRow(li, j, history.get(j.name) ?? [], j.name === selected);
    rows.set(j.name, li);
    ordered.push(li);
  }
  state.rows = rows;
  const current = Array.from(state.list.children);
  if (current.length !== ordered.length || current.some((c, i) => c !== ordered[i])) {
    state.list.replaceChildren(...ordered);
  }
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
  const title = el(doc, 'span', 'tfdist-detail-name', name);
  title.title = name;
  head.appendChild(title);
  const state = detail?.state ?? '…';
  head.appendChild(el(doc, 'span', `tfdist-state tfdist-state-${safeClass(state)}`, state));
  const why = stopUnavailable(detail, stopping);
  const stop = el(doc, 'button', 'jp-Button jp-mod-warn tfdist-stop', stopping ? 'Stopping…' : 'Stop');
  stop.disabled = why !== null;
  stop.title = why ?? 'Stop the job and end all its processes';
  stop.addEventListener('click', () => onStop(name));
  const stopBox = el(doc, 'span', 'tfdist-stop-box'); // a disabled button shows no tooltip in every browser
  stopBox.title = stop.title;
  stopBox.appendChild(stop);
  head.appendChild(stopBox);
  container.appendChild(head);
  if (why !== null && detail !== null && !stopping) {
    container.appendChild(el(doc, 'div', 'tfdist-stop-reason', why));
  }
  if (!detail) {
    container.appendChild(el(doc, 'div', 'tfdist-empty', 'Loading…'));
    return;
  }
  if (detail.message) {
    container.appendChild(el(doc, 'div', 'tfdist-message', detail.message));
  }
  const detached = detail.summary ? detachedText(detail.summary) : null;
  if (detached) {
    container.appendChild(el(doc, 'div', 'tfdist-detached-note', detached));
  }
  const progress = progressText(detail);
  if (progress) {
    container.appendChild(el(doc, 'div', 'tfdist-progress', progress));
  }
  const finished = TERMINAL.includes(detail.state);
  const tasks = el(doc, 'div', 'tfdist-tasks');
  const series = taskSeries(detail);
  const taskNames = Object.keys(detail.tasks).sort();
  for (const t of series.keys()) {
    if (!taskNames.includes(t)) {
      taskNames.push(t);
    }
  }
  for (const t of taskNames) {
    // one block per task, name and state over its charts: it fits the panel at any width
    const row = el(doc, 'div', 'tfdist-task');
    const head = el(doc, 'div', 'tfdist-task-head');
    head.appendChild(el(doc, 'span', 'tfdist-task-name', t));
    head.appendChild(el(doc, 'span', 'tfdist-task-state', detail.tasks[t]?.state ?? ''));
    row.appendChild(head);
    const charts = el(doc, 'div', 'tfdist-task-charts');
    for (const [dev, s] of series.get(t) ?? new Map<string, Series>()) {
      const box = el(doc, 'div', 'tfdist-chart');
      box.appendChild(el(doc, 'span', 'tfdist-chart-label', dev));
      const spark = sparkline(doc, s, 120, 24);
      spark.setAttribute('width', '100%'); // stretches with the panel; the line keeps its 1px stroke
      spark.setAttribute('preserveAspectRatio', 'none');
      box.appendChild(spark);
      // a running job's value is its last sample; a finished job's is its average over the run
      const v = finished ? mean(s) : s.length ? s[s.length - 1] : null;
      const shown = v === null ? '–' : `${finished ? 'avg ' : ''}${Math.round(v)}%`;
      box.appendChild(el(doc, 'span', 'tfdist-chart-value', shown));
      box.title = `${t} ${dev} utilization${finished ? ' over the run' : ', last two minutes'}`;
      charts.appendChild(box);
    }
    row.appendChild(charts);
    tasks.appendChild(row);
  }
  container.appendChild(tasks);
  if (finished && series.size === 0) {
    container.appendChild(el(doc, 'div', 'tfdist-empty', 'No utilization history was recorded for this job.'));
  }
  const logBox = el(doc, 'details', 'tfdist-logbox');
  logBox.open = true;
  const lines: string[] = [];
  for (const [task, ls] of Object.entries(detail.logs)) {
    for (const line of ls) {
      lines.push(`[${task}] ${line}`);
    }
  }
  logBox.appendChild(el(doc, 'summary', 'tfdist-logs-title', `Log (last ${lines.length} lines)`));
  if (detail.logs_hidden) {
    logBox.appendChild(
      el(
        doc,
        'div',
        'tfdist-logs-hidden',
        `${detail.logs_hidden} TensorFlow start-up lines left out; %tfdist logs ${name} prints everything.`
      )
    );
  }
  const logs = el(doc, 'pre', 'tfdist-logs');
  logs.textContent = lines.join('\n');
  logBox.appendChild(logs);
  container.appendChild(logBox);
}

/** "epoch 3/8 · 4/4 tasks started" from the job's summary, or '' when nothing is known yet. */
export function progressText(detail: IJobDetail): string {
  const s = detail.summary;
  if (!s) {
    return '';
  }
  const parts: string[] = [];
  if (s.epochs) {
    parts.push(`epoch ${s.epoch}/${s.epochs}`);
  } else if (s.epoch) {
    parts.push(`epoch ${s.epoch}`);
  }
  if (s.tasks_total && !TERMINAL.includes(detail.state)) {
    parts.push(`${s.tasks_started}/${s.tasks_total} tasks started`);
  }
  return parts.join(' · ');
}

function mean(s: Series): number | null {
  const v = s.filter((x): x is number => x !== null);
  return v.length ? v.reduce((a, b) => a + b, 0) / v.length : null;
}

/** State names come from the server; keep class names to [a-z-] whatever they hold. */
function safeClass(s: string): string {
  return s.toLowerCase().replace(/[^a-z-]/g, '');
}
