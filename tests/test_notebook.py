"""docs/tour.ipynb executes end to end, as a student runs it: nbclient, a Jupyter kernel of this venv's
python (ipykernel), every cell in order; it draws its pictures (the synchronous loop; the system a step at a
time, the staleness of each trained sample; the timeline of one step, the engine's requests in it) and prints
what a run at async ratio 0 with a slow env dropped and aborted as stale."""

import base64
import json
import re
import sys
from pathlib import Path

import nbclient
import nbformat

ROOT = Path(__file__).resolve().parent.parent


def test_the_tour_notebook_runs_and_draws(tmp_path, tiny_model_dir, monkeypatch):
    # a kernel spec of this very python (JUPYTER_PATH is searched first): not whatever "python3" a user has
    spec = tmp_path / "jupyter" / "kernels" / "tour-venv"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "the venv", "language": "python"}))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    monkeypatch.setenv("TOUR_OUT", str(tmp_path / "runs"))
    nb = nbformat.read(ROOT / "docs" / "tour.ipynb", as_version=4)
    nbclient.NotebookClient(nb, timeout=300, kernel_name="tour-venv",
                            resources={"metadata": {"path": str(ROOT / "docs")}}).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    images = [base64.b64decode(o["data"]["image/png"]) for o in outputs if "image/png" in o.get("data", {})]
    text = "".join(o.get("text", "") for o in outputs)
    assert len(images) >= 3 and all(i.startswith(b"\x89PNG") for i in images), f"{len(images)} pictures"
    assert "done: 8 steps" in text and "trained version 0: 16 groups x 8 samples" in text, text[-3000:]
    assert re.search(r"engine idle \d+%", text), text[-3000:]        # the timeline has the engine's row
    dropped = re.search(r"dropped as stale at the assembler, per step: \[([\d, ]+)\]", text)
    aborted = re.search(r"aborted as stale by the rollout rank: (\d+)", text)
    assert dropped and aborted, text[-3000:]
    assert sum(map(int, dropped[1].split(", "))) + int(aborted[1]) > 0, "nothing went stale at async ratio 0"
