"""Small constructors for ONNX messages, so code that writes graphs stays readable.

Attribute types follow the Python value: float, int, str/bytes, TensorProto,
GraphProto, or a list of one of those.
"""

from __future__ import annotations

from collections.abc import Sequence

from onnxtrain.proto.onnx_pb2 import (
    AttributeProto,
    GraphProto,
    NodeProto,
    OperatorSetIdProto,
    StringStringEntryProto,
    TensorProto,
    TypeProto,
    ValueInfoProto,
)

_SCALAR_KINDS = (
    (bool, AttributeProto.INT, "i"),
    (int, AttributeProto.INT, "i"),
    (float, AttributeProto.FLOAT, "f"),
    (str, AttributeProto.STRING, "s"),
    (bytes, AttributeProto.STRING, "s"),
    (TensorProto, AttributeProto.TENSOR, "t"),
    (GraphProto, AttributeProto.GRAPH, "g"),
)
_LIST_KINDS = {
    AttributeProto.INT: (AttributeProto.INTS, "ints"),
    AttributeProto.FLOAT: (AttributeProto.FLOATS, "floats"),
    AttributeProto.STRING: (AttributeProto.STRINGS, "strings"),
    AttributeProto.TENSOR: (AttributeProto.TENSORS, "tensors"),
    AttributeProto.GRAPH: (AttributeProto.GRAPHS, "graphs"),
}


def _kind(value: object, name: str) -> tuple[int, str]:
    for python_type, attribute_type, field in _SCALAR_KINDS:
        if isinstance(value, python_type):
            return attribute_type, field
    raise TypeError(f"attribute {name!r}: cannot store a {type(value).__name__}")


def _encoded(value: object) -> object:
    return value.encode("utf-8") if isinstance(value, str) else value


def attribute(name: str, value: object) -> AttributeProto:
    """An AttributeProto whose type follows the Python value."""
    made = AttributeProto(name=name)
    if isinstance(value, (list, tuple)):
        if not value:
            raise TypeError(f"attribute {name!r}: an empty list has no type")
        # A list mixing ints and floats is a list of floats.
        kinds = {_kind(item, name)[0] for item in value}
        scalar = AttributeProto.FLOAT if kinds == {AttributeProto.INT, AttributeProto.FLOAT} else kinds.pop()
        made.type, field = _LIST_KINDS[scalar]
        repeated = getattr(made, field)
        if scalar in (AttributeProto.TENSOR, AttributeProto.GRAPH):
            repeated.extend(value)
        else:
            repeated.extend(_encoded(item) for item in value)
        return made
    made.type, field = _kind(value, name)
    if made.type in (AttributeProto.TENSOR, AttributeProto.GRAPH):
        getattr(made, field).CopyFrom(value)
    else:
        setattr(made, field, _encoded(value))
    return made


def node(
    op_type: str,
    inputs: Sequence[str],
    outputs: Sequence[str],
    *,
    name: str = "",
    domain: str = "",
    **attributes: object,
) -> NodeProto:
    """A NodeProto; keyword arguments become attributes (None values are left out)."""
    return NodeProto(
        op_type=op_type,
        input=inputs,
        output=outputs,
        name=name,
        domain=domain,
        attribute=[attribute(key, value) for key, value in attributes.items() if value is not None],
    )


def tensor_value_info(name: str, elem_type: int, shape: Sequence[int | str | None] | None) -> ValueInfoProto:
    """A tensor ValueInfoProto; shape entries are sizes, symbolic names or None (unknown)."""
    tensor_type = TypeProto.Tensor(elem_type=elem_type)
    if shape is not None:
        tensor_type.shape.SetInParent()
        for size in shape:
            dim = tensor_type.shape.dim.add()
            if isinstance(size, int):
                dim.dim_value = size
            elif isinstance(size, str):
                dim.dim_param = size
    return ValueInfoProto(name=name, type=TypeProto(tensor_type=tensor_type))


def opset(domain: str, version: int) -> OperatorSetIdProto:
    return OperatorSetIdProto(domain=domain, version=version)


def bindings(pairs: dict[str, str]) -> list[StringStringEntryProto]:
    """Binding entries `state variable <- graph output`, in the dict's order."""
    return [StringStringEntryProto(key=key, value=value) for key, value in pairs.items()]
