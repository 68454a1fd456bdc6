/**
 * The left-side "Distributed jobs" panel and the GPU status-bar item, as Lumino widgets over JobsModel.
 */
import { Dialog, showDialog, showErrorMessage } from '@jupyterlab/apputils';
import { Poll } from '@lumino/polling';
import { Widget } from '@lumino/widgets';

import { IGpuStatus, IJobsApi, JobsModel, gpuSeries, statusText } from './model';
import { renderJobDetail, renderJobList, sparkline } from './render';

export class JobsPanel extends Widget {
  readonly model: JobsModel;
  private _list: HTMLElement;
  private _detail: HTMLElement;
  private _error: HTMLElement;
  private _poll: Poll;

  constructor(api: IJobsApi, interval = 1000) {
    super();
    this.id = 'tfdist-jobs';
    this.addClass('tfdist-panel');
    this.title.caption = 'Distributed jobs';
    const head = document.createElement('h2');
    head.className = 'tfdist-title';
    head.textContent = 'Distributed jobs';
    this._error = document.createElement('div');
    this._error.className = 'tfdist-error';
    this._list = document.createElement('div');
    this._detail = document.createElement('div');
    this._detail.className = 'tfdist-detail';
    this.node.append(head, this._error, this._list, this._detail);
    this.model = new JobsModel(api);
    this.model.onChange(() => this.render());
    this._poll = this.model.startPolling(interval);
    this.render();
  }

  render(): void {
    const m = this.model;
    this._error.textContent = m.error ? `Cannot reach the server: ${m.error}` : '';
    this._list.hidden = m.selected !== null;
    renderJobList(this._list, m.jobs, m.history, m.selected, name => {
      m.select(name);
      void this._poll.refresh();
    });
    renderJobDetail(
      this._detail,
      m.detail,
      m.selected,
      m.selected !== null && m.stopping.has(m.selected),
      name => void this.confirmStop(name),
      () => m.select(null)
    );
  }

  async confirmStop(name: string): Promise<void> {
    const body = document.createElement('div');
    body.textContent = `Stop job "${name}" and end all its processes?`;
    const result = await showDialog({
      title: 'Stop distributed job',
      body: new Widget({ node: body }),
      buttons: [Dialog.cancelButton(), Dialog.warnButton({ label: 'Stop' })]
    });
    if (!result.button.accept) {
      return;
    }
    try {
      await this.model.stop(name);
    } catch (e) {
      await showErrorMessage('Could not stop the job', String((e as Error)?.message ?? e));
    }
  }

  dispose(): void {
    this._poll.dispose();
    super.dispose();
  }
}

/** This server's GPU count and live utilization (CPU when there is none), polled at 1 Hz. */
export class GpuStatusItem extends Widget {
  status: IGpuStatus | null = null;
  private _text: HTMLElement;
  private _spark: HTMLElement;
  private _poll: Poll;

  constructor(api: IJobsApi, interval = 1000) {
    super();
    this.addClass('tfdist-status');
    this._text = document.createElement('span');
    this._spark = document.createElement('span');
    this.node.append(this._text, this._spark);
    this._poll = new Poll({
      auto: true,
      factory: async () => {
        this.status = await api.getGpus();
        this.render();
      },
      frequency: { interval, backoff: true, max: 30 * 1000 },
      name: 'tfdist:gpus',
      standby: 'when-hidden'
    });
    this.render();
  }

  render(): void {
    const s = this.status;
    this._text.textContent = statusText(s);
    this._spark.replaceChildren();
    if (s) {
      const series = gpuSeries(s);
      if (series.length || s.gpu_count === 0 || !s.samples.length) {
        this._spark.appendChild(sparkline(document, series.slice(-60), 40, 14));
      } else {
        // GPUs that report no utilization (MIG slices): say so rather than draw them idle
        this._spark.textContent = ' n/a';
      }
      this.node.title = s.gpu_count > 0 ? s.gpus.map(g => `GPU ${g.index}: ${g.name}`).join('\n') : `${s.cpu_count} CPUs`;
    }
  }

  dispose(): void {
    this._poll.dispose();
    super.dispose();
  }
}
