/**
 * The panel's state, free of JupyterLab imports so it can be unit-tested in node.
 * Fetching is injected (`JobsApi`); polling uses @lumino/polling with 'when-hidden' standby, so a
 * hidden tab stops asking and the server's one sampler goes idle.
 */
import { Poll } from '@lumino/polling';

import type {
  GpuSample,
  GpuStatus,
  JobDetail,
  JobList,
  JobSummary,
  ServerSample,
  TaskSample
} from './records.generated';

// The shapes the lab server sends, generated from the Python records (tfdist.jobrecords): never edit them
// here; add the field in Python and run `npm run gen:types`.
export type IGpuSample = GpuSample;
export type IServerSample = ServerSample;
export type IGpuStatus = GpuStatus;
export type IJobSummary = JobSummary;
export type ITaskSample = TaskSample;
export type IJobDetail = JobDetail;
export type IJobList = JobList;

export interface IJobsApi {
  listJobs(): Promise<IJobList>;
  getJob(name: string): Promise<IJobDetail>;
  stopJob(name: string): Promise<{ name: string; stopped: boolean; state: string }>;
  getGpus(): Promise<IGpuStatus>;
}

export const TERMINAL = ['succeeded', 'failed', 'stopped'];
const HISTORY = 120;

/** A series for a sparkline: one value per sample, null where unknown. */
export type Series = (number | null)[];

export class JobsModel {
  jobs: IJobSummary[] = [];
  /** Per job name: the history of its summary's utilization (one value per poll), for the list sparkline. */
  history = new Map<string, Series>();
  selected: string | null = null;
  detail: IJobDetail | null = null;
  error: string | null = null;
  stopping = new Set<string>();
  private _listeners = new Set<() => void>();

  constructor(readonly api: IJobsApi) {}

  onChange(fn: () => void): () => void {
    this._listeners.add(fn);
    return () => this._listeners.delete(fn);
  }

  private _emit(): void {
    for (const fn of this._listeners) {
      fn();
    }
  }

  /** Fold a fresh job list into the state (pure apart from the change signal). */
  setJobs(jobs: IJobSummary[]): void {
    this.jobs = jobs;
    const seen = new Set<string>();
    for (const j of jobs) {
      seen.add(j.name);
      const s = this.history.get(j.name) ?? [];
      if (!TERMINAL.includes(j.state) || s.length === 0) {
        s.push(jobUtil(j)); // a finished job's line stays as it ended instead of dropping to zero
      }
      if (s.length > HISTORY) {
        s.splice(0, s.length - HISTORY);
      }
      this.history.set(j.name, s);
    }
    for (const name of [...this.history.keys()]) {
      if (!seen.has(name)) {
        this.history.delete(name);
      }
    }
    if (this.selected !== null && !seen.has(this.selected)) {
      this.selected = null;
      this.detail = null;
    }
    this._emit();
  }

  select(name: string | null): void {
    this.selected = name;
    this.detail = null;
    this._emit();
  }

  setDetail(detail: IJobDetail | null): void {
    if (detail === null || detail.name === this.selected) {
      this.detail = detail;
      this._emit();
    }
  }

  setError(msg: string | null): void {
    if (msg !== this.error) {
      this.error = msg;
      this._emit();
    }
  }

  /** One poll tick: the list, and the open job's view. */
  async refresh(): Promise<void> {
    try {
      const r = await this.api.listJobs();
      this.setJobs(r.jobs);
      if (this.selected !== null) {
        this.setDetail(await this.api.getJob(this.selected));
      }
      this.setError(null);
    } catch (e) {
      this.setError(String((e as Error)?.message ?? e));
      throw e;
    }
  }

  async stop(name: string): Promise<void> {
    this.stopping.add(name);
    this._emit();
    try {
      await this.api.stopJob(name);
    } finally {
      this.stopping.delete(name);
    }
    await this.refresh().catch(() => undefined);
  }

  /** A Poll at `interval` ms that backs off on errors and stands by while the page is hidden. */
  startPolling(interval = 1000): Poll {
    const poll = new Poll({
      auto: true,
      factory: () => this.refresh(),
      frequency: { interval, backoff: true, max: 30 * 1000 },
      name: 'tfdist:jobs',
      standby: 'when-hidden'
    });
    return poll;
  }
}

/** The single number a job's list sparkline plots: mean GPU util if it has GPUs, else total CPU.
 * A finished job uses nothing: its last sample is history, not load. */
export function jobUtil(j: IJobSummary): number | null {
  if (TERMINAL.includes(j.state)) {
    return null;
  }
  if (j.gpu_util && j.gpu_util.length > 0) {
    return j.gpu_util.reduce((a, b) => a + b, 0) / j.gpu_util.length;
  }
  return typeof j.cpu_total === 'number' ? j.cpu_total : null;
}

/** The word the list shows for a job's state: "queued" while the cluster's queue holds it (the server's
 * message then says where and for how long, e.g. "queued: 3rd in team-a, about 20 min"); "preempted,
 * waiting to be readmitted" for a job Kueue evicted and its kernel submitted again (reason "preempted"). */
export function stateWord(j: Pick<IJobSummary, 'state' | 'queue' | 'reason'>): string {
  if (j.state !== 'pending' && j.state !== 'starting') {
    return j.state;
  }
  if (j.reason === 'preempted') {
    return 'preempted, waiting to be readmitted';
  }
  return j.queue ? 'queued' : j.state;
}

/** What the panel says of a detached job (it runs without a kernel; its results wait for an attach);
 * null for an ordinary job. `when` formats the time results are kept until. */
export function detachedText(
  j: Pick<IJobSummary, 'name' | 'detached' | 'results' | 'kept_until'>,
  when: (t: number) => string = t => new Date(t * 1000).toLocaleString()
): string | null {
  if (!j.detached) {
    return null;
  }
  const attach = `%tfdist attach ${j.name}`;
  switch (j.results) {
    case 'waiting':
      return `Detached: results wait for ${attach} until ${j.kept_until ? when(j.kept_until) : 'the retention time'}.`;
    case 'taken':
      return 'Detached: its results were taken by an attach.';
    case 'none':
      return 'Detached: it ended without results.';
    default:
      return `Detached: runs without a kernel; ${attach} follows it and brings its results.`;
  }
}

/** Why Stop cannot be pressed now, in words for its tooltip and hint; null when it can. */
export function stopUnavailable(detail: IJobDetail | null, stopping: boolean): string | null {
  if (stopping) {
    return 'Stopping: the job is being ended.';
  }
  if (detail === null) {
    return 'Loading the job…';
  }
  if (TERMINAL.includes(detail.state)) {
    return `Nothing to stop: the job already finished (${detail.state}).`;
  }
  return null;
}

/** Per task and per GPU (or CPU when a task has none): the series a job view charts. */
export function taskSeries(detail: IJobDetail): Map<string, Map<string, Series>> {
  const out = new Map<string, Map<string, Series>>();
  detail.metrics.forEach((m, i) => {
    for (const [task, rec] of Object.entries(m.tasks)) {
      let byDev = out.get(task);
      if (!byDev) {
        byDev = new Map();
        out.set(task, byDev);
      }
      const put = (key: string, v: number | null) => {
        let s = byDev!.get(key);
        if (!s) {
          s = new Array(i).fill(null);
          byDev!.set(key, s);
        }
        while (s.length < i) {
          s.push(null);
        }
        s.push(v);
      };
      if (rec.gpus && rec.gpus.length > 0) {
        for (const g of rec.gpus) {
          put(`GPU ${g.index}`, g['util (%)'] ?? null);
        }
      } else {
        put('CPU', rec['cpu (%)'] ?? null);
      }
    }
  });
  return out;
}

/** The status bar's sparkline: per sample the mean utilization of the GPUs that measured one (a MIG slice
 * reports none: counting it as 0 would draw an idle GPU), else CPU; samples with no measured GPU are left
 * out. Empty when no GPU sample measured any: the status bar then says n/a. */
export function gpuSeries(s: IGpuStatus): number[] {
  if (s.gpu_count === 0) {
    return s.samples.map(x => x['cpu (%)']);
  }
  const out: number[] = [];
  for (const x of s.samples) {
    const utils = x.gpus.map(g => g['util (%)']).filter((v): v is number => typeof v === 'number');
    if (utils.length) {
      out.push(utils.reduce((a, b) => a + b, 0) / utils.length);
    }
  }
  return out;
}

/** The status bar's text: GPU count + mean utilization, or CPU when this server has no GPU. */
export function statusText(s: IGpuStatus | null): string {
  if (!s) {
    return 'tfdist: …';
  }
  const last = s.samples.length ? s.samples[s.samples.length - 1] : null;
  if (s.gpu_count > 0) {
    const utils = (last?.gpus ?? []).map(g => g['util (%)']).filter((v): v is number => v !== null);
    const mean = utils.length ? Math.round(utils.reduce((a, b) => a + b, 0) / utils.length) : null;
    return `${s.gpu_count} GPU${s.gpu_count > 1 ? 's' : ''}: ${mean === null ? '–' : mean + '%'}`;
  }
  const cpu = last ? Math.round(last['cpu (%)']) : null;
  return `CPU: ${cpu === null ? '–' : cpu + '%'}`;
}
