"""The step model's manifest: which inputs are feeds, which output feeds which state input.

It is stored as JSON in the step model's metadata_props under MANIFEST_KEY, which ONNX
Runtime's Python API exposes as custom metadata (examples/portable_node.mjs reads it from the
file: onnxruntime-node does not expose it).

Example of the JSON:
    {"format": "onnxtrain.step", "version": 1, "feeds": ["x", "labels"],
     "state": [["W", "W.new"], ["step", "step.new"]], "settings": ["learning_rate"],
     "outputs": ["loss"], "loss": "loss",
     "initial": {"W": "W.initial", "step": "step.initial", "learning_rate": "learning_rate.initial"}}
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from onnxtrain.errors import ModelLoadError

MANIFEST_KEY = "onnxtrain.step"
VERSION = 1


@dataclass(frozen=True)
class StepManifest:
    """The bindings of a step model.

    Attributes:
        feeds: the inputs a caller gives every step (data, labels).
        state: (input, output) pairs: the output's value is the input's value next step.
        settings: inputs no output updates (a learning rate): fed their initial value, or
            another to change them.
        outputs: the other outputs (the loss...).
        loss: the output holding the loss, if the recipe names one.
        initial: state and settings input -> the initializer holding its value before the
            first step.
    """

    feeds: list[str]
    state: list[tuple[str, str]]
    settings: list[str] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)
    loss: str | None = None
    initial: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps({"format": MANIFEST_KEY, "version": VERSION, "feeds": list(self.feeds),
                           "state": [list(pair) for pair in self.state], "settings": list(self.settings),
                           "outputs": list(self.outputs), "loss": self.loss,
                           "initial": dict(self.initial)})

    @classmethod
    def from_json(cls, text: str) -> StepManifest:
        """Parse a manifest.

        Raises:
            ModelLoadError: the text is not a manifest of a version this onnxtrain reads.
        """
        try:
            data = json.loads(text)
            if data.get("format") != MANIFEST_KEY or data.get("version") != VERSION:
                raise ValueError(f"format {data.get('format')!r} version {data.get('version')!r}")
            return cls(feeds=list(data["feeds"]), state=[(str(a), str(b)) for a, b in data["state"]],
                       settings=list(data.get("settings", [])), outputs=list(data.get("outputs", [])),
                       loss=data.get("loss"), initial=dict(data.get("initial", {})))
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            raise ModelLoadError(f"metadata_props[{MANIFEST_KEY!r}] is not a step manifest onnxtrain "
                                 f"reads ({error}); export the step model again with this onnxtrain") from None

    def describe(self) -> list[str]:
        """Lines for `onnxtrain inspect`."""
        return ["step model (feed the state outputs back as inputs each step):",
                f"  feeds: {', '.join(self.feeds) or '-'}",
                f"  outputs: {', '.join(self.outputs) or '-'} (loss: {self.loss or '-'})",
                f"  settings (inputs with defaults): {', '.join(self.settings) or '-'}",
                f"  state: {len(self.state)} variables, input <- output (initial value):",
                *(f"    {a} <- {b} ({self.initial.get(a, '-')})" for a, b in self.state)]
