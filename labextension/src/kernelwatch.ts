/**
 * When a notebook's kernel dies or restarts, every %%tfdist monitor in that notebook says so.
 *
 * Why: the job is ended by its lifeline when the kernel goes, but the cell's monitor is a widget of the dead
 * kernel: nothing updates it any more, so it would keep claiming "starting" (or "epoch 2/8") forever. The
 * lab side sees the kernel go, asks the server how each monitor's job ended, and puts a banner on the
 * monitor's output. Free of JupyterLab imports (the job fetch is injected) so it is unit-tested with jsdom.
 * Job names and messages are server text: they only ever go through `textContent`.
 */
import { IJobDetail, TERMINAL } from './model';

/** The class of the monitor's outer widget (kernel_magics/monitor.py), and of the job name on it. */
export const MONITOR_CLASS = 'tfdist-monitor';
export const JOB_CLASS_PREFIX = 'tfdist-job-';
export const BANNER_CLASS = 'tfdist-kernel-died';
export const GONE_CLASS = 'tfdist-kernel-gone';
/** Set on the output that held a monitor, so the banner finds it even after the widget views are gone. */
const JOB_ATTR = 'data-tfdist-job';

export type KernelLoss = 'dead' | 'restarting' | 'autorestarting';

export function isKernelLoss(status: string): status is KernelLoss {
  return status === 'dead' || status === 'restarting' || status === 'autorestarting';
}

/** The job a monitor element shows, from its `tfdist-job-<name>` class; null when it has none. */
export function monitorJob(el: Element): string | null {
  for (const c of Array.from(el.classList)) {
    if (c.startsWith(JOB_CLASS_PREFIX) && c.length > JOB_CLASS_PREFIX.length) {
      return c.slice(JOB_CLASS_PREFIX.length);
    }
  }
  return null;
}

/** The element a monitor's banner goes into: its rendered output node (which outlives the widget's
 * own view when the kernel goes), else its parent. */
function outputOf(el: Element): Element {
  return el.closest('.jp-OutputArea-output') ?? el.parentElement ?? el;
}

/** Tag every monitor's output with its job name (call whenever the notebook's DOM changed). */
export function rememberMonitors(root: ParentNode): number {
  let n = 0;
  for (const m of Array.from(root.querySelectorAll(`.${MONITOR_CLASS}`))) {
    const name = monitorJob(m);
    if (name) {
      outputOf(m).setAttribute(JOB_ATTR, name);
      n++;
    }
  }
  return n;
}

/** What the banner says, from how the kernel went and the job's state as the server reports it. */
export function bannerText(loss: KernelLoss, name: string, job: IJobDetail | null): string {
  const how = loss === 'restarting' ? 'The kernel was restarted' : 'The kernel died';
  if (job === null) {
    return `${how}: job ${name} was ended (its final state could not be read).`;
  }
  const reason = job.message ? ` (${job.message})` : '';
  if (job.state === 'succeeded') {
    return `${how} after job ${name} finished: succeeded${reason}.`;
  }
  if (TERMINAL.includes(job.state)) {
    return `${how}: job ${name} was ended: ${job.state}${reason}.`;
  }
  return `${how}: job ${name} is being ended (state now: ${job.state}${reason}).`;
}

export interface IMarkOptions {
  /** when the kernel went, in seconds since the epoch (the server's `ended` is in the same unit) */
  lostAt?: number;
  /** jobs that had ended more than this long before the kernel went are left alone */
  slackS?: number;
  /** how long to wait for the job to reach its final state, and how often to ask */
  waitMs?: number;
  pollMs?: number;
}

const sleep = (ms: number) => new Promise(resolve => setTimeout(resolve, ms));

async function finalState(
  name: string,
  fetchJob: (name: string) => Promise<IJobDetail>,
  waitMs: number,
  pollMs: number
): Promise<IJobDetail | null> {
  const deadline = Date.now() + waitMs;
  let last: IJobDetail | null = null;
  for (;;) {
    try {
      last = await fetchJob(name);
    } catch {
      return last; // gone (404) or unreachable: say what is known
    }
    if (TERMINAL.includes(last.state) || Date.now() >= deadline) {
      return last;
    }
    await sleep(pollMs);
  }
}

/**
 * Put a banner on every monitor output under `root` whose job was still going when the kernel went.
 * Returns the job names marked. A second loss replaces the banner's text rather than adding another.
 */
export async function markKernelLoss(
  root: ParentNode,
  loss: KernelLoss,
  fetchJob: (name: string) => Promise<IJobDetail>,
  options: IMarkOptions = {}
): Promise<string[]> {
  const lostAt = options.lostAt ?? Date.now() / 1000;
  const slackS = options.slackS ?? 10; // the server notices a dead kernel within a few seconds
  rememberMonitors(root);
  const outputs = Array.from(root.querySelectorAll(`[${JOB_ATTR}]`));
  const marked = await Promise.all(
    outputs.map(async out => {
      const name = out.getAttribute(JOB_ATTR)!;
      const job = await finalState(name, fetchJob, options.waitMs ?? 20000, options.pollMs ?? 1000);
      const ended = job?.summary?.ended ?? null;
      if (job && TERMINAL.includes(job.state) && ended !== null && ended < lostAt - slackS) {
        return null; // it had finished long before: the monitor already tells the truth
      }
      const doc = out.ownerDocument!;
      let banner = out.querySelector(`:scope > .${BANNER_CLASS}`);
      if (!banner) {
        banner = doc.createElement('div');
        banner.className = BANNER_CLASS;
        banner.setAttribute('role', 'status');
        out.insertBefore(banner, out.firstChild);
      }
      banner.textContent = bannerText(loss, name, job);
      out.classList.add(GONE_CLASS); // the dead kernel's widgets below are greyed: the banner is the truth
      return name;
    })
  );
  return marked.filter((n): n is string => n !== null);
}
