"""The example notebook, run by a real kernel through nbclient, trains on a real PS/worker cluster."""

from __future__ import annotations

import os
import re
import shutil

import nbformat
import pytest
from nbclient import NotebookClient

from tests.kernels import job_processes, kernel_env

pytestmark = pytest.mark.slow


def test_example_notebook_trains_and_returns_weights(examples_dir, tmp_path):
    nb_path = tmp_path / "digits.ipynb"
    shutil.copy(os.path.join(examples_dir, "digits.ipynb"), nb_path)
    nb = nbformat.read(nb_path, as_version=4)
    state = tmp_path / "state"
    os.environ.update({k: v for k, v in kernel_env(str(state)).items() if k.startswith("TF")})
    client = NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()

    run_cell = next(c for c in nb.cells if c.source.startswith("%%tfdist run"))
    mimes = [m for o in run_cell.outputs for m in o.get("data", {})]
    # the live monitor's output was replaced by the run's picture: one chart in the saved notebook (as
    # JupyterLab saves it), not two, and no widget view that would show as an error without the kernel
    assert "application/vnd.jupyter.widget-view+json" not in mimes
    assert mimes.count("image/png") == 1
    (picture,) = [o for o in run_cell.outputs if "image/png" in o.get("data", {})]
    assert picture["output_type"] == "display_data"
    assert re.search(r"tfdist-\w+: succeeded", picture["data"]["text/plain"]), picture["data"]["text/plain"]
    text = "".join(o.get("text", "") for o in run_cell.outputs if o.output_type == "stream")
    assert "succeeded; weights of model updated; set history, final_loss" in text

    check = "".join(o.get("text", "") for o in nb.cells[4].outputs)
    m = re.search(
        r"weights changed: (\w+); test accuracy ([0-9.]+) -> ([0-9.]+); loss by epoch: \[(.*)\]", check
    )
    assert m, check
    assert m.group(1) == "True"
    before, after = float(m.group(2)), float(m.group(3))
    assert after > 0.85 and after > before + 0.5, check
    losses = [float(v) for v in m.group(4).split(",")]
    assert losses[-1] < losses[0] / 2

    listing = "".join(o.get("text", "") for o in nb.cells[5].outputs)  # %tfdist list, after the job ended
    assert re.search(r"tfdist-\w+ +local +succeeded +4/4 +8/8 +finished", listing), listing

    # the widget state saved with the notebook holds the monitor (a VBox with the job header)
    widgets = nb.metadata.get("widgets", {}).get("application/vnd.jupyter.widget-state+json", {})
    states = widgets.get("state", {})
    assert any("tfdist job" in str(s.get("state", {}).get("value", "")) for s in states.values())
    assert not job_processes()
