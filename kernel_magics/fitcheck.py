"""Mistakes in a cell's `X.fit(...)` that can be seen before anything starts: a fit given no data, and a
model that was never compiled. Both would otherwise surface only in the job's coordinator (or the plan's
probe) after TensorFlow has been imported there: tens of seconds later, as a TensorFlow error.

Only what the cell's text and the notebook's objects show for certain is refused: a receiver the cell
rebinds or compiles itself, or that is not a plain notebook name, is left to the run.
"""

from __future__ import annotations

import ast
from typing import Any

from .. import payload
from ..errors import TfdistError


def fit_calls(tree: ast.AST) -> list[ast.Call]:
    return [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "fit"
    ]


def _given_data(call: ast.Call) -> bool:
    # a positional argument, x=..., or **kwargs / *args (which may hold either)
    return bool(call.args) or any(k.arg in (None, "x") for k in call.keywords)


def _compiled_in_cell(tree: ast.AST, name: str) -> bool:
    return any(
        isinstance(c.func, ast.Attribute) and c.func.attr == "compile" and ast.unparse(c.func.value) == name
        for c in ast.walk(tree)
        if isinstance(c, ast.Call)
    )


def check_fits(source: str, user_ns: dict[str, Any], binds: list[str]) -> None:
    """Refuse, in one sentence, a fit the run could only fail; `binds` are the names the cell binds."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return  # the caller reports syntax errors with the cell's line numbers
    for call in fit_calls(tree):
        receiver = ast.unparse(call.func.value)  # type: ignore[attr-defined]
        if not _given_data(call):
            raise TfdistError(
                f"the cell's fit is given no data: pass the training data first, e.g. "
                f"{receiver}.fit(train_ds, epochs=5); nothing was started"
            )
        check_compiled(receiver, user_ns, tree, binds)


def check_compiled(
    name: str, user_ns: dict[str, Any], tree: ast.AST | None = None, binds: list[str] | tuple[()] = ()
) -> None:
    """A notebook model that was never compiled has no optimizer or loss to train with."""
    if name in binds or name not in user_ns or (tree is not None and _compiled_in_cell(tree, name)):
        return
    model = user_ns[name]
    if payload._is_keras_model(model) and getattr(model, "optimizer", None) is None:
        raise TfdistError(
            f"{name!r} is not compiled, so it has no optimizer or loss to train with: run "
            f"{name}.compile(optimizer=..., loss=...) in the notebook first; nothing was started"
        )
