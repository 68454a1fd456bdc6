"""`tfdist-local-hub` starts without the optional slow import (rfc3987_syntax), and what it skips is only a
string format check: the event schemas JupyterHub validates still load and validate."""

from __future__ import annotations

import subprocess
import sys

CODE = """
import sys, time
from tfdist.spawner.localhub import _skip_slow_optional_imports
_skip_slow_optional_imports()
t = time.monotonic()
import jupyterhub.app  # noqa: F401  (what main() imports next)
import jsonschema
took = time.monotonic() - t
assert sys.modules.get("rfc3987_syntax") is None
checker = jsonschema.Draft202012Validator.FORMAT_CHECKER
assert "iri" not in checker.checkers  # the one format that needed it
assert "email" in checker.checkers  # the others are all there
v = jsonschema.Draft202012Validator({"type": "object", "required": ["a"]}, format_checker=checker)
assert not v.is_valid({}) and v.is_valid({"a": 1})
from jupyter_events import EventLogger
EventLogger()
print("ok", round(took, 2))
"""


def test_local_hub_skips_the_slow_optional_import_and_still_validates() -> None:
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("ok")
