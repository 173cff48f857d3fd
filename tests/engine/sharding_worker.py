"""Sharded-training scenarios, each run in a fresh process that sees several CPU devices.

The pytest process has already initialized JAX with one device, so tests/engine/test_sharding.py
starts this script with XLA_FLAGS=--xla_force_host_platform_device_count=N (and, for the
multi-process scenario, a coordinator address); it prints one JSON object on its last line.

    python tests/engine/sharding_worker.py parity mlp|cnn OUTDIR
    python tests/engine/sharding_worker.py annotated
    python tests/engine/sharding_worker.py multihost PROCESS_ID PORT STEPS
"""

from __future__ import annotations

import json
import re
import sys
import warnings
from pathlib import Path

import jax
import numpy as np
from jax.sharding import Mesh

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "torch"


def training_model(name: str):
    import onnxtrain

    oracle = np.load(FIXTURES / f"{name}_oracle.npz")
    return onnxtrain.make_training_model((FIXTURES / f"{name}.onnx").read_bytes(), loss="cross_entropy",
                                         optimizer=onnxtrain.optim.SGD(lr=float(oracle["sgd_lr"])))


def batches(name: str, count: int) -> list[dict[str, np.ndarray]]:
    oracle = np.load(FIXTURES / f"{name}_oracle.npz")
    return [{"x": oracle["batches_x"][i], "labels": oracle["batches_y"][i]} for i in range(count)]


def train(trainer, feeds: list[dict[str, np.ndarray]]) -> list[float]:
    """Three single steps, then the rest through fit() two steps per compiled call."""
    losses = [float(trainer.step(batch)["loss"]) for batch in feeds[:3]]
    return losses + trainer.fit(feeds[3:], progress=False, steps_per_call=2)["step_loss"]


def state_difference(expected, actual) -> dict[str, tuple[float, float]]:
    """Per state variable: the largest |difference| and the largest |expected value|."""
    def largest(array) -> float:
        return float(np.max(np.abs(np.asarray(array, np.float64)), initial=0.0))

    return {k: (largest(np.asarray(actual[k], np.float64) - np.asarray(expected[k], np.float64)),
                largest(expected[k])) for k in expected}


def parity(name: str, outdir: str) -> dict:
    """The same training on the default device and data-parallel on every device (and the same
    for finetune()); the sharded run's checkpoint and export are left in outdir for a
    one-device process to load."""
    import onnxtrain

    model, feeds = training_model(name), batches(name, 7)
    single = onnxtrain.Trainer(model)
    single_losses = train(single, feeds)
    sharded_mesh = jax.make_mesh((jax.device_count(),), ("batch",))
    sharded = onnxtrain.Trainer(model, mesh=sharded_mesh)
    sharded_losses = train(sharded, feeds)
    state = {k: np.asarray(v) for k, v in sharded.state.items()}
    sharded.save_checkpoint(Path(outdir) / "sharded.ckpt")
    sharded.export(Path(outdir) / "sharded.onnx")
    np.savez(Path(outdir) / "sharded_state.npz", **state)
    finetuned = [[float(tuner.step(batch)["loss"]) for batch in feeds[:3]] for tuner in (
        onnxtrain.finetune((FIXTURES / f"{name}.onnx").read_bytes(), "cross_entropy"),
        onnxtrain.finetune((FIXTURES / f"{name}.onnx").read_bytes(), "cross_entropy", mesh=sharded_mesh))]
    try:
        sharded.step({k: v[:6] for k, v in feeds[0].items()})
        uneven = None
    except onnxtrain.InputError as error:
        uneven = str(error)
    return {"devices": jax.device_count(), "single": single_losses, "sharded": sharded_losses,
            "state_difference": state_difference(single.state, state), "uneven_error": uneven,
            "finetune_single": finetuned[0], "finetune_sharded": finetuned[1],
            "state_specs": sorted({str(v.sharding.spec) for v in sharded._store.values.values()})}


def annotated_model():
    """The MLP with IR-11 annotations: three the 4-device mesh can honour, three it cannot."""
    from onnxtrain.proto import (DeviceConfigurationProto, NodeDeviceConfigurationProto,
                                 ShardedDimProto, ShardingSpecProto, SimpleShardedDimProto)

    def split(tensor: str, axis: int, shards: int, devices=(0, 1, 2, 3)):
        return ShardingSpecProto(tensor_name=tensor, device=list(devices), sharded_dim=[ShardedDimProto(
            axis=axis, simple_sharding=[SimpleShardedDimProto(num_shards=shards)])])

    model = training_model("mlp")
    model.configuration.extend([DeviceConfigurationProto(name="four", num_devices=4),
                                DeviceConfigurationProto(name="two", num_devices=2)])
    nodes = {node.name: node for node in model.graph.node}
    nodes["/0/Gemm"].device_configurations.append(NodeDeviceConfigurationProto(
        configuration_id="four", sharding_spec=[split("0.weight", 0, 4), split("/0/Gemm_output_0", 1, 4),
                                                split("0.bias", 0, 3)]))
    nodes["/1/Relu"].device_configurations.append(NodeDeviceConfigurationProto(
        configuration_id="two", sharding_spec=[split("/1/Relu_output_0", 1, 2, (0, 1))]))
    nodes["/2/Gemm"].device_configurations.append(NodeDeviceConfigurationProto(
        configuration_id="four", sharding_spec=[ShardingSpecProto(tensor_name="logits"),
                                                split("2.weight", 1, 4, (3, 2, 1, 0))]))
    return model


def annotated() -> dict:
    """Train the annotated MLP on 4 devices; report the step's shardings and the warnings."""
    import onnxtrain

    feeds = batches("mlp", 5)
    reference = train(onnxtrain.Trainer(training_model("mlp")), feeds)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # nan_policy="ignore": the step is the plain donated one, lowered below as it runs.
        trainer = onnxtrain.Trainer(annotated_model(), mesh=Mesh(np.array(jax.devices()), ("batch",)),
                                    nan_policy="ignore")
        losses = train(trainer, feeds)
        trainer.infer({"x": feeds[0]["x"]})
    lowered = trainer.lowered(feeds[0])
    compiled = lowered.compile()
    state_shardings = compiled.input_shardings[0][0]
    return {
        "reference": reference, "losses": losses,
        "warnings": [str(w.message) for w in caught if w.category.__name__ == "ShardingAnnotationWarning"],
        "constraints": re.findall(r"sdy\.sharding_constraint [^<]*<@mesh, (\[[^\]]*\])> : (tensor<[^>]*>)",
                                  lowered.as_text()),
        "compiled_input_spec": {name: str(state_shardings[name].spec) for name in ("0.weight", "2.weight")},
        "stored_spec": {name: str(trainer._store.values[name].sharding.spec) for name in ("0.weight", "0.bias")},
        "compiled_devices_annotations": sorted(set(re.findall(r"sharding=\{devices=\[[^\]]*\][^}]*\}",
                                                              compiled.as_text()))),
    }


def multihost(process_id: int, port: int, steps: int) -> dict:
    """One of two processes training the MLP data-parallel over both processes' devices."""
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                               process_id=process_id, initialization_timeout=60,
                               coordinator_bind_address=f"127.0.0.1:{port}")
    import onnxtrain

    trainer = onnxtrain.Trainer(training_model("mlp"), mesh=jax.make_mesh((jax.device_count(),), ("batch",)))
    losses = [float(trainer.step(batch)["loss"]) for batch in batches("mlp", steps)]
    weight = trainer.state["2.bias"]
    result = {"process": jax.process_index(), "devices": jax.device_count(),
              "local_devices": jax.local_device_count(), "losses": losses,
              "bias": np.asarray(weight).tolist()}
    jax.distributed.shutdown()
    return result


if __name__ == "__main__":
    scenario, *arguments = sys.argv[1:]
    if scenario == "parity":
        outcome = parity(*arguments)
    elif scenario == "annotated":
        outcome = annotated()
    else:
        outcome = multihost(*map(int, arguments))
    print(json.dumps(outcome))
