"""Where a trainer's arrays live: the default device, or every device of a jax.sharding.Mesh.

With a mesh, a training step stays one jitted XLA program and XLA's SPMD
partitioner does the distributing: feeds are split along their first axis over
the mesh's data axis ("batch" if the mesh has one, else its first axis), state
is replicated (so each step all-reduces the gradients inside the program), and
the new state is pinned to the old state's sharding, so donation still updates
it in place.

A model's IR-11 sharding annotations (NodeProto.device_configurations) are
hints. Device i of a DeviceConfigurationProto is device i of the mesh in
mesh.devices order; a configuration is used when its num_devices equals the
mesh's size. An annotation that maps onto the mesh becomes a
with_sharding_constraint on the tensor where its node reads or writes it, and a
state variable it names is stored sharded that way. One that cannot be
honoured is ignored, as the spec allows, with one warning naming the node and
the tensor.
"""

from __future__ import annotations

import itertools
import math
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from onnxtrain.errors import InputError, user_stacklevel
from onnxtrain.proto import ModelProto, NodeProto, ShardingSpecProto
from onnxtrain.translate.graph import GraphPlan
from onnxtrain.translate.node import NodeSpec, node_label

DATA_AXIS = "batch"


class ShardingAnnotationWarning(UserWarning):
    """An IR-11 sharding annotation the mesh cannot honour; it is ignored."""


class _Unsupported(Exception):
    """Why an annotation cannot be honoured (the warning's text)."""


def host_value(value: jax.Array) -> np.ndarray:
    """A value as one numpy array, gathered from every process when it spans several."""
    if isinstance(value, jax.Array) and not (value.is_fully_addressable or value.is_fully_replicated):
        return np.asarray(multihost_utils.process_allgather(value, tiled=True))
    return np.asarray(value)


def _put(value: Any, sharding: NamedSharding) -> jax.Array:
    """device_put that also works when the mesh spans other processes: every process passes
    the same global value and keeps the pieces its own devices hold."""
    if sharding.is_fully_addressable:
        return jax.device_put(value, sharding)
    if isinstance(value, jax.Array) and value.sharding == sharding:
        return value
    if isinstance(value, jax.Array) and jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key):
        return jax.random.wrap_key_data(_put(jax.random.key_data(value), sharding),
                                        impl=jax.random.key_impl(value))
    array = host_value(value)
    return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])


class Placement:
    """The default device: nothing is placed or constrained (a single-device trainer)."""

    def check_batch(self, feeds: dict[str, Any], where: str) -> dict[str, Any]:
        return feeds

    def place_batch(self, feeds: dict[str, Any], where: str, stacked: bool = False) -> dict[str, Any]:
        return feeds

    def replicate(self, tree: Any) -> Any:
        return tree

    def place_state(self, values: Mapping[str, Any]) -> dict[str, Any]:
        return dict(values)

    def constrain_state(self, state: dict[str, Any]) -> dict[str, Any]:
        return state

    def annotate(self, plan: GraphPlan) -> None:
        """Single device: sharding annotations have nothing to act on."""


DEFAULT_DEVICE = Placement()


def placement(mesh: Mesh | None, model: ModelProto, state_shapes: Mapping[str, tuple[int, ...]]) -> Placement:
    """The placement for a trainer of `model` on `mesh` (None: the default device)."""
    if mesh is None:
        return DEFAULT_DEVICE
    if not isinstance(mesh, Mesh):
        raise InputError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}; build one with "
                         "jax.make_mesh((jax.device_count(),), ('batch',))")
    return MeshPlacement(mesh, model, state_shapes)


class MeshPlacement(Placement):
    """Data parallelism over the mesh's data axis, plus the model's sharding annotations."""

    def __init__(self, mesh: Mesh, model: ModelProto, state_shapes: Mapping[str, tuple[int, ...]]):
        # Auto axes: XLA's partitioner chooses every sharding we do not pin (jax.make_mesh
        # defaults to explicit axes, under which with_sharding_constraint is refused).
        self.mesh = Mesh(mesh.devices, mesh.axis_names)
        self.axis = DATA_AXIS if DATA_AXIS in mesh.axis_names else mesh.axis_names[0]
        self.size = self.mesh.shape[self.axis]
        self._replicated = NamedSharding(self.mesh, PartitionSpec())
        self._configurations = {c.name: c.num_devices for c in model.configuration}
        self._warned: set[tuple[str, str]] = set()
        self._specs: dict[tuple[str, str, tuple[int, ...]], PartitionSpec | None] = {}
        self._state: dict[str, NamedSharding] = {}
        for node in _annotated_nodes(model):
            for sharding in self._usable(node):
                name = sharding.tensor_name
                if name in state_shapes and name in node.input and name not in self._state:
                    spec = self._spec(node_label(node), sharding, state_shapes[name])
                    if spec is not None:
                        self._state[name] = NamedSharding(self.mesh, spec)

    def check_batch(self, feeds: dict[str, Any], where: str) -> dict[str, Any]:
        """InputError unless every batched feed (rank >= 1) splits evenly over the data axis."""
        for name, value in feeds.items():
            shape = np.shape(value)
            if shape and shape[0] % self.size:
                raise InputError(
                    f"{where}: input {name!r} has {shape[0]} rows on axis 0, which the {self.size} "
                    f"devices of mesh axis {self.axis!r} cannot split evenly; use a batch size that is "
                    f"a multiple of {self.size} (or drop the last, partial batch)")
        return feeds

    def place_batch(self, feeds: dict[str, Any], where: str, stacked: bool = False) -> dict[str, Any]:
        """Feeds split along axis 0 (axis 1 for a stack of batches) over the data axis."""
        self.check_batch({n: v[0] for n, v in feeds.items()} if stacked else feeds, where)
        batched = NamedSharding(self.mesh, PartitionSpec(*([None] * stacked), self.axis))
        return {name: _put(value, batched if np.ndim(value) > stacked else self._replicated)
                for name, value in feeds.items()}

    def replicate(self, tree: Any) -> Any:
        return jax.tree.map(lambda value: _put(value, self._replicated), tree)

    def sharding_of(self, name: str) -> NamedSharding:
        """A state variable's sharding: its annotation's, else replicated."""
        return self._state.get(name, self._replicated)

    def place_state(self, values: Mapping[str, Any]) -> dict[str, Any]:
        return {name: _put(value, self.sharding_of(name)) for name, value in values.items()}

    def constrain_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """Inside a step: the new state keeps the old state's sharding (so donation works)."""
        return {name: jax.lax.with_sharding_constraint(value, self.sharding_of(name))
                for name, value in state.items()}

    def annotate(self, plan: GraphPlan) -> None:
        """Make every annotated node of `plan` (and of its subgraphs) constrain the tensors its
        annotations name. The node's handler is wrapped, so the translator stays device-blind
        and a Gradient replaying the node sees the same constraints."""
        for spec in plan.nodes:
            shardings = {s.tensor_name: s for s in self._usable(spec.proto)}
            if shardings:
                spec.call = self._constrained(spec, shardings)
            for subplan in spec.subgraphs.values():
                self.annotate(subplan)

    def _constrained(self, spec: NodeSpec, shardings: dict[str, ShardingSpecProto]) -> Callable:
        call, inputs, outputs = spec.call, list(spec.proto.input), list(spec.proto.output)

        def constrain(name: str, value: Any) -> Any:
            if name not in shardings or not isinstance(value, jax.core.Tracer):
                return value
            partition = self._spec(node_label(spec.proto), shardings[name], value.shape)
            if partition is None:
                return value
            return jax.lax.with_sharding_constraint(value, NamedSharding(self.mesh, partition))

        def constrained(node: Any, *values: Any) -> Any:
            values = tuple(constrain(name, value) for name, value in zip(inputs, values)) + values[len(inputs):]
            result = call(node, *values)
            if isinstance(result, tuple):
                return tuple(constrain(name, value) for name, value in zip(outputs, result)) + result[len(outputs):]
            return constrain(outputs[0], result) if outputs else result

        return constrained

    def _usable(self, node: NodeProto) -> list[ShardingSpecProto]:
        """The sharding specs of the node's first configuration sized like the mesh; every
        annotation of a node with no such configuration is warned about once."""
        label = node_label(node)
        for configuration in node.device_configurations:
            if configuration.pipeline_stage:
                self._warn(label, "(pipeline_stage)", "pipeline stages are not supported; the node runs "
                           "on every device")
        matching = [c for c in node.device_configurations
                    if self._configurations.get(c.configuration_id) == self.mesh.size]
        if not matching:
            for configuration in node.device_configurations:
                for sharding in configuration.sharding_spec:
                    count = self._configurations.get(configuration.configuration_id)
                    reason = (f"configuration {configuration.configuration_id!r} is not in "
                              "ModelProto.configuration" if count is None else
                              f"configuration {configuration.configuration_id!r} has {count} devices "
                              f"but the mesh has {self.mesh.size}")
                    self._warn(label, sharding.tensor_name, reason)
            return []
        usable = []
        for sharding in matching[0].sharding_spec:
            if sharding.tensor_name in node.input or sharding.tensor_name in node.output:
                usable.append(sharding)
            else:
                self._warn(label, sharding.tensor_name, "the tensor is neither an input nor an output of the node")
        return usable

    def _spec(self, label: str, sharding: ShardingSpecProto, shape: tuple[int, ...]) -> PartitionSpec | None:
        """The PartitionSpec for one annotation and tensor shape, or None (warned once)."""
        key = (label, sharding.tensor_name, tuple(shape))
        if key not in self._specs:
            try:
                self._specs[key] = _partition_spec(sharding, self.mesh, tuple(shape))
            except _Unsupported as reason:
                self._warn(label, sharding.tensor_name, str(reason))
                self._specs[key] = None
        return self._specs[key]

    def _warn(self, label: str, tensor: str, reason: str) -> None:
        if (label, tensor) not in self._warned:
            self._warned.add((label, tensor))
            warnings.warn(f"{label}: the sharding annotation of tensor {tensor!r} is ignored: {reason}",
                          ShardingAnnotationWarning, stacklevel=user_stacklevel())


def _annotated_nodes(model: ModelProto) -> list[NodeProto]:
    graphs = [model.graph, *(info.algorithm for info in model.training_info)]
    return [node for graph in graphs for node in graph.node if node.device_configurations]


def _partition_spec(sharding: ShardingSpecProto, mesh: Mesh, shape: tuple[int, ...]) -> PartitionSpec:
    """The PartitionSpec of `mesh` that puts the shards of a tensor of `shape` where `sharding`
    says: shard i (row-major over the split axes) on device sharding.device[i]. Supported: any
    number of axes each split evenly over one whole mesh axis, every device holding one shard,
    and replication on every device. Raises _Unsupported saying why otherwise."""
    if sharding.index_to_device_group_map:
        raise _Unsupported("device groups (index_to_device_group_map) are not supported")
    devices = list(sharding.device) or list(range(mesh.size))
    if sorted(devices) != list(range(mesh.size)):
        raise _Unsupported(f"it names devices {devices}; only layouts over all {mesh.size} devices "
                           "of the mesh are supported")
    splits = _splits(sharding, shape)
    if not splits:
        return PartitionSpec()
    if math.prod(splits.values()) != mesh.size:
        raise _Unsupported(f"{math.prod(splits.values())} shards on {mesh.size} devices; only one shard "
                           "per device is supported")
    axes = [name for name in mesh.axis_names if mesh.shape[name] > 1]
    for chosen in itertools.permutations(axes, len(splits)):
        if [mesh.shape[name] for name in chosen] != list(splits.values()):
            continue
        by_axis = dict(zip(splits, chosen))
        spec = PartitionSpec(*(by_axis.get(axis) for axis in range(len(shape))))
        if _shard_order(NamedSharding(mesh, spec), shape, splits) == [mesh.devices.flat[d] for d in devices]:
            return spec
    raise _Unsupported(f"no layout of the mesh {dict(mesh.shape)} puts the shards of axes "
                       f"{list(splits)} on devices {devices} in that order")


def _splits(sharding: ShardingSpecProto, shape: tuple[int, ...]) -> dict[int, int]:
    """Tensor axis -> number of shards (>1), in axis order."""
    splits: dict[int, int] = {}
    for dim in sharding.sharded_dim:
        axis = dim.axis + len(shape) if dim.axis < 0 else dim.axis
        if not 0 <= axis < len(shape) or axis in splits:
            raise _Unsupported(f"axis {dim.axis} is out of range for shape {list(shape)} or given twice")
        if len(dim.simple_sharding) != 1:
            raise _Unsupported(f"axis {dim.axis} has {len(dim.simple_sharding)} simple_sharding entries; "
                               "only one per axis is supported")
        simple = dim.simple_sharding[0]
        if simple.HasField("dim_value") and simple.dim_value != shape[axis]:
            raise _Unsupported(f"axis {dim.axis} is annotated as {simple.dim_value} long but is {shape[axis]}")
        if simple.num_shards < 1 or shape[axis] % simple.num_shards:
            raise _Unsupported(f"axis {dim.axis} of size {shape[axis]} does not split evenly into "
                               f"{simple.num_shards} shards")
        if simple.num_shards > 1:
            splits[axis] = simple.num_shards
    return dict(sorted(splits.items()))


def _shard_order(sharding: NamedSharding, shape: tuple[int, ...], splits: dict[int, int]) -> list[Any]:
    """The devices holding shard 0, 1, ... (row-major over the split axes)."""
    order = {}
    for device, index in sharding.devices_indices_map(shape).items():
        position = 0
        for axis, count in splits.items():
            position = position * count + (index[axis].start or 0) // (shape[axis] // count)
        order[position] = device
    return [order[i] for i in range(len(order))]
