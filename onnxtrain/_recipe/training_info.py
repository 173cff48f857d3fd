"""TrainingInfoProto: validation at load, combined graphs, state variables.

No other tool checks training_info (onnx's checker never looks inside it), so
we check every rule of the IR spec's "Training Related Information" here and
report a BindingError naming the TrainingInfoProto, the binding and the rule.
A training step runs on the combined graph: the main graph followed by the
algorithm graph, field by field (inputs, initializers, outputs, nodes,
value_info, sparse initializers), which must itself be a valid graph.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import jax
import numpy as np

from onnxtrain.errors import BindingError
from onnxtrain.proto import GraphProto, ModelProto, StringStringEntryProto, TrainingInfoProto
from onnxtrain.translate.graph import initializer_names, iter_initializers
from onnxtrain.translate.validation import check_graphs


@dataclass(frozen=True)
class StateLayout:
    """The state variables (binding keys, model order) and where each one's initializer lives."""

    names: tuple[str, ...]
    # name -> None for the main graph, or the index of the TrainingInfoProto whose algorithm holds it.
    home: dict[str, int | None]


def _where(index: int, field: str) -> str:
    return f"training_info[{index}].{field}"


def _check_unique_keys(entries: Iterable[StringStringEntryProto], where: str) -> None:
    seen: set[str] = set()
    for entry in entries:
        if entry.key in seen:
            raise BindingError(f"{where}: key {entry.key!r} is bound twice; each state variable "
                               "may appear once per binding list")
        seen.add(entry.key)


def _check_keys(model: ModelProto, index: int, field: str, main_names: set[str]) -> None:
    info = model.training_info[index]
    own = set(initializer_names(info.algorithm))
    for entry in getattr(info, field):
        if entry.key in main_names or entry.key in own:
            continue
        elsewhere = [j for j, other in enumerate(model.training_info)
                     if j != index and entry.key in initializer_names(other.algorithm)]
        hint = (f"; it is an initializer of training_info[{elsewhere[0]}].algorithm, which this "
                "TrainingInfoProto cannot see" if elsewhere else "")
        raise BindingError(
            f"{_where(index, field)}: key {entry.key!r} is not an initializer of the main graph or "
            f"of training_info[{index}].algorithm{hint}. Keys name the state variable to assign; "
            "add an initializer with that name (its value is the starting value).")


def _check_values(info: TrainingInfoProto, index: int, main: GraphProto) -> None:
    if info.initialization_binding and not info.HasField("initialization"):
        raise BindingError(f"{_where(index, 'initialization_binding')} binds "
                           f"{[e.key for e in info.initialization_binding]} but the "
                           "TrainingInfoProto has no initialization graph; add one or drop the binding")
    init_outputs = {o.name for o in info.initialization.output}
    for entry in info.initialization_binding:
        if entry.value not in init_outputs:
            raise BindingError(
                f"{_where(index, 'initialization_binding')}: value {entry.value!r} (for key "
                f"{entry.key!r}) is not an output of training_info[{index}].initialization; its "
                f"outputs are {sorted(init_outputs)}")
    step_outputs = {o.name for o in info.algorithm.output} | {o.name for o in main.output}
    for entry in info.update_binding:
        if entry.value not in step_outputs:
            raise BindingError(
                f"{_where(index, 'update_binding')}: value {entry.value!r} (for key {entry.key!r}) "
                f"is not an output of training_info[{index}].algorithm or of the main graph; "
                "add it to the algorithm graph's outputs")


def check_ssa_and_order(model: ModelProto, index: int) -> None:
    """The combined graph defines each name once and reads names only after they are defined
    (translate.validation's rules, the ones inference applies to a single graph)."""
    main, algorithm = model.graph, model.training_info[index].algorithm
    check_graphs([(main, "the main graph"), (algorithm, "the algorithm")],
                 prefix=f"training_info[{index}], the combined graph (main graph followed by the "
                        "algorithm): ",
                 error=BindingError)


def validate(model: ModelProto) -> StateLayout:
    """Check every binding rule; the state variables and where their initializers live."""
    main_names = set(initializer_names(model.graph))
    for index, info in enumerate(model.training_info):
        for field in ("initialization_binding", "update_binding"):
            _check_unique_keys(getattr(info, field), _where(index, field))
            _check_keys(model, index, field, main_names)
        _check_values(info, index, model.graph)
        check_ssa_and_order(model, index)
    names: list[str] = []
    home: dict[str, int | None] = {}
    for index, info in enumerate(model.training_info):
        for entry in [*info.initialization_binding, *info.update_binding]:
            place = None if entry.key in main_names else index
            if entry.key in home and home[entry.key] != place:
                raise BindingError(
                    f"{_where(index, 'update_binding')}: key {entry.key!r} names an initializer of "
                    f"training_info[{index}].algorithm, but training_info[{home[entry.key]}] binds "
                    "another initializer of the same name; state variable names must be unique")
            if entry.key not in home:
                home[entry.key] = place
                names.append(entry.key)
    return StateLayout(tuple(names), home)


def initial_values(model: ModelProto, layout: StateLayout) -> Iterator[tuple[str, np.ndarray | jax.ShapeDtypeStruct]]:
    """Each state variable's starting value (its initializer), decoded one at a time. Optimizer
    slots (sparse initializers with no entries) come as shape and dtype: StateStore makes
    those zeros without writing them, so they take no memory before the first step."""
    places = [None, *sorted({p for p in layout.home.values() if p is not None})]
    for place in places:
        graph = model.graph if place is None else model.training_info[place].algorithm
        yield from iter_initializers(graph, lambda name: layout.home.get(name, -1) == place,
                                     empty_sparse_as_shape=True)
