"""docs/guide.md runs as written: its python blocks, in order, in one namespace, in a fresh
folder (the guide promises a reader exactly that)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "guide.md"


@pytest.mark.slow
def test_every_block_of_the_guide_runs_in_order(tmp_path, monkeypatch):
    for module in ("torch", "onnxscript", "onnxruntime", "optax"):
        pytest.importorskip(module)
    blocks = re.findall(r"```python\n(.*?)```", GUIDE.read_text(), flags=re.S)
    assert len(blocks) >= 6
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    for number, block in enumerate(blocks, 1):
        exec(compile(block, f"{GUIDE.name}, python block {number}", "exec"), namespace)
    # What the guide shows must also be what it claims: the served model learned the task.
    assert namespace["history"]["val_accuracy"][-1] > 0.9
    assert (namespace["logits"].argmax(axis=1) == namespace["y_val"]).mean() > 0.9
