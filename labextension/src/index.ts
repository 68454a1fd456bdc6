/**
 * jupyter-tfdist lab plugin: the "Distributed jobs" side panel and a GPU status-bar item.
 */
import { ILabShell, JupyterFrontEnd, JupyterFrontEndPlugin } from '@jupyterlab/application';
import { IStatusBar } from '@jupyterlab/statusbar';
import { LabIcon } from '@jupyterlab/ui-components';

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
  optional: [ILabShell, IStatusBar],
  activate: (app: JupyterFrontEnd, labShell: ILabShell | null, statusBar: IStatusBar | null) => {
    const panel = new JobsPanel(api);
    panel.title.icon = tfdistIcon;
    app.shell.add(panel, 'left', { rank: 800 });
    if (statusBar) {
      const item = new GpuStatusItem(api);
      statusBar.registerStatusItem('jupyter-tfdist:gpus', { item, align: 'left', rank: 5 });
    }
  }
};

export default plugin;
