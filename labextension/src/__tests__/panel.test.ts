/**
 * Unit tests for the panel's state model and its DOM rendering (node's test runner + jsdom).
 */
import assert from 'node:assert/strict';
import { test } from 'node:test';

import { JSDOM } from 'jsdom';

import {
  IJobDetail,
  IJobSummary,
  IJobsApi,
  JobsModel,
  detachedText,
  gpuSeries,
  jobUtil,
  stateWord,
  statusText,
  taskSeries
} from '../model';
import { renderJobDetail, renderJobList } from '../render';

const EVIL = '<img src=x onerror=alert(1)>';

function summary(name: string, extra: Partial<IJobSummary> = {}): IJobSummary {
  return {
    name,
    user: 'alice',
    backend: 'local',
    state: 'running',
    message: '',
    created: 1,
    ended: null,
    tasks_started: 4,
    tasks_total: 4,
    epoch: 1,
    epochs: 3,
    gpu_util: [],
    cpu_total: 50,
    ...extra
  };
}

function detail(name: string): IJobDetail {
  return {
    name,
    user: 'alice',
    state: 'running',
    message: EVIL,
    tasks: { 'worker-0': { state: 'running', restarts: 0, gpus: [] }, 'ps-0': { state: 'running', restarts: 0, gpus: [] } },
    metrics: [
      { t: 1, tasks: { 'worker-0': { 'cpu (%)': 10, 'rss (MiB)': 1, gpus: [] } } },
      {
        t: 2,
        tasks: {
          'worker-0': { 'cpu (%)': 20, 'rss (MiB)': 1, gpus: [] },
          'ps-0': {
            'cpu (%)': 5,
            'rss (MiB)': 1,
            gpus: [{ index: 0, 'util (%)': 70, 'mem_used (MiB)': 1, 'mem_total (MiB)': 2 }]
          }
        }
      }
    ],
    logs: { 'worker-0': ['epoch 1', EVIL] },
    summary: summary(name)
  };
}

function fakeApi(jobs: IJobSummary[]): IJobsApi & { stopped: string[] } {
  const stopped: string[] = [];
  return {
    stopped,
    listJobs: async () => ({ user: 'alice', jobs }),
    getJob: async (name: string) => detail(name),
    stopJob: async (name: string) => {
      stopped.push(name);
      return { name, stopped: true, state: 'stopped' };
    },
    getGpus: async () => ({ gpu_count: 0, gpus: [], cpu_count: 2, interval_s: 1, samples: [] })
  };
}

function dom(): Document {
  return new JSDOM('<!doctype html><body></body>').window.document;
}

test('the model keeps a bounded per-job history and forgets jobs that are gone', () => {
  const m = new JobsModel(fakeApi([]));
  let changes = 0;
  m.onChange(() => changes++);
  for (let i = 0; i < 130; i++) {
    m.setJobs([summary('a', { cpu_total: i }), summary('b', { gpu_util: [10, 30] })]);
  }
  assert.equal(m.history.get('a')!.length, 120);
  assert.equal(m.history.get('a')![119], 129);
  assert.equal(m.history.get('b')![0], 20);
  m.select('b');
  m.setJobs([summary('a')]);
  assert.equal(m.history.has('b'), false);
  assert.equal(m.selected, null, 'a vanished job is deselected');
  assert.ok(changes >= 132);
});

test('refresh loads the list and the open job; stale detail is dropped', async () => {
  const m = new JobsModel(fakeApi([summary('a')]));
  m.select('a');
  await m.refresh();
  assert.equal(m.jobs.length, 1);
  assert.equal(m.detail?.name, 'a');
  m.select(null);
  m.setDetail(detail('a'));
  assert.equal(m.detail, null, 'a late answer for a closed job is ignored');
});

test('stop calls the API and refreshes; errors are recorded', async () => {
  const api = fakeApi([summary('a')]);
  const m = new JobsModel(api);
  await m.stop('a');
  assert.deepEqual(api.stopped, ['a']);
  assert.equal(m.stopping.size, 0);
  api.listJobs = async () => {
    throw new Error('boom');
  };
  await assert.rejects(m.refresh());
  assert.equal(m.error, 'boom');
});

test('utilization: GPUs when a job has them, else CPU; per task and device series', () => {
  assert.equal(jobUtil(summary('a', { gpu_util: [40, 60] })), 50);
  assert.equal(jobUtil(summary('a', { cpu_total: 33 })), 33);
  const s = taskSeries(detail('a'));
  assert.deepEqual(s.get('worker-0')!.get('CPU'), [10, 20]);
  assert.deepEqual(s.get('ps-0')!.get('GPU 0'), [null, 70]);
  assert.equal(statusText(null), 'tfdist: …');
  const gpu = { index: 0, 'util (%)': 40, 'mem_used (MiB)': 1, 'mem_total (MiB)': 2 };
  assert.equal(
    statusText({ gpu_count: 2, gpus: [], cpu_count: 2, interval_s: 1, samples: [{ t: 1, 'cpu (%)': 3, 'mem (%)': 1, gpus: [gpu, { ...gpu, 'util (%)': 60 }] }] }),
    '2 GPUs: 50%'
  );
  assert.equal(
    statusText({ gpu_count: 0, gpus: [], cpu_count: 2, interval_s: 1, samples: [{ t: 1, 'cpu (%)': 12.4, 'mem (%)': 1, gpus: [] }] }),
    'CPU: 12%'
  );
});

test('the status sparkline averages only measured GPUs: a MIG slice (no utilization) is not a 0', () => {
  const gpu = { index: 0, 'util (%)': 80, 'mem_used (MiB)': 1, 'mem_total (MiB)': 2 };
  const mig = { index: 1, 'util (%)': null, util_missing: 'mig', 'mem_used (MiB)': 1, 'mem_total (MiB)': 2 };
  const status = (gpus: (typeof gpu | typeof mig)[][]) => ({
    gpu_count: 2,
    gpus: [],
    cpu_count: 2,
    interval_s: 1,
    samples: gpus.map((g, t) => ({ t, 'cpu (%)': 3, 'mem (%)': 1, gpus: g }))
  });
  assert.deepEqual(gpuSeries(status([[gpu, mig], [{ ...gpu, 'util (%)': 20 }, mig]])), [80, 20]);
  assert.deepEqual(gpuSeries(status([[mig, { ...mig, index: 2 }]])), []); // nothing measured: n/a
  assert.deepEqual(gpuSeries({ ...status([[]]), gpu_count: 0 }), [3]);
});

test('a job name holding HTML renders as text in the list', () => {
  const doc = dom();
  const c = doc.createElement('div');
  doc.body.appendChild(c);
  let clicked = '';
  const m = new JobsModel(fakeApi([]));
  // a hostile server's state: rendered as text whatever it holds
  m.setJobs([summary(EVIL, { state: '<b>x</b>' as IJobSummary['state'] })]);
  renderJobList(c, m.jobs, m.history, null, n => (clicked = n));
  assert.equal(c.querySelector('img'), null);
  assert.equal(c.querySelector('b'), null);
  assert.equal(c.querySelector('.tfdist-job-name')!.textContent, EVIL);
  assert.ok(c.querySelector('svg.tfdist-spark polyline'));
  (c.querySelector('.tfdist-job') as HTMLElement).click();
  assert.equal(clicked, EVIL);
});

test('a job in the cluster\'s queue is "queued" in the list, the server\'s sentence its tooltip', () => {
  const message = 'queued: 3rd in team-a, about 20 min';
  const queued = summary('q', { state: 'pending', message, queue: { position: 3, queue: 'team-a', ahead: 2, wait_s: 1200 } });
  assert.equal(stateWord(queued), 'queued');
  assert.equal(stateWord(summary('r', { queue: null })), 'running');
  // a late queue record on a job that already runs or ended does not make it look queued
  assert.equal(stateWord(summary('s', { state: 'failed', queue: { position: 1 } })), 'failed');
  // a job Kueue preempted and its kernel submitted again says so, in line or not, until it runs
  const again = summary('p', { state: 'pending', reason: 'preempted', queue: { position: 1 } });
  assert.equal(stateWord(again), 'preempted, waiting to be readmitted');
  assert.equal(stateWord(summary('p', { state: 'failed', reason: 'preempted' })), 'failed');
  const doc = dom();
  const c = doc.createElement('div');
  doc.body.appendChild(c);
  renderJobList(c, [queued], new Map(), null, () => undefined);
  const state = c.querySelector('.tfdist-state') as HTMLElement;
  assert.equal(state.textContent, 'queued');
  assert.equal(state.title, message);
  assert.ok(state.classList.contains('tfdist-state-queued'));
  assert.equal((c.querySelector('.tfdist-job') as HTMLElement).title, `q\n${message}`);
});

test('the job view renders name, message and log lines as text, with a Stop button', () => {
  const doc = dom();
  const c = doc.createElement('div');
  let stopped = '';
  renderJobDetail(c, detail(EVIL), EVIL, false, n => (stopped = n), () => undefined);
  assert.equal(c.querySelector('img'), null);
  assert.equal(c.querySelector('.tfdist-detail-name')!.textContent, EVIL);
  assert.equal(c.querySelector('.tfdist-message')!.textContent, EVIL);
  assert.ok(c.querySelector('.tfdist-logs')!.textContent!.includes(`[worker-0] ${EVIL}`));
  assert.equal(c.querySelectorAll('.tfdist-task').length, 2);
  const stop = c.querySelector('.tfdist-stop') as HTMLButtonElement;
  assert.equal(stop.disabled, false);
  stop.click();
  assert.equal(stopped, EVIL);
  const ended = { ...detail('a'), state: 'stopped' as const };
  renderJobDetail(c, ended, 'a', false, () => undefined, () => undefined);
  assert.equal((c.querySelector('.tfdist-stop') as HTMLButtonElement).disabled, true);
});

test('a detached job is marked in the list and its view says where its results are', () => {
  const at = (t: number) => `t=${t}`;
  assert.equal(detachedText(summary('plain')), null);
  assert.equal(
    detachedText(summary('a', { detached: true, results: 'pending' }), at),
    'Detached: runs without a kernel; %tfdist attach a follows it and brings its results.'
  );
  assert.equal(
    detachedText(summary('a', { state: 'succeeded', detached: true, results: 'waiting', kept_until: 90 }), at),
    'Detached: results wait for %tfdist attach a until t=90.'
  );
  assert.equal(detachedText(summary('a', { detached: true, results: 'taken' })), 'Detached: its results were taken by an attach.');
  assert.equal(detachedText(summary('a', { detached: true, results: 'none' })), 'Detached: it ended without results.');

  const doc = dom();
  const c = doc.createElement('div');
  const m = new JobsModel(fakeApi([]));
  m.setJobs([summary('away', { state: 'succeeded', detached: true, results: 'waiting', kept_until: 90 }), summary('plain')]);
  renderJobList(c, m.jobs, m.history, null, () => undefined);
  const rows = [...c.querySelectorAll('.tfdist-job')] as HTMLElement[];
  const away = rows.find(r => r.querySelector('.tfdist-job-name')!.textContent === 'away')!;
  const plain = rows.find(r => r.querySelector('.tfdist-job-name')!.textContent === 'plain')!;
  assert.equal(away.querySelector('.tfdist-detached')!.textContent, 'detached');
  assert.ok(away.title.includes('results wait for %tfdist attach away until'));
  assert.equal(plain.querySelector('.tfdist-detached'), null);

  const d = { ...detail('away'), state: 'succeeded' as const, summary: summary('away', { detached: true, results: 'taken' }) };
  renderJobDetail(c, d, 'away', false, () => undefined, () => undefined);
  assert.equal(c.querySelector('.tfdist-detached-note')!.textContent, 'Detached: its results were taken by an attach.');
});

test('a refresh keeps the rows (a press then a release across a refresh still clicks the job)', () => {
  const doc = dom();
  const c = doc.createElement('div');
  doc.body.appendChild(c);
  let clicked = '';
  const m = new JobsModel(fakeApi([]));
  m.setJobs([summary('a'), summary('b')]);
  renderJobList(c, m.jobs, m.history, null, n => (clicked = n));
  const [rowA, rowB] = Array.from(c.querySelectorAll('.tfdist-job'));
  const pressed = rowB.querySelector('.tfdist-state');
  m.setJobs([summary('a'), summary('b', { state: 'failed', message: 'boom', detached: true })]);
  renderJobList(c, m.jobs, m.history, 'b', n => (clicked = n));
  const after = Array.from(c.querySelectorAll('.tfdist-job'));
  assert.equal(after[0], rowA);
  assert.equal(after[1], rowB);
  assert.equal(rowB.querySelector('.tfdist-state'), pressed);
  assert.equal(pressed!.textContent, 'failed');
  assert.ok(rowB.classList.contains('tfdist-selected'));
  assert.equal(rowB.querySelector('.tfdist-detached')!.textContent, 'detached');
  (rowB as HTMLElement).click();
  assert.equal(clicked, 'b');
  m.setJobs([summary('b', { state: 'failed' })]);
  renderJobList(c, m.jobs, m.history, null, n => (clicked = n));
  assert.deepEqual(Array.from(c.querySelectorAll('.tfdist-job')), [rowB]);
  assert.equal(rowB.querySelector('.tfdist-detached'), null);
});
