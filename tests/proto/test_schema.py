"""Our onnx.proto describes the same wire format as the ONNX standard.

Oracles: the descriptor of the `onnx` package's generated module (every
message, field number, type, label, default, oneof and enum value must match),
a freshly compiled descriptor of proto/onnx.proto (the committed module must
not be stale), and protobuf runtimes at both ends of the range pyproject allows.
"""

from __future__ import annotations

import re
import subprocess
import tomllib
import venv

import pytest
from google.protobuf import descriptor_pb2
from onnx import onnx_ml_pb2

from onnxtrain.proto import GraphProto, ModelProto, TensorProto, onnx_pb2
from support import paths

ROOT = paths.REPO
PROTO_DIR = ROOT / "proto"


def _file_descriptor(module) -> descriptor_pb2.FileDescriptorProto:
    proto = descriptor_pb2.FileDescriptorProto()
    module.DESCRIPTOR.CopyToProto(proto)
    return proto


def _shape(file: descriptor_pb2.FileDescriptorProto) -> dict:
    """Everything about a schema that reaches the wire, with package names removed."""
    package = f".{file.package}."

    def enum(e):
        return sorted((v.name, v.number) for v in e.value)

    def message(m, prefix):
        fields = {
            f.number: (
                f.name,
                f.label,
                f.type,
                f.type_name.replace(package, "."),
                f.default_value,
                m.oneof_decl[f.oneof_index].name if f.HasField("oneof_index") else None,
                f.options.packed,
            )
            for f in m.field
        }
        shape = {
            prefix + m.name: {
                "fields": fields,
                "reserved": sorted((r.start, r.end) for r in m.reserved_range),
                "reserved_names": sorted(m.reserved_name),
                "enums": {e.name: enum(e) for e in m.enum_type},
            }
        }
        for nested in m.nested_type:
            shape.update(message(nested, prefix + m.name + "."))
        return shape

    shape = {"syntax": file.syntax or "proto2", "enums": {e.name: enum(e) for e in file.enum_type}}
    for m in file.message_type:
        shape.update(message(m, ""))
    return shape


def test_schema_matches_the_onnx_standard_field_for_field():
    ours = _shape(_file_descriptor(onnx_pb2))
    standard = _shape(_file_descriptor(onnx_ml_pb2))
    assert ours.keys() == standard.keys()
    for name in standard:
        assert ours[name] == standard[name], name


def test_schema_has_the_training_and_ir11_parts():
    model_fields = ModelProto.DESCRIPTOR.fields_by_name
    assert model_fields["training_info"].number == 20
    assert model_fields["functions"].number == 25
    assert model_fields["configuration"].number == 26
    assert TensorProto.DataType.Value("FLOAT8E8M0") == 24


def _drop_json_names(messages) -> None:
    for message in messages:
        for field in message.field:
            field.ClearField("json_name")
        _drop_json_names(message.nested_type)


def test_committed_module_is_generated_from_the_current_schema(tmp_path):
    """Compile proto/onnx.proto now and compare with the committed module's descriptor."""
    from grpc_tools import protoc

    out = tmp_path / "schema.pb"
    status = protoc.main(
        ["protoc", f"-Ionnxtrain/proto={PROTO_DIR}", f"--descriptor_set_out={out}",
         "onnxtrain/proto/onnx.proto"]
    )
    assert status == 0
    compiled = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file[0]
    _drop_json_names(compiled.message_type)  # protoc leaves these out of Python modules
    committed = descriptor_pb2.FileDescriptorProto.FromString(onnx_pb2.DESCRIPTOR.serialized_pb)
    assert compiled == committed, (
        "proto/onnx_pb2.py is stale: run `python proto/regenerate.py` and commit the result"
    )


def test_unknown_fields_survive_a_round_trip():
    # Field 999 (varint), 1000 (bytes) at the top level and inside a nested graph
    # and tensor: a newer ONNX may add fields we do not know yet.
    unknown_varint = b"\xb8\x3e\x2a"  # field 999, wire type 0, value 42
    unknown_bytes = b"\xc2\x3e\x03abc"  # field 1000, wire type 2, b"abc"
    tensor = TensorProto(name="w", data_type=TensorProto.FLOAT, dims=[1], float_data=[1.0])
    tensor_bytes = tensor.SerializeToString() + unknown_bytes
    graph_bytes = (
        GraphProto(name="g").SerializeToString()
        + b"\x2a" + bytes([len(tensor_bytes)]) + tensor_bytes  # initializer (field 5)
        + unknown_varint
    )
    model_bytes = (
        ModelProto(ir_version=11).SerializeToString()
        + b"\x3a" + bytes([len(graph_bytes)]) + graph_bytes  # graph (field 7)
        + unknown_bytes
    )
    model = ModelProto.FromString(model_bytes)
    assert model.graph.initializer[0].float_data[0] == 1.0
    model.producer_name = "edited"  # editing known fields keeps the unknown ones
    again = ModelProto.FromString(model.SerializeToString())
    assert again.SerializeToString() == model.SerializeToString()
    for fragment in (unknown_varint, unknown_bytes):
        assert fragment in again.SerializeToString()
    assert again.graph.initializer[0].SerializeToString().endswith(unknown_bytes)


def _allowed_protobuf_range() -> tuple[str, str]:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    spec = next(d for d in pyproject["project"]["dependencies"] if d.startswith("protobuf"))
    low = re.search(r">=\s*([\d.]+)", spec).group(1)
    high = re.search(r"<\s*([\d.]+)", spec).group(1)
    return low, high


@pytest.mark.slow
@pytest.mark.parametrize("bound", ["oldest", "newest"])
def test_generated_module_imports_with_every_allowed_protobuf(bound, tmp_path):
    """Install the oldest and the newest protobuf pyproject allows, import the module."""
    low, high = _allowed_protobuf_range()
    requirement = f"protobuf=={low}" if bound == "oldest" else f"protobuf>={low},<{high}"
    env = tmp_path / "env"
    venv.create(env, with_pip=True)
    python = env / "bin" / "python"
    subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", requirement],
        check=True, capture_output=True,
    )
    script = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('onnx_pb2', {str(PROTO_DIR / 'onnx_pb2.py')!r})\n"
        "module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module)\n"
        "m = module.ModelProto(ir_version=11); m.graph.name = 'g'\n"
        "assert module.ModelProto.FromString(m.SerializeToString()) == m\n"
        "import google.protobuf; print(google.protobuf.__version__)\n"
    )
    result = subprocess.run([str(python), "-c", script], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    if bound == "oldest":
        assert result.stdout.strip() == low
