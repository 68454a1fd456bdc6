"""What a `%%tfdist run` cell must pass before anything starts: TensorFlow here, valid syntax, every name it
reads defined, options that make a valid job, and a job that fits this server's memory.

Why a module of its own: all of it is input checking, done before the backend is touched, and each refusal
is one sentence that ends with "nothing was started". `TfdistMagics` mixes it in.
"""

from __future__ import annotations

import dataclasses
import secrets
from typing import TYPE_CHECKING, Any

from IPython.core.error import UsageError

from .. import memfit, payload
from ..backends.base import Backend
from ..errors import TfdistError
from ..gpus import visible_gpus
from ..jobspec import JobSpec, default_ps, parse_memory, validate
from ..settings import Settings
from . import args as margs
from .fitcheck import check_fits

# The shell's own names: never shipped (a user's `_data` is, though)
SHELL_NAMES = frozenset({"get_ipython", "exit", "quit", "In", "Out", "_ih", "_oh", "_dh"})


def _require_tensorflow() -> None:
    try:
        import tensorflow  # noqa: F401
        import tf_keras  # noqa: F401
    except ImportError as exc:
        import sys

        raise TfdistError(
            f"%%tfdist needs TensorFlow and tf_keras in this kernel's environment ({sys.executable}), "
            f"but importing them failed: {exc}.\nInstall them with: "
            f"{sys.executable} -m pip install 'jupyter-tfdist[kernel]'"
        ) from None


def _gpu_ids() -> list[str]:
    return [g.cuda_id for g in visible_gpus()]  # indices; MIG instances by UUID


class CellCheck:
    """The checks of `TfdistMagics.prepare`; needs the magic's `shell`, `settings` and `backend`."""

    shell: Any
    settings: Settings

    if TYPE_CHECKING:

        def backend(self, name: str) -> Backend: ...

    def prepare(self, argv: list[str], cell: str) -> tuple[JobSpec, bytes, list[str]]:
        """Everything that can go wrong with the input, checked before anything starts."""
        opts = margs.run_parser(self.settings).parse_args(argv)
        _require_tensorflow()
        if not cell.strip():
            raise UsageError(
                "the %%tfdist run cell is empty: put the training code in it, e.g. "
                "history = model.fit(train_ds, epochs=5)"
            )
        source = self.shell.transform_cell(cell)
        if "get_ipython()" in source:
            raise UsageError(
                "IPython magics and shell escapes (%, !) cannot run on the job's coordinator: "
                "move them to another cell"
            )
        try:
            names = payload.cell_names(source)
        except SyntaxError as exc:
            line = (exc.lineno or 0) + 1  # + the %%tfdist line
            raise TfdistError(
                f"SyntaxError in the cell, line {line}: {exc.msg}\n    {(exc.text or '').rstrip()}\n"
                "nothing was started"
            ) from None
        undefined = payload.undefined_names(names, self.shell.user_ns)
        if undefined:
            raise TfdistError(
                f"name {undefined[0]!r} is used in the cell but not defined in the notebook"
                + (f" (nor {', '.join(map(repr, undefined[1:]))})" if len(undefined) > 1 else "")
                + ": run the cell that defines it first; nothing was started"
            )
        check_fits(source, self.shell.user_ns, names.binds)
        gpus = _gpu_ids() if opts.backend == "local" else []
        name = opts.name or f"tfdist-{secrets.token_hex(3)}"
        spec = JobSpec(
            name=name,
            user=self.settings.user,
            workers=opts.workers,
            ps=default_ps(opts.strategy, opts.ps),
            strategy=opts.strategy,
            checkpoint_every=opts.checkpoint_every,
            gpus_per_worker=opts.gpus_per_worker,
            cpu=opts.cpu,
            memory_bytes=parse_memory(opts.memory) if opts.memory is not None else None,
            backend=opts.backend,
            timeout_s=opts.timeout,
            base_port=opts.base_port,
            namespace=self.settings.namespace,
            image=self.settings.worker_image,
            detach=bool(opts.detach),
        )
        validate(spec, len(gpus) if opts.backend == "local" else None)
        if spec.backend == "local":
            self._check_memory(spec)
        reads = [n for n in names.reads if n in self.shell.user_ns and n not in SHELL_NAMES]
        blob = payload.pack(source, reads, self.shell.user_ns, line_offset=1)
        return spec, blob, gpus

    def _check_memory(self, spec: JobSpec) -> None:
        """Local tasks share this server's memory limit with the kernel: refuse a job that cannot fit."""
        budget = memfit.server_budget(memfit.server_pid())
        if budget is None:
            return
        if spec.memory_bytes and spec.memory_bytes > budget.limit:
            raise TfdistError(
                f"--memory {spec.memory_bytes / memfit.GiB:.1f} GiB per task is more than this server's "
                f"whole memory limit ({budget.limit / memfit.GiB:.1f} GiB), which the kernel and every task "
                "share: give each task less, or start your server with more memory; nothing was started"
            )
        # this kernel's idle warm pool is free memory: the job takes its processes over, or it is dropped
        local = self.backend("local")
        pooled = local.idle_bytes()
        budget = dataclasses.replace(budget, used=max(0, budget.used - pooled))
        workers = spec.workers - 1 if spec.strategy == "allreduce" else spec.workers  # chief-0 is one
        why = memfit.refusal(workers, spec.ps, budget, memfit.load_footprint(self.settings.state_dir))
        if why:
            if pooled:
                local.release_idle()
            raise TfdistError(why)
