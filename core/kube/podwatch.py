"""Following a job's pods: list, then watch from the list's resourceVersion, as task / state / log events
(tfdist.job.events records). Reads only; resumes after API server restarts, relists on 410,
follows bookmarks. This module is the protocol only: what the pods mean (task states, replacements, the
job's verdict: its outcome, "deleted in the cluster", or not running within --timeout) is
tfdist.kube.podfold's."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from ..job.events import Event, StateEvent
from .cluster import KubeApi
from .podfold import PodFold, timed_out

WATCH_TIMEOUT_S = 300  # server-side watch timeout; the loop re-opens it from the last resourceVersion


def pod_stream(w: Any, core: Any, ns: str, selector: str, rv: str | None) -> Any:
    """A pod watch from resourceVersion `rv` (bookmarks on, raw JSON objects), closed by the server after
    WATCH_TIMEOUT_S: the callers re-open it from the last version they saw."""
    return w.stream(
        core.list_namespaced_pod,
        ns,
        label_selector=selector,
        resource_version=rv,
        timeout_seconds=WATCH_TIMEOUT_S,
        allow_watch_bookmarks=True,
        _preload_content=False,
    )


@dataclasses.dataclass
class PodWatch:
    kube: KubeApi
    namespace: str
    name: str  # the job
    selector: str
    ours: Callable[[dict[str, Any]], bool]  # a pod of a Job this backend created (not one merely labelled)
    expected: int  # tasks
    deadline: float  # wall time by which every task must run (--timeout)
    timeout_s: float
    # --timeout is the user's word: the backend deletes the job then (None: a job seen read-only)
    on_timeout: Callable[[], Awaitable[Any]] | None = None
    strategy: str = "ps"  # all-reduce: a failed worker ends the job (tfdist.kube.status.outcome)

    async def _root_gone(self) -> bool:
        return await self.kube.read_job(self.name, self.namespace) is None

    async def events(self) -> AsyncIterator[Event]:
        """List, then watch from the list's resourceVersion; what the pods mean is the fold's."""
        from kubernetes_asyncio import watch
        from kubernetes_asyncio.client.exceptions import ApiException

        core = await self.kube.core()
        fold = PodFold(self.expected, self.strategy)
        rv: str | None = None
        while True:
            if rv is None:  # (re)list: the current state, and where the watch resumes from
                try:
                    body = await self.kube.list_pods(self.namespace, self.selector)
                except asyncio.CancelledError:
                    raise
                except Exception:  # API server away (restarting): retry until --timeout, forever once running
                    if not fold.started_all and time.time() > self.deadline:
                        raise
                    await asyncio.sleep(1)
                    continue
                pods = [p for p in body["items"] if self.ours(p)]
                for ev in fold.listed(pods):
                    yield ev
                rv = body["metadata"]["resourceVersion"]
                done = fold.verdict()
                if done is None and not any(map(fold.relevant, pods)) and await self._root_gone():
                    done = fold.gone(listed=True)
                if done:  # it ended while nobody watched
                    yield done
                    return
                for ev in fold.running():
                    yield ev
            w = watch.Watch()
            limit = (
                WATCH_TIMEOUT_S
                if fold.started_all
                else max(1.0, min(WATCH_TIMEOUT_S, self.deadline - time.time() + 1))
            )
            try:
                async with asyncio.timeout(limit):
                    async for item in pod_stream(w, core, self.namespace, self.selector, rv):
                        obj = item["raw_object"]
                        rv = obj["metadata"].get("resourceVersion", rv)
                        if item["type"] == "BOOKMARK" or not fold.relevant(obj) or not self.ours(obj):
                            continue  # bookmarks, and pods someone else labelled as this job's
                        for ev in fold.changed(item["type"], obj):
                            yield ev
                        if item["type"] == "DELETED" and fold.empty and await self._root_gone():
                            # every pod and the root gone while running: deleted by someone else, or with
                            # the notebook pod that owned it (the agent's stream would only time out)
                            yield fold.gone(listed=False)
                            return
                        done = fold.verdict()
                        if done:
                            yield done
                            return
                        for ev in fold.running():
                            yield ev
                        if not fold.started_all and time.time() > self.deadline:
                            break
            except TimeoutError:
                pass
            except ApiException as exc:
                if exc.status == 410:  # too old: relist
                    rv = None
                    continue
                await asyncio.sleep(1)
            except asyncio.CancelledError:
                raise
            except Exception:  # connection dropped, API server restarting: resume from rv when it is back
                await asyncio.sleep(1)
            finally:
                w.stop()
            if not fold.started_all and time.time() > self.deadline:
                yield await self._not_running(fold)
                return

    async def _not_running(self, fold: PodFold) -> StateEvent:
        reasons = fold.not_running()
        if len(fold.tasks) < self.expected:
            names = (self.name, f"{self.name}-worker", f"{self.name}-ps")
            reasons = "; ".join(
                filter(None, [reasons, await self.kube.creation_problems(self.namespace, names)])
            )
        if self.on_timeout is not None:
            await self.on_timeout()
        return timed_out(self.timeout_s, reasons)
