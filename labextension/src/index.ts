/**
 * jupyter-tfdist lab plugin: the "Distributed jobs" side panel and a GPU status-bar item.
 */
import { ILabShell, JupyterFrontEnd, JupyterFrontEndPlugin } from '@jupyterlab/application';
import { INotebookTracker, NotebookPanel } from '@jupyterlab/notebook';
import { IStatusBar } from '@jupyterlab/statusbar';
import { LabIcon } from '@jupyterlab/ui-components';

import { watchHubNotice } from './hubnotice';
import { isKernelLoss, markKernelLoss, rememberMonitors } from './kernelwatch';
import { IGpuStatus, IJobDetail, IJobsApi, IJobSummary } from './model';
import { GpuStatusItem, JobsPanel } from './panel';
import { requestAPI } from './request';

const ICON_SVG =
  '<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 24 24"><g class="jp-icon3" fill="#616161">' +
  '<rect x="3" y="4" width="5" height="16"/><rect x="10" y="8" width="5" height="12"/>' +
  '<rect x="17" y="2" width="4" height="18"/></g></svg>';

export const tfdistIcon = new LabIcon({ name: 'jupyter-tfdist:jobs', svgstr: ICON_SVG });

export const api: IJobsApi = {
  listJobs: () => requestAPI<{ user: string; jobs: IJobSummary[] }>('jobs'),
  getJob: (name: string) => requestAPI<IJobDetail>(`jobs/${encodeURIComponent(name)}`),
  stopJob: (name: string) =>
    requestAPI<{ name: string; stopped: boolean; state: string }>(`jobs/${encodeURIComponent(name)}/stop`, {
      method: 'POST'
    }),
  getGpus: () => requestAPI<IGpuStatus>('gpus')
};

const plugin: JupyterFrontEndPlugin<void> = {
  id: 'jupyter-tfdist:plugin',
  description: 'Distributed jobs panel and GPU status item',
  autoStart: true,
  optional: [ILabShell, IStatusBar, INotebookTracker],
  activate: (
    app: JupyterFrontEnd,
    labShell: ILabShell | null,
    statusBar: IStatusBar | null,
    notebooks: INotebookTracker | null
  ) => {
    watchHubNotice(); // the hub's GPU-idle warning (tfdist.hubadmin)
    const panel = new JobsPanel(api);
    panel.title.icon = tfdistIcon;
    app.shell.add(panel, 'left', { rank: 800 });
    if (statusBar) {
      const item = new GpuStatusItem(api);
      statusBar.registerStatusItem('jupyter-tfdist:gpus', { item, align: 'left', rank: 5 });
    }
    if (notebooks) {
      // a "restarting" status is the user's own restart only right after a restart command; else a crash
      app.commands.commandExecuted.connect((_, args) => {
        if (/restart/i.test(args.id)) {
          lastRestartCommand = Date.now();
        }
      });
      notebooks.widgetAdded.connect((_, nb) => watchKernel(nb));
      notebooks.forEach(watchKernel);
    }
  }
};

let lastRestartCommand = 0;
const RESTART_WINDOW_MS = 60 * 1000; // the restart dialog waits for the user's answer

/**
 * Mark the notebook's %%tfdist monitors when its kernel dies or restarts (kernelwatch.ts). Which output
 * shows which job is noted as the DOM changes, because a dead kernel's widget views may vanish first.
 */
function watchKernel(nb: NotebookPanel): void {
  let pending = 0;
  const observer = new MutationObserver(() => {
    if (!pending) {
      pending = window.setTimeout(() => {
        pending = 0;
        rememberMonitors(nb.node);
      }, 250);
    }
  });
  observer.observe(nb.node, { childList: true, subtree: true });
  const onStatus = (_: unknown, status: string) => {
    if (isKernelLoss(status)) {
      const asked = Date.now() - lastRestartCommand < RESTART_WINDOW_MS;
      const loss = status === 'restarting' && !asked ? 'autorestarting' : status;
      void markKernelLoss(nb.node, loss, api.getJob).catch(e => console.warn('tfdist: kernel banner', e));
    }
  };
  nb.sessionContext.statusChanged.connect(onStatus);
  nb.disposed.connect(() => {
    observer.disconnect();
    window.clearTimeout(pending);
    nb.sessionContext.statusChanged.disconnect(onStatus);
  });
}

export default plugin;
