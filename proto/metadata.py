"""The metadata_props keys onnxtrain writes into models (one place, so every layer reads them
alike), and the LoRA adapter record kept under one of them."""

from __future__ import annotations

import json

from onnxtrain.errors import ModelLoadError
from onnxtrain.proto.onnx_pb2 import ModelProto, StringStringEntryProto

# The PRNG key an export records, so Trainer(path) resumes the random stream.
KEY_METADATA = "onnxtrain.prng_key"
# make_training_model's description of each recipe's loss and prediction (see _recipe/evaluation.py).
EVALUATION_KEY = "onnxtrain.evaluation"
# The LoRA adapters a model carries (see _recipe/lora.py, insert), and the record's format.
ADAPTERS_KEY = "onnxtrain.adapters"
FORMAT = 1


def set_record(model: ModelProto, record: dict | None) -> None:
    """Put the adapter record `record` into `model`'s metadata (None removes it)."""
    kept = [entry for entry in model.metadata_props if entry.key != ADAPTERS_KEY]
    del model.metadata_props[:]
    model.metadata_props.extend(kept)
    if record is not None:
        model.metadata_props.append(StringStringEntryProto(key=ADAPTERS_KEY, value=json.dumps(record)))


def read_record(model: ModelProto) -> dict | None:
    """The adapter record a model carries (see _recipe/lora.py, insert), or None.

    Raises:
        ModelLoadError: the record is malformed.
    """
    for entry in model.metadata_props:
        if entry.key == ADAPTERS_KEY:
            try:
                record = json.loads(entry.value)
                if record.get("format") != FORMAT or not isinstance(record.get("weights"), dict):
                    raise ValueError(f"format {record.get('format')!r}, expected {FORMAT}")
                return record
            except (ValueError, AttributeError) as error:
                raise ModelLoadError(f"metadata {ADAPTERS_KEY!r} is malformed ({error}); it must be written "
                                     "by onnxtrain's LoRA") from None
    return None
