"""LoRA adapters written as peft writes them, so that `peft.PeftModel.from_pretrained(model,
folder)` puts them on the torch model the ONNX export came from: `adapter_config.json` and
`adapter_model.safetensors`, each adapter under `base_model.model.<module>.lora_A.weight`
([rank, in], as torch's nn.Linear stores it) and `lora_B.weight` ([out, rank]); for a Conv,
A and B are already in torch's Conv layout. The module paths are those the export recorded
(see lora.module_path).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from onnxtrain._io.files import write_export
from onnxtrain._io.safetensors import write_safetensors
from onnxtrain.errors import ExportError

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


def peft_tensors(record: Mapping, values: Mapping[str, np.ndarray], drop_prefix: str = "") -> dict[str, np.ndarray]:
    """The adapters of a LoRA record (see lora.insert) under peft's names, in torch's layouts.

    Raises:
        ExportError: an adapted weight's module path is unknown, or lacks `drop_prefix`.
    """
    tensors = {}
    for weight, entry in record["weights"].items():
        module = entry.get("module")
        if module is None:
            raise ExportError(f"peft names adapters by the torch module they sit on, and the export does not "
                              f"say which module weight {weight!r} belongs to (torch.onnx's dynamo exporter, "
                              "optimum and onnxruntime-genai's builder record it); write the adapters with "
                              "export(..., merge=False) instead")
        if drop_prefix:
            if not module.startswith(drop_prefix):
                raise ExportError(f"drop_prefix={drop_prefix!r}, but module {module!r} (weight {weight!r}) "
                                  "does not start with it")
            module = module[len(drop_prefix):]
        a, b = values[entry["A"]], values[entry["B"]]
        if entry["kind"] != "Conv":
            a, b = a.T, b.T   # x·A·B as nn.Linear weights: [rank, in] and [out, rank]
        tensors[f"base_model.model.{module}.lora_A.weight"] = np.ascontiguousarray(a)
        tensors[f"base_model.model.{module}.lora_B.weight"] = np.ascontiguousarray(b)
    return tensors


def peft_config(record: Mapping, modules: list[str]) -> dict:
    """adapter_config.json's content: peft's LoraConfig for these adapters on `modules`."""
    return {"peft_type": "LORA", "task_type": None, "base_model_name_or_path": None, "inference_mode": True,
            "r": int(record["rank"]), "lora_alpha": float(record["alpha"]), "lora_dropout": float(record["dropout"]),
            "target_modules": modules, "bias": "none", "fan_in_fan_out": False, "modules_to_save": None,
            "use_rslora": False, "use_dora": False, "init_lora_weights": True}


def write_peft_adapter(folder: str | os.PathLike, record: Mapping, values: Mapping[str, np.ndarray],
                       drop_prefix: str = "") -> None:
    """Write `folder`/adapter_config.json and adapter_model.safetensors (created as needed).

    Raises:
        ExportError: see peft_tensors, or the folder cannot be written.
    """
    tensors = peft_tensors(record, values, drop_prefix)
    modules = sorted({name[len("base_model.model."):-len(".lora_A.weight")] for name in tensors
                      if name.endswith(".lora_A.weight")})
    target = Path(folder)
    try:
        target.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ExportError(f"cannot write the adapter into {target}: {error.strerror or error}") from None
    encoded = json.dumps(peft_config(record, modules), indent=2).encode()
    write_export(target / CONFIG, lambda file: file.write(encoded))
    write_safetensors(target / WEIGHTS, tensors, {"format": "pt"})
