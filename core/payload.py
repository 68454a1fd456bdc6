"""Shipping the notebook's state to the coordinator and the results back.

The coordinator cannot be the kernel (connecting a process to a TF cluster invalidates its variables), so
what the cell uses travels as a *bundle*: tf_keras models as `.keras` archives (architecture, weights,
optimizer and compile config), `tf.data` datasets as their serialized graph (the pipeline with its
in-memory tensors; rebuilt with DatasetFromGraph, so `.repeat()`/`.shuffle()`/`.map()` survive), tensors
as numpy, and everything else (numpy, pandas, notebook functions and classes) with cloudpickle.
"""

from __future__ import annotations

import ast
import builtins
import io
import os
import pickle
import symtable
import tempfile
from dataclasses import dataclass, field
from typing import Any

import cloudpickle

from .errors import ShippingError

BUNDLE_VERSION = 1


# ----------------------------------------------------------------------------------------------------- cell
@dataclass(frozen=True)
class CellNames:
    reads: list[str]  # global names the cell (or functions in it) reads, first-use order
    binds: list[str]  # names the cell binds at top level (assignment, import, def, class, for...)


def cell_names(source: str, filename: str = "<tfdist cell>") -> CellNames:
    """Names read and bound at the cell's top level. Raises SyntaxError for a broken cell."""
    top = symtable.symtable(source, filename, "exec")
    reads: list[str] = []
    binds = [s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported()]

    def walk(table: symtable.SymbolTable) -> None:
        for sym in table.get_symbols():
            name = sym.get_name()
            if not sym.is_referenced() or name in reads:
                continue
            if table is top or sym.is_global():
                reads.append(name)
        for child in table.get_children():
            walk(child)

    walk(top)
    reads += [n for n in _augmented_globals(ast.parse(source)) if n not in reads]
    fresh = bound_before_read(source)
    return CellNames(reads=[n for n in reads if n not in fresh], binds=binds)


def _augmented_globals(tree: ast.AST, declared: frozenset[str] | None = None) -> list[str]:
    """Global names updated in place (`n += 1`): read first, which symtable does not mark as a use."""
    out: list[str] = []
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda | ast.ClassDef):
            body_globals = {n for g in ast.walk(node) if isinstance(g, ast.Global) for n in g.names}
            out += _augmented_globals(node, frozenset(body_globals))
            continue
        if isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name):
            if declared is None or node.target.id in declared:
                out.append(node.target.id)
        out += _augmented_globals(node, declared)
    return out


def _names(*nodes: ast.AST | None) -> set[str]:
    return {n.id for node in nodes if node is not None for n in ast.walk(node) if isinstance(n, ast.Name)}


def _plain(target: ast.expr) -> list[ast.expr]:
    return target.elts if isinstance(target, ast.Tuple | ast.List) else [target]


def _binds_and_reads(stmt: ast.stmt) -> tuple[set[str], set[str]]:
    """(names bound whenever the statement completes, names it may read first); anything else a statement
    mentions counts as read: in a condition, a loop or a function body, a bind may not happen."""
    if isinstance(stmt, ast.Import | ast.ImportFrom):
        return {(a.asname or a.name).split(".")[0] for a in stmt.names if a.name != "*"}, set()
    if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return {stmt.name}, _names(stmt)  # its body, decorators, defaults and bases
    if isinstance(stmt, ast.Assign | ast.AnnAssign) and stmt.value is not None:
        targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
        plain = [e for t in targets for e in _plain(t) if isinstance(e, ast.Name)]
        other = [e for t in targets for e in _plain(t) if not isinstance(e, ast.Name)]
        annotation = stmt.annotation if isinstance(stmt, ast.AnnAssign) else None
        return {e.id for e in plain}, _names(stmt.value, annotation, *other)
    return set(), _names(stmt)


def bound_before_read(source: str) -> set[str]:
    """Names the cell binds at top level, unconditionally, before anything in it could read them: the
    notebook's values of these are never seen, so they need not travel (re-running `hist = model.fit(...)`
    or `cb = Clock(); model.fit(..., callbacks=[cb])` would otherwise ship the last run's History or
    callback, each holding a whole copy of the model)."""
    seen: set[str] = set()
    fresh: set[str] = set()
    for stmt in ast.parse(source).body:
        binds, reads = _binds_and_reads(stmt)
        seen |= reads - fresh
        fresh |= binds - seen
    return fresh


def undefined_names(names: CellNames, namespace: dict[str, Any]) -> list[str]:
    """Names the cell reads that neither it, the notebook nor builtins define."""
    return [
        n for n in names.reads if n not in namespace and n not in names.binds and not hasattr(builtins, n)
    ]


# ----------------------------------------------------------------------------------------------- kinds
def _is_keras_model(obj: Any) -> bool:
    mod = type(obj).__module__
    if not (mod.startswith("tf_keras") or mod == "__main__" or mod.startswith("keras")):
        return False
    try:
        import tf_keras
    except ImportError:  # pragma: no cover - tf_keras is a kernel extra
        return False
    return isinstance(obj, tf_keras.Model)


def _is_keras3_model(obj: Any) -> bool:
    return type(obj).__module__.startswith("keras.") and hasattr(obj, "fit") and not _is_keras_model(obj)


def _is_dataset(obj: Any) -> bool:
    mod = type(obj).__module__
    if "tensorflow" not in mod:
        return False
    import tensorflow as tf

    return isinstance(obj, tf.data.Dataset)


def _is_tensor(obj: Any) -> bool:
    mod = type(obj).__module__
    if "tensorflow" not in mod:
        return False
    import tensorflow as tf

    return isinstance(obj, tf.Tensor | tf.Variable)


def _notebook_classes(namespace: dict[str, Any]) -> dict[str, type]:
    """Classes defined in the notebook: custom layers/losses a model archive may name."""
    return {k: v for k, v in namespace.items() if isinstance(v, type) and v.__module__ == "__main__"}


def _save_model(model: Any) -> bytes:
    with tempfile.TemporaryDirectory(prefix="tfdist-") as d:
        path = os.path.join(d, "model.keras")
        model.save(path)
        with open(path, "rb") as f:
            return f.read()


# --------------------------------------------------------------------------------------------- packing
@dataclass
class Bundle:
    """What the coordinator receives. Values are encoded per kind; see `encode`/`decode`."""

    source: str
    line_offset: int
    entries: dict[str, tuple[str, bytes]] = field(default_factory=dict)  # name -> (kind, data)
    custom_objects: bytes = b""
    version: int = BUNDLE_VERSION


def encode(name: str, value: Any, models: dict[str, Any] | None = None) -> tuple[str, bytes]:
    """One variable in its shippable form, or ShippingError naming it and what to do. `models`: the
    bundle's models by name; a pickled value that holds one (a callback given the model, a History)
    holds the coordinator's model after `decode`, not a copy of its own."""
    if _is_keras3_model(value):
        raise ShippingError(
            name,
            "it is a Keras 3 model, and Keras 3 does not support parameter-server training",
            "set os.environ['TF_USE_LEGACY_KERAS'] = '1' before importing TensorFlow "
            "and build it with tf.keras",
        )
    if _is_keras_model(value):
        try:
            return "keras_model", _save_model(value)
        except Exception as exc:
            raise ShippingError(
                name,
                f"the model could not be saved ({type(exc).__name__}: {exc})",
                "custom layers need get_config(); or build the model inside the cell",
            ) from exc
    if _is_dataset(value):
        import tensorflow as tf

        try:
            graph = value._as_serialized_graph(
                external_state_policy=tf.data.experimental.ExternalStatePolicy.FAIL
            ).numpy()
            spec = pickle.dumps(value.element_spec)
        except Exception as exc:
            raise ShippingError(
                name,
                f"this tf.data pipeline cannot be serialized ({type(exc).__name__}: {str(exc)[:200]})",
                "a dataset built with tf.py_function or from a Python generator cannot travel; "
                "build it inside the cell, or from tensors/files with Dataset.from_tensor_slices",
            ) from exc
        return "tf_dataset", pickle.dumps((graph, spec))
    if _is_tensor(value):
        return "tf_tensor", pickle.dumps((type(value).__name__ == "ResourceVariable", value.numpy()))
    try:
        return "pickle", _dumps_refs(value, models or {})
    except Exception as exc:
        raise ShippingError(
            name,
            f"{type(value).__name__} objects cannot be pickled ({type(exc).__name__}: {str(exc)[:200]})",
            "create it inside the %%tfdist cell instead, or pass the data it holds (arrays, paths)",
        ) from exc


def pack(source: str, names: list[str], namespace: dict[str, Any], line_offset: int = 1) -> bytes:
    """Encode the named variables of the notebook into one bundle (bytes)."""
    bundle = Bundle(source=source, line_offset=line_offset)
    present = [n for n in names if n in namespace]
    models = {n: namespace[n] for n in present if _is_keras_model(namespace[n])}
    for name in sorted(present, key=lambda n: n not in models):  # models first: others may refer to them
        bundle.entries[name] = encode(name, namespace[name], models)
    classes = _notebook_classes(namespace)
    if classes:
        try:
            bundle.custom_objects = cloudpickle.dumps(classes)
        except Exception:  # a class that cannot travel only matters if a model names it
            bundle.custom_objects = b""
    return pickle.dumps(bundle, protocol=pickle.HIGHEST_PROTOCOL)


def unpack(data: bytes) -> Bundle:
    bundle = pickle.loads(data)
    if not isinstance(bundle, Bundle) or bundle.version != BUNDLE_VERSION:
        raise ValueError("not a tfdist bundle of this version")
    return bundle


def decode(
    kind: str,
    data: bytes,
    custom_objects: dict[str, type] | None = None,
    decoded: dict[str, Any] | None = None,
) -> Any:
    """Inverse of `encode`, run in the coordinator inside `strategy.scope()` so variables land on the PS;
    `decoded`: the entries decoded so far (the bundle's models come first), for references to them."""
    if kind == "keras_model":
        import tensorflow as tf

        with tempfile.TemporaryDirectory(prefix="tfdist-") as d:
            path = os.path.join(d, "model.keras")
            with open(path, "wb") as f:
                f.write(data)
            return tf.keras.models.load_model(path, custom_objects=custom_objects or None)
    if kind == "tf_dataset":
        import tensorflow as tf
        from tensorflow.python.data.ops import dataset_ops

        graph, spec = pickle.loads(data)
        variant = tf.raw_ops.DatasetFromGraph(graph_def=graph)
        return dataset_ops._VariantDataset(variant, pickle.loads(spec))
    if kind == "tf_tensor":
        import tensorflow as tf

        is_var, value = pickle.loads(data)
        return tf.Variable(value) if is_var else tf.constant(value)
    if kind == "pickle":
        return _loads_refs(data, decoded or {})
    raise ValueError(f"unknown bundle entry kind {kind!r}")


# --------------------------------------------------------------------------------------------- results
@dataclass
class HistoryRecord:
    """A fit's History without its model (which lives on the PS); rebuilt as a real History in the kernel."""

    history: dict[str, list[float]]
    epoch: list[int]
    params: dict[str, Any]
    model_name: str | None


@dataclass
class Results:
    weights: dict[str, list[Any]] = field(default_factory=dict)  # shipped model name -> get_weights()
    values: dict[str, bytes] = field(default_factory=dict)  # cloudpickled new/changed names
    skipped: dict[str, str] = field(default_factory=dict)  # name -> why it did not come back


# A value that references a shipped model (a callback after set_model, a History, a closure over `model`)
# comes back pointing at the notebook's own model object, not a copy: the reference is written as
# (REF_MODEL, name) and resolved in the kernel. Pickling the coordinator's model instead would ship it as a
# `.keras` archive that the kernel's Keras registry may not be able to read (the notebook's custom layers).
# The bundle's pickled values go the same way: on the coordinator they hold the model the job trains.
REF_MODEL = "tfdist-model"
REF_OPTIMIZER = "tfdist-model-optimizer"


class _ModelRefPickler(cloudpickle.Pickler):
    def __init__(self, file: io.BytesIO, models: dict[str, Any]) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._refs: dict[int, tuple[str, str]] = {}
        for name, model in models.items():
            self._refs[id(model)] = (REF_MODEL, name)
            opt = getattr(model, "optimizer", None)
            if opt is not None:
                self._refs.setdefault(id(opt), (REF_OPTIMIZER, name))

    def persistent_id(self, obj: Any) -> tuple[str, str] | None:
        return self._refs.get(id(obj))


class _ModelRefUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, namespace: dict[str, Any]) -> None:
        super().__init__(file)
        self._ns = namespace

    def persistent_load(self, pid: Any) -> Any:
        kind, name = pid if isinstance(pid, tuple) and len(pid) == 2 else (None, None)
        model = self._ns.get(name) if isinstance(name, str) else None
        if kind == REF_MODEL and model is not None:
            return model
        if kind == REF_OPTIMIZER and getattr(model, "optimizer", None) is not None:
            return model.optimizer
        raise pickle.UnpicklingError(f"it refers to the notebook's {name!r}, which is no longer there")


def _dumps_refs(value: Any, models: dict[str, Any]) -> bytes:
    buf = io.BytesIO()
    _ModelRefPickler(buf, models).dump(value)
    return buf.getvalue()


def _loads_refs(blob: bytes, namespace: dict[str, Any]) -> Any:
    return _ModelRefUnpickler(io.BytesIO(blob), namespace).load()


def pack_results(namespace: dict[str, Any], binds: list[str], models: dict[str, Any]) -> bytes:
    """Collect what the cell produced: trained weights of shipped models and the names it bound."""
    import numpy as np

    res = Results()
    model_ids = {id(m): n for n, m in models.items()}
    for name, model in models.items():
        res.weights[name] = [np.asarray(w) for w in model.get_weights()]
    for name in binds:
        if name not in namespace or name in models:
            continue
        value = namespace[name]
        if type(value).__name__ == "History" and hasattr(value, "history"):
            value = HistoryRecord(
                history={k: [float(x) for x in v] for k, v in value.history.items()},
                epoch=list(value.epoch),
                params=dict(getattr(value, "params", {}) or {}),
                model_name=model_ids.get(id(getattr(value, "model", None))),
            )
        elif _is_tensor(value):
            value = value.numpy()
        elif _is_keras_model(value):
            res.skipped[name] = "a model created inside the cell stays on the cluster; save it to a file"
            continue
        elif type(value).__module__ in ("builtins",) and type(value).__name__ == "module":
            continue
        try:
            res.values[name] = _dumps_refs(value, models)
        except Exception as exc:
            res.skipped[name] = f"{type(value).__name__} cannot be pickled ({type(exc).__name__})"
    return pickle.dumps(res, protocol=pickle.HIGHEST_PROTOCOL)


def apply_results(data: bytes, namespace: dict[str, Any]) -> Results:
    """Write the results into the notebook: weights into the existing model objects, names assigned.

    Never raises for one value: a cell that trained must not end in a traceback after its weights were set.
    A value that cannot be rebuilt here is left unassigned and named in `skipped` with the reason."""
    res: Results = pickle.loads(data)
    for name, weights in list(res.weights.items()):
        model = namespace.get(name)
        if model is not None and hasattr(model, "set_weights"):
            try:
                model.set_weights(weights)
            except Exception as exc:  # the notebook rebound `name` to another model meanwhile
                del res.weights[name]
                res.skipped[name] = f"its trained weights do not fit it any more ({_brief(exc)})"
    for name, blob in list(res.values.items()):
        try:
            value = _loads_refs(blob, namespace)
            if isinstance(value, HistoryRecord):
                value = _history(value, namespace)
        except Exception as exc:
            del res.values[name]
            res.skipped[name] = f"it could not be rebuilt in the notebook ({_brief(exc)})"
            continue
        namespace[name] = value
    return res


def _brief(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200]}" if text else type(exc).__name__


def _history(rec: HistoryRecord, namespace: dict[str, Any]) -> Any:
    try:
        import tf_keras

        hist = tf_keras.callbacks.History()
    except ImportError:  # pragma: no cover
        return rec
    hist.history, hist.epoch, hist.params = rec.history, rec.epoch, rec.params
    if rec.model_name and rec.model_name in namespace:
        hist.set_model(namespace[rec.model_name])
    return hist


__all__ = [
    "Bundle",
    "CellNames",
    "HistoryRecord",
    "Results",
    "apply_results",
    "cell_names",
    "decode",
    "encode",
    "pack",
    "pack_results",
    "undefined_names",
    "unpack",
]
