/**
 * The hub's warnings to this server's user (the GPU-idle culler: "this server will be stopped in N
 * minutes"), shown as a JupyterLab notification. The server extension keeps the latest notice
 * (`tfdist/api/notice`); this polls it and shows it once, with the time left; a withdrawn notice closes it.
 */
import { Notification } from '@jupyterlab/apputils';

import { requestAPI } from './request';

interface INotice {
  message: string;
  cull_at: number | null;
  posted: number;
}

const POLL_MS = 15000;

export function noticeText(n: INotice, now: number = Date.now() / 1000): string {
  if (n.cull_at === null || n.cull_at === undefined) {
    return n.message;
  }
  const left = Math.max(0, Math.round((n.cull_at - now) / 60));
  const when = new Date(n.cull_at * 1000).toLocaleTimeString();
  return `${n.message} (about ${left} min left: at ${when})`;
}

export function watchHubNotice(pollMs: number = POLL_MS): void {
  let shown: { posted: number; id: string } | null = null;
  const check = async () => {
    let notice: INotice | null = null;
    try {
      notice = (await requestAPI<{ notice: INotice | null }>('notice')).notice;
    } catch {
      return; // the server is going away or busy: try again next time
    }
    if (notice && (!shown || shown.posted !== notice.posted)) {
      if (shown) {
        Notification.dismiss(shown.id);
      }
      shown = { posted: notice.posted, id: Notification.warning(noticeText(notice), { autoClose: false }) };
    } else if (!notice && shown) {
      Notification.dismiss(shown.id);
      shown = null;
    }
  };
  void check();
  window.setInterval(() => void check(), pollMs);
}
