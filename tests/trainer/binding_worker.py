"""One named binding pattern of test_binding_patterns.py, data-parallel on every device.

Started by test_binding_patterns.py under XLA_FLAGS=--xla_force_host_platform_device_count=4
(the pytest process already has one CPU device, and JAX fixes the count when it starts). It
runs the same life cycle and numpy oracle as the one-device tests, on a Trainer given
mesh=jax.make_mesh((4,), ("batch",)), and prints one JSON line:
{"devices": 4, "failure": ""} if it passed, else the failure's text.

    python tests/trainer/binding_worker.py PATTERN NAN_POLICY
"""

from __future__ import annotations

import json
import sys
import tempfile
import traceback
from pathlib import Path

import jax

# Run by path: this folder is on sys.path already; tests/, for the support package, is not.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from test_binding_patterns import NAMED_PATTERNS, exercise  # noqa: E402


def main(name: str, nan_policy: str) -> dict:
    mesh = jax.make_mesh((jax.device_count(),), ("batch",))
    with tempfile.TemporaryDirectory() as workdir:
        try:
            exercise(NAMED_PATTERNS[name], nan_policy, workdir, mesh=mesh)
            failure = ""
        except Exception as error:  # noqa: BLE001  (reported to the test, which judges it)
            failure = "".join(traceback.format_exception_only(error)).strip()[:3000]
    return {"devices": jax.device_count(), "failure": failure}


if __name__ == "__main__":
    print(json.dumps(main(*sys.argv[1:3])))
