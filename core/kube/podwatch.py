"""Following a job's pods: list, then watch from the list's resourceVersion, as task / state / log events
(tfdist.events records, sent as wire dicts; tfdist.kube.status derives them). Reads only; resumes after API
server restarts, relists on 410, and ends with the job's verdict: its outcome, "deleted in the cluster",
or not running within --timeout."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from ..events import ErrorInfo, EventError, LogEvent, StateEvent, TaskEvent, to_wire
from . import status as st
from .cluster import KubeApi

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

    async def events(self) -> AsyncIterator[dict[str, Any]]:
        from kubernetes_asyncio import watch
        from kubernetes_asyncio.client.exceptions import ApiException

        core = await self.kube.core()
        tasks: st.TaskStates = {}
        started_all = False
        current: dict[str, str] = {}  # task -> name of its newest pod
        restarts: dict[str, int] = {}
        rv: str | None = None

        def replaced(task: str, pod_name: str) -> list[dict[str, Any]]:
            """The Job controller replaced a task's pod: say so once per replacement."""
            old = current.get(task)
            current[task] = pod_name
            if old is None or old == pod_name:
                return []
            n = restarts[task] = restarts.get(task, 0) + 1
            try:
                return [
                    to_wire(TaskEvent(task=task, state="restarting", restarts=n)),
                    to_wire(LogEvent(lines=((task, f"tfdist: {task} pod replaced by the cluster ({n})"),))),
                ]
            except EventError:  # a pod labelled with no task name of ours: nothing to say about it
                return []

        def running() -> list[dict[str, Any]]:
            nonlocal started_all
            if not started_all and st.servers_running(tasks, self.expected):
                started_all = True
                return [to_wire(StateEvent(state="running", message="all tasks running"))]
            return []

        while True:
            if rv is None:  # (re)list: the current state, and where the watch resumes from
                try:
                    body = await self.kube.list_pods(self.namespace, self.selector)
                except asyncio.CancelledError:
                    raise
                except Exception:  # API server away (restarting): retry until --timeout, forever once running
                    if not started_all and time.time() > self.deadline:
                        raise
                    await asyncio.sleep(1)
                    continue
                pods = st.newest_per_task([p for p in body["items"] if self.ours(p)])
                for p in pods:
                    for ev in replaced(st.pod_task(p) or "", p["metadata"]["name"]):
                        yield ev
                rv = body["metadata"]["resourceVersion"]
                for ev in st.task_events(pods, tasks):
                    yield ev
                done = st.outcome(tasks, self.strategy)
                if done is None and not pods and await self._root_gone():
                    done = to_wire(StateEvent(state="stopped", message="no objects left", t=time.time()))
                if done:  # it ended while nobody watched
                    yield done
                    return
                for ev in running():
                    yield ev
            w = watch.Watch()
            limit = (
                WATCH_TIMEOUT_S
                if started_all
                else max(1.0, min(WATCH_TIMEOUT_S, self.deadline - time.time() + 1))
            )
            try:
                async with asyncio.timeout(limit):
                    async for item in pod_stream(w, core, self.namespace, self.selector, rv):
                        obj = item["raw_object"]
                        rv = obj["metadata"].get("resourceVersion", rv)
                        task = st.pod_task(obj)
                        if item["type"] == "BOOKMARK" or not task or not self.ours(obj):
                            continue  # bookmarks, and pods someone else labelled as this job's
                        pod_name = obj["metadata"]["name"]
                        if item["type"] == "ADDED":
                            for ev in replaced(task, pod_name):
                                yield ev
                        if current.get(task, pod_name) == pod_name:
                            if item["type"] == "DELETED":
                                tasks.pop(task, None)
                            for ev in st.task_events([obj] if item["type"] != "DELETED" else [], tasks):
                                yield ev
                        if item["type"] == "DELETED" and not tasks and await self._root_gone():
                            # every pod and the root gone while running: deleted by someone else, or with
                            # the notebook pod that owned it (the agent's stream would only time out)
                            yield to_wire(
                                StateEvent(
                                    state="stopped",
                                    message="the job was deleted in the cluster (with its notebook server, "
                                    "or by someone else); nothing of it is left",
                                    t=time.time(),
                                )
                            )
                            return
                        done = st.outcome(tasks, self.strategy)
                        if done:
                            yield done
                            return
                        for ev in running():
                            yield ev
                        if not started_all and time.time() > self.deadline:
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
            if not started_all and time.time() > self.deadline:
                yield await self._not_running(tasks)
                return

    async def _not_running(self, tasks: st.TaskStates) -> dict[str, Any]:
        reasons = "; ".join(f"{t}: {m}" for t, (s, m) in sorted(tasks.items()) if s != "running" and m)
        if len(tasks) < self.expected:
            names = (self.name, f"{self.name}-worker", f"{self.name}-ps")
            reasons = "; ".join(
                filter(None, [reasons, await self.kube.creation_problems(self.namespace, names)])
            )
        if self.on_timeout is not None:
            await self.on_timeout()
        return to_wire(
            StateEvent(
                state="failed",
                t=time.time(),
                message=f"not running within --timeout {self.timeout_s:g}s; deleted. {reasons}".strip(),
                error=ErrorInfo(type="Unschedulable", message=reasons),
            )
        )
