"""Run by test_program_limit.py in a fresh process: train a small model on many batch sizes
and print, as one JSON line, the compilations, the programs kept, the warnings and the
resident memory before and after.

    python program_limit_worker.py MAX_PROGRAMS SIZES
"""

from __future__ import annotations

import gc
import json
import logging
import sys

import numpy as np
import psutil

import onnxtrain
from support.training_models import linreg_model, linreg_oracle

MIB = 2**20
WARMUP = 50


class Counter(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.count += "max_programs" in record.getMessage()


def batch(size: int) -> dict[str, np.ndarray]:
    x = np.linspace(-1, 1, size, dtype=np.float32).reshape(size, 1)
    return {"X": x, "Y": 2 * x + 1}


def rss() -> int:
    gc.collect()
    return psutil.Process().memory_info().rss


def main(max_programs: int, count: int) -> None:
    warnings = Counter()
    logging.getLogger("onnxtrain").addHandler(warnings)
    trainer = onnxtrain.Trainer(linreg_model(), max_programs=max_programs)
    batches = [batch(size) for size in range(1, count + 1)]
    start = rss()
    for number, feeds in enumerate(batches, 1):
        trainer.step(feeds)
        if number == WARMUP:
            warm = rss()
    end = rss()
    _, states = linreg_oracle("adagrad", batches)
    exact = bool(np.allclose(np.asarray(trainer.state["W"]), states[-1]["W"], rtol=1e-4))
    print(json.dumps({"max_programs": max_programs, "sizes": count, "compilations": trainer.compilations,
                      "kept": trainer.programs_kept, "warnings": warnings.count, "exact": exact,
                      "rss_start_mib": round(start / MIB, 1), "rss_warm_mib": round(warm / MIB, 1),
                      "rss_end_mib": round(end / MIB, 1),
                      "growth_after_warmup_mib": round((end - warm) / MIB, 1),
                      "growth_mib": round((end - start) / MIB, 1)}))


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
