/**
 * What a new user reads in the panel (issue 15): names told apart in a narrow panel, Stop explains itself,
 * a finished job keeps its charts, TensorFlow's start-up noise is not the first thing shown; and (issue 14)
 * a monitor whose kernel died says so instead of "starting" forever.
 */
import assert from 'node:assert/strict';
import { test } from 'node:test';

import { JSDOM } from 'jsdom';

import { bannerText, isKernelLoss, markKernelLoss, monitorJob, rememberMonitors } from '../kernelwatch';
import { IJobDetail, IJobSummary, jobUtil, stopUnavailable } from '../model';
import { progressText, renderJobDetail, renderJobList } from '../render';

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
    tasks_started: 2,
    tasks_total: 3,
    epoch: 2,
    epochs: 8,
    gpu_util: [],
    cpu_total: 50,
    ...extra
  };
}

function job(name: string, state: IJobDetail['state'], extra: Partial<IJobDetail> = {}): IJobDetail {
  const ended = ['succeeded', 'failed', 'stopped'].includes(state) ? 1000 : null;
  return {
    name,
    user: 'alice',
    state,
    message: '',
    tasks: { 'worker-0': { state: 'exited-ok', restarts: 0, gpus: [] } },
    metrics: [
      { t: 1, tasks: { 'worker-0': { 'cpu (%)': 40, 'rss (MiB)': 1, gpus: [] } } },
      { t: 2, tasks: { 'worker-0': { 'cpu (%)': 80, 'rss (MiB)': 1, gpus: [] } } }
    ],
    logs: { 'chief-0': ['epoch 1/8 loss 2.1'] },
    summary: summary(name, { state, ended }),
    ...extra
  };
}

function dom(): Document {
  return new JSDOM('<!doctype html><body></body>').window.document;
}

test('long job names that differ only at the end stay apart: full text, wrapping, tooltip', () => {
  const doc = dom();
  const c = doc.createElement('div');
  const a = 'tfdist-digits-experiment-1';
  const b = 'tfdist-digits-experiment-2';
  renderJobList(c, [summary(a), summary(b, { state: 'failed', message: 'worker-0 ran out of memory' })], new Map(), null, () => undefined);
  const names = [...c.querySelectorAll('.tfdist-job-name')].map(e => e.textContent);
  assert.deepEqual(names, [a, b]);
  const items = [...c.querySelectorAll('.tfdist-job')] as HTMLElement[];
  assert.equal(items[0].title.split('\n')[0], a);
  assert.equal(items[1].title, `${b}\nfailed: worker-0 ran out of memory`);
});

test('Stop says why it is off; on a running job it is on', () => {
  assert.equal(stopUnavailable(job('a', 'running'), false), null);
  assert.match(stopUnavailable(job('a', 'succeeded'), false)!, /already finished \(succeeded\)/);
  assert.match(stopUnavailable(null, false)!, /Loading/);
  assert.match(stopUnavailable(job('a', 'running'), true)!, /being ended/);
  const doc = dom();
  const c = doc.createElement('div');
  renderJobDetail(c, job('a', 'stopped'), 'a', false, () => undefined, () => undefined);
  const stop = c.querySelector('.tfdist-stop') as HTMLButtonElement;
  assert.equal(stop.disabled, true);
  assert.match(stop.title, /the job already finished \(stopped\)/);
  assert.equal((c.querySelector('.tfdist-stop-box') as HTMLElement).title, stop.title);
  assert.match(c.querySelector('.tfdist-stop-reason')!.textContent!, /already finished/);
  renderJobDetail(c, job('a', 'running'), 'a', false, () => undefined, () => undefined);
  assert.equal((c.querySelector('.tfdist-stop') as HTMLButtonElement).disabled, false);
  assert.equal(c.querySelector('.tfdist-stop-reason'), null);
});

test('a finished job shows its stored per-task charts with the run average', () => {
  const doc = dom();
  const c = doc.createElement('div');
  renderJobDetail(c, job('a', 'succeeded'), 'a', false, () => undefined, () => undefined);
  assert.ok(c.querySelector('.tfdist-task-charts svg polyline'));
  assert.equal(c.querySelector('.tfdist-chart-value')!.textContent, 'avg 60%');
  assert.equal(jobUtil(summary('a', { state: 'succeeded' })), null, 'no flat line of a stale sample');
  renderJobDetail(c, job('b', 'failed', { metrics: [] }), 'b', false, () => undefined, () => undefined);
  assert.match(c.textContent!, /No utilization history/);
});

test('the job view opens on the job, and says how many start-up lines it left out', () => {
  const doc = dom();
  const c = doc.createElement('div');
  renderJobDetail(c, job('a', 'running', { logs_hidden: 7 }), 'a', false, () => undefined, () => undefined);
  const order = [...c.children].map(e => e.className);
  assert.ok(order.indexOf('tfdist-progress') < order.indexOf('tfdist-tasks'));
  assert.ok(order.indexOf('tfdist-tasks') < order.indexOf('tfdist-logbox'), 'logs come last');
  assert.equal(c.querySelector('.tfdist-progress')!.textContent, 'epoch 2/8 · 2/3 tasks started');
  assert.match(c.querySelector('.tfdist-logs-hidden')!.textContent!, /^7 TensorFlow start-up lines left out; %tfdist logs a/);
  assert.equal(progressText(job('a', 'succeeded')), 'epoch 2/8');
});

function notebook(doc: Document, names: string[]): HTMLElement {
  const nb = doc.createElement('div');
  for (const n of names) {
    const out = doc.createElement('div');
    out.className = 'jp-OutputArea-output';
    const mon = doc.createElement('div');
    mon.className = `widget-vbox tfdist-monitor tfdist-job-${n}`;
    mon.textContent = 'starting tasks, 0/3 servers started';
    out.appendChild(mon);
    nb.appendChild(out);
  }
  return nb;
}

test('kernel loss statuses and job names from the monitor classes', () => {
  assert.ok(isKernelLoss('dead') && isKernelLoss('autorestarting') && isKernelLoss('restarting'));
  assert.ok(!isKernelLoss('idle') && !isKernelLoss('busy') && !isKernelLoss('starting'));
  const doc = dom();
  const el = doc.createElement('div');
  el.className = 'tfdist-monitor tfdist-job-digits-3';
  assert.equal(monitorJob(el), 'digits-3');
  el.className = 'tfdist-monitor tfdist-job-';
  assert.equal(monitorJob(el), null);
});

test('a dead kernel marks its running monitors with the final state, as text, even after the widgets vanished', async () => {
  const doc = dom();
  const nb = notebook(doc, ['run-a', 'old-b']);
  assert.equal(rememberMonitors(nb), 2);
  nb.querySelectorAll('.tfdist-monitor').forEach(m => m.remove()); // the dead kernel's widget views go
  let asked = 0;
  const fetchJob = async (name: string): Promise<IJobDetail> => {
    if (name === 'old-b') {
      return job(name, 'succeeded'); // ended at t=1000, long before the kernel went
    }
    asked++;
    return asked < 3
      ? job(name, 'running')
      : job(name, 'stopped', {
          message: `the notebook kernel went away ${EVIL}`,
          summary: summary(name, { state: 'stopped', ended: 1998 }) // ended by its lifeline, just before
        });
  };
  const marked = await markKernelLoss(nb, 'autorestarting', fetchJob, { lostAt: 2000, pollMs: 1 });
  assert.deepEqual(marked, ['run-a']);
  const banners = nb.querySelectorAll('.tfdist-kernel-died');
  assert.equal(banners.length, 1);
  assert.equal(
    banners[0].textContent,
    `The kernel died: job run-a was ended: stopped (the notebook kernel went away ${EVIL}).`
  );
  assert.equal(nb.querySelector('img'), null);
  assert.equal(nb.querySelectorAll('.tfdist-kernel-gone').length, 1, 'only the marked output is greyed');
  // a second loss updates the banner, never stacks another
  await markKernelLoss(nb, 'dead', fetchJob, { lostAt: 2000, pollMs: 1 });
  assert.equal(nb.querySelectorAll('.tfdist-kernel-died').length, 1);
});

test('banner wording: restart, success, still ending, unknown', () => {
  assert.equal(bannerText('restarting', 'j', job('j', 'stopped')), 'The kernel was restarted: job j was ended: stopped.');
  assert.equal(bannerText('dead', 'j', job('j', 'succeeded')), 'The kernel died after job j finished: succeeded.');
  assert.equal(bannerText('dead', 'j', job('j', 'running')), 'The kernel died: job j is being ended (state now: running).');
  assert.equal(bannerText('dead', 'j', null), 'The kernel died: job j was ended (its final state could not be read).');
});

test('a job the server no longer knows still gets a banner; a job never fetched twice past the wait', async () => {
  const doc = dom();
  const nb = notebook(doc, ['gone']);
  const marked = await markKernelLoss(nb, 'dead', async () => {
    throw new Error('404');
  });
  assert.deepEqual(marked, ['gone']);
  assert.match(nb.querySelector('.tfdist-kernel-died')!.textContent!, /could not be read/);
  const nb2 = notebook(doc, ['slow']);
  let calls = 0;
  await markKernelLoss(nb2, 'dead', async n => (calls++, job(n, 'running')), { waitMs: 30, pollMs: 10 });
  assert.ok(calls >= 2 && calls <= 6, `polled ${calls} times`);
  assert.match(nb2.querySelector('.tfdist-kernel-died')!.textContent!, /is being ended/);
});
