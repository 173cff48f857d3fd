"""The model zoo: train what torch.onnx (both exporters), transformers and skl2onnx emit.

Every (family, exporter) pair of scripts/export_zoo.py is exported in the session (see
conftest.py) and checked four ways (see zoo_checks.py): inference against onnxruntime,
first-step gradients of the default training model against torch autograd, the loss falling
over Adam steps, and the trained model's inference export served by onnxruntime.

Known defects are strict xfails naming their cause, so each flips to a failure the day its
fix lands and the mark must go. The torch cases export a model each, so they are slow; the
scikit-learn cases stay in the quick run.
"""

from __future__ import annotations

import importlib
import math

import numpy as np
import pytest

from zoo_checks import CHECKS, EXPORT_TOLERANCE, INFERENCE_TOLERANCE, LEARNING_RATE, STEPS, export_zoo

# The export itself lost what torch trains: no fix on our side can bring those gradients back
# (make_training_model warns, and repair="insert_batchnorm" trains a BatchNorm that starts as
# the identity, not torch's: see the last test).
FOLDED_BN = ("the exporter folded BatchNorm into the convolutions, so the conv weights copy no "
             "torch parameter and training runs without batch statistics")
# Dynamo folds weight_norm (Wav2Vec2's positional convolution: weight = g * v / |v|) into one
# tensor: it trains, as the conv weight it is, but copies neither torch parameter.
WEIGHT_NORM = "the exporter folded weight_norm's g and v into one convolution weight"

BATCHNORM = [family.name for family in export_zoo.FAMILIES.values() if family.batchnorm]

# (family, exporter) -> {check: cause}; "*" is every check.
KNOWN: dict[tuple[str, str], dict[str, str]] = {
    ("wav2vec2", "dynamo"): {"gradients": WEIGHT_NORM},
    **{(name, exporter): {"gradients": FOLDED_BN}
       for name in BATCHNORM for exporter in ("dynamo", "torchscript")},
}

# What each exporter imports; each family adds its own (Family.requires: transformers,
# torchvision, timm).
REQUIRES = {"dynamo": ("torch", "onnxscript"), "torchscript": ("torch",),
            export_zoo.KEEP_BATCHNORM: ("torch", "onnxscript"),
            "skl2onnx": ("sklearn", "skl2onnx")}


def _cases(check: str) -> list:
    params = []
    for name, exporter in export_zoo.cases():
        causes = KNOWN.get((name, exporter), {})
        cause = causes.get(check, causes.get("*"))
        marks = [pytest.mark.xfail(strict=True, reason=cause)] if cause else []
        if exporter != "skl2onnx":
            marks.append(pytest.mark.slow)
        params.append(pytest.param(name, exporter, id=f"{name}-{exporter}", marks=marks))
    return params


def _require(name: str, exporter: str) -> None:
    """Skip unless every module the exporter and the family need imports. An installed module
    that fails to import is skipped too: a torchvision built for another torch raises
    RuntimeError on import, not ImportError (the test extra pins a matching pair)."""
    for module in (*REQUIRES[exporter], *export_zoo.FAMILIES[name].requires):
        try:
            importlib.import_module(module)
        except ImportError:
            pytest.skip(f"{module} is not installed")
        except Exception as error:  # noqa: BLE001 - any failure of an optional import skips
            pytest.skip(f"{module} is installed but does not import: {type(error).__name__}: {error}")


def _trainable(name: str) -> None:
    if name == "sk_logistic_ml":
        pytest.skip("ai.onnx.ml ops keep the coefficients in attributes: nothing to train "
                    "(see test_ml_op_pipeline_has_nothing_to_train)")


@pytest.mark.parametrize("name, exporter", _cases("inference"))
def test_inference_matches_onnxruntime(zoo, name, exporter):
    _require(name, exporter)
    assert zoo.inference_error(name, exporter) <= INFERENCE_TOLERANCE


@pytest.mark.parametrize("name, exporter", _cases("gradients"))
def test_first_step_gradients_match_torch_autograd(zoo, name, exporter):
    _require(name, exporter)
    _trainable(name)
    # Past GRADIENT_TOLERANCE only where float32 rounding explains it (see zoo_checks).
    _, problems, _ = zoo.gradient_report(name, exporter)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("name, exporter", _cases("trains"))
def test_loss_falls_over_adam_steps(zoo, name, exporter):
    _require(name, exporter)
    _trainable(name)
    losses = zoo.losses(name, exporter)
    assert len(losses) == STEPS + 1 and all(math.isfinite(loss) for loss in losses), losses
    assert losses[-1] < 0.9 * losses[0], losses


@pytest.mark.parametrize("name, exporter", _cases("export"))
def test_trained_export_serves_in_onnxruntime(zoo, name, exporter, tmp_path):
    _require(name, exporter)
    _trainable(name)
    assert zoo.export_error(name, exporter, tmp_path) <= EXPORT_TOLERANCE


def test_ml_op_pipeline_has_nothing_to_train(zoo):
    """skl2onnx's default ai.onnx.ml conversion keeps coefficients in node attributes: the
    recipe says so instead of building a training model that changes nothing."""
    _require("sk_logistic_ml", "skl2onnx")
    import onnxtrain

    with pytest.raises(onnxtrain.BindingError, match="no trainable weights"):
        onnxtrain.make_training_model(zoo.model("sk_logistic_ml", "skl2onnx"), loss="mse",
                                      output="probabilities")


def test_every_known_failure_names_a_zoo_case_and_check():
    cases = set(export_zoo.cases())
    for case, causes in KNOWN.items():
        assert case in cases and set(causes) <= {*CHECKS, "*"}, case


@pytest.mark.slow
@pytest.mark.parametrize("name", BATCHNORM)
def test_folded_batchnorm_is_found_only_where_the_export_folded_it(zoo, name):
    """The FOLDED_BN cases above are damage onnxtrain cannot undo, so it must say so: the
    folded exports warn about it, the one that kept BatchNorm does not."""
    import warnings

    import onnxtrain

    for exporter in ("dynamo", "torchscript", export_zoo.KEEP_BATCHNORM):
        _require(name, exporter)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            onnxtrain.make_training_model(zoo.model(name, exporter), loss="cross_entropy")
        folded = [w for w in caught if issubclass(w.category, onnxtrain.ExportDamageWarning)
                  and "BatchNorm" in str(w.message)]
        assert bool(folded) == (exporter != export_zoo.KEEP_BATCHNORM), (exporter, [str(w.message) for w in caught])


@pytest.mark.slow
# The ResNets (folded, tv_resnet trains only at a lower rate) and one depthwise net: each
# model costs CI a compile, and the repair is the same graph edit on every family.
@pytest.mark.parametrize("name", ["resnet", "mobilenet", "tv_resnet", "tv_mobilenet_v3"])
def test_folded_batchnorm_trains_after_the_repair_the_warning_names(zoo, name):
    """What a user of a folded export does next: repair="insert_batchnorm" puts BatchNorm back
    (the identity at first, so inference is unchanged) and the model trains on batch
    statistics, the folded ResNet included."""
    import onnxruntime

    import onnxtrain
    from onnxtrain import optim

    _require(name, "dynamo")
    family = export_zoo.FAMILIES[name]
    folded = zoo.model(name, "dynamo")
    feeds = zoo.feeds(name, "dynamo")
    training = onnxtrain.make_training_model(folded, loss=family.loss, output=family.output,
                                             optimizer=optim.Adam(lr=LEARNING_RATE), repair={"insert_batchnorm"})
    assert any(node.op_type == "BatchNormalization" for node in training.graph.node)
    trainer = onnxtrain.Trainer(training)
    session = onnxruntime.InferenceSession(folded, providers=["CPUExecutionProvider"])
    (served,) = session.run([family.output], feeds)
    got = np.asarray(trainer.infer(feeds)[family.output])
    assert np.max(np.abs(got - served) / (1 + np.abs(served))) <= INFERENCE_TOLERANCE
    batch = {**feeds, "labels": zoo.labels(name)}
    losses = [float(trainer.step(batch)["loss"]) for _ in range(STEPS + 1)]
    assert all(math.isfinite(loss) for loss in losses) and losses[-1] < 0.9 * losses[0], losses
