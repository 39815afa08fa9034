"""load_weights (ckpt_callbacks/keras_load.py): an AsyncCheckpoint run's weights into a model
built for evaluation or inference, with real Keras 3 `model.fit` on the JAX backend."""

import os

os.environ.setdefault("KERAS_BACKEND", "jax")

import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import ckpt_callbacks as cc  # noqa: E402
from ckpt_callbacks.keras import AsyncCheckpoint, load_weights  # noqa: E402


def _model(width=8, norm=True):
    layers = [keras.Input((4,)), keras.layers.Dense(width, name="h")]
    layers += [keras.layers.BatchNormalization(name="bn")] if norm else []
    return keras.Sequential(layers + [keras.layers.Dense(1, name="out")], name="net")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A 4-epoch fit saving every epoch: the directory, each step's weights (from the checkpoint)
    and the trained model."""
    d = str(tmp_path_factory.mktemp("run"))
    keras.utils.set_random_seed(0)
    model = _model()
    model.compile(optimizer="adam", loss="mse")
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((64, 4)).astype(np.float32), rng.standard_normal((64, 1)).astype(np.float32)
    model.fit(x, y, batch_size=16, validation_split=0.25, epochs=4, verbose=0, callbacks=[AsyncCheckpoint(d)])
    with cc.CheckpointManager(d, read_only=True) as m:
        saved = {s: m.restore(s)["model"] for s in m.all_steps()}
    return d, saved, model


def _flat(tree, prefix=""):
    out = {}
    for k, v in tree.items():
        out.update(_flat(v, f"{prefix}{k}/") if isinstance(v, dict) else {prefix + k: np.asarray(v)})
    return out


def test_an_uncompiled_model_takes_the_latest_or_a_named_steps_weights(run):
    d, saved, trained = run
    steps = sorted(saved)
    served = _model()   # built by its Input, never compiled: no optimizer
    assert load_weights(served, d) == steps[-1]
    for a, b in zip(served.get_weights(), trained.get_weights()):   # incl. BatchNorm's moving statistics
        np.testing.assert_array_equal(a, b)
    x = np.linspace(-1, 1, 20, dtype=np.float32).reshape(5, 4)
    np.testing.assert_array_equal(served.predict(x, verbose=0), trained.predict(x, verbose=0))
    assert load_weights(served, d, steps[0]) == steps[0]
    got = {v.path: np.asarray(v.value) for v in served.variables}
    want = {**_flat(saved[steps[0]]["trainable_variables"]), **_flat(saved[steps[0]]["non_trainable_variables"])}
    assert set(got) == set(want)
    for path, value in got.items():
        np.testing.assert_array_equal(value, want[path], err_msg=path)


def test_the_best_step_by_a_metric_is_named_through_a_read_only_manager(run):
    d, saved, _ = run
    m = cc.CheckpointManager(d, read_only=True, retention=cc.KeepBest("val_loss"))
    best = m.best_step()
    assert best == min(m.all_steps(), key=lambda s: m.metrics(s)["val_loss"])
    served = _model()
    assert load_weights(served, d, best) == best
    np.testing.assert_array_equal(served.get_layer("out").kernel.numpy(),
                                  saved[best]["trainable_variables"]["net"]["out"]["kernel"])


def test_optimizer_true_loads_the_optimizer_of_a_compiled_model_too(run):
    d, saved, trained = run
    model = _model()
    model.compile(optimizer=keras.optimizers.Adam(), loss="mse")   # "adam_N": saved as "optimizer"
    assert load_weights(model, d, optimizer=True) == max(saved)
    assert int(model.optimizer.iterations) == int(trained.optimizer.iterations) > 0
    for a, b in zip(model.optimizer.variables, trained.optimizer.variables):
        np.testing.assert_array_equal(np.asarray(a.value), np.asarray(b.value), err_msg=a.path)
    with pytest.raises(cc.ConfigError, match="not compiled"):
        load_weights(_model(), d, optimizer=True)


def test_variables_go_onto_their_own_shardings(run):
    d, saved, _ = run
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("x", "y"))
    served = _model()
    kernel = served.get_layer("h").kernel
    kernel.assign(jax.device_put(kernel.value, NamedSharding(mesh, P("x", "y"))))
    load_weights(served, d)
    assert kernel.value.sharding == NamedSharding(mesh, P("x", "y"))
    np.testing.assert_array_equal(np.asarray(kernel.value), saved[max(saved)]["trainable_variables"]["net"]["h"]["kernel"])


def test_another_model_is_refused_naming_the_key_path_and_nothing_is_loaded(run):
    d, _, _ = run
    wider = _model(width=9)
    before = [w.copy() for w in wider.get_weights()]
    with pytest.raises(cc.IncompatibleCheckpointError, match=r"\['net'\]\['h'\]\['kernel'\].*float32\[4, 8\]") as e:
        load_weights(wider, d)
    assert "nothing was loaded" in str(e.value) and "Fix:" in str(e.value)
    for a, b in zip(wider.get_weights(), before):
        np.testing.assert_array_equal(a, b)
    fewer = _model(norm=False)   # every variable it has is saved, but the checkpoint's BatchNorm would be dropped
    before = [w.copy() for w in fewer.get_weights()]
    with pytest.raises(cc.IncompatibleCheckpointError, match=r"lacks.*\n.*\['net'\]\['bn'\]") as e:
        load_weights(fewer, d)
    assert ("['model']['trainable_variables']['net']['bn']['gamma']", "present", "absent") in e.value.mismatches
    for a, b in zip(fewer.get_weights(), before):
        np.testing.assert_array_equal(a, b)


def test_bad_input_and_missing_steps_raise_typed_errors(run, tmp_path):
    d, saved, _ = run
    with pytest.raises(cc.CheckpointNotFoundError):
        load_weights(_model(), d, max(saved) + 1)
    with pytest.raises(cc.CheckpointNotFoundError):
        load_weights(_model(), str(tmp_path / "empty"))
    unbuilt = keras.Sequential([keras.layers.Dense(1)])
    with pytest.raises(cc.ConfigError, match="no variables yet"):
        load_weights(unbuilt, d)
    with pytest.raises(cc.ConfigError, match="optimizer"):
        load_weights(_model(), d, optimizer=1)
    for step in (True, "2", -1, 2.0):
        with pytest.raises(cc.ConfigError, match="step must be an int"):
            load_weights(_model(), d, step)
    for not_a_model in (None, d, _model().layers[0]):   # (an AttributeError on .name before)
        with pytest.raises(cc.ConfigError, match="model must be a keras.Model"):
            load_weights(not_a_model, d)


def test_the_ema_weights_fit_returned_are_loaded_as_docs_keras_md_says(tmp_path):
    """use_ema=True: the checkpoint holds the raw weights (fit copies the EMA ones in after the
    last save); load_weights(optimizer=True) then finalize_variable_values gives fit's result."""
    d = str(tmp_path / "ema")
    keras.utils.set_random_seed(0)
    trained = _model(norm=False)
    trained.compile(optimizer=keras.optimizers.Adam(0.05, use_ema=True, ema_momentum=0.9), loss="mse")
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((64, 4)).astype(np.float32), rng.standard_normal((64, 1)).astype(np.float32)
    trained.fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=[AsyncCheckpoint(d)])
    served = _model(norm=False)
    load_weights(served, d)
    assert not np.array_equal(served.get_layer("out").kernel.numpy(), trained.get_layer("out").kernel.numpy())
    served.compile(optimizer=keras.optimizers.Adam(use_ema=True), loss="mse")
    load_weights(served, d, optimizer=True)
    served.optimizer.finalize_variable_values(served.trainable_variables)
    for a, b in zip(served.get_weights(), trained.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_a_model_built_again_in_one_process_is_refused_with_keras_numbering_named_as_the_cause(run, tmp_path):
    """The error said only 'build the model of the run that saved (the same layer names and
    shapes)', which the user had done: Keras had numbered the second build's names on."""
    d = str(tmp_path / "unnamed")
    make = lambda: keras.Sequential([keras.Input((4,)), keras.layers.Dense(2), keras.layers.Dropout(0.1),  # noqa: E731
                                     keras.layers.Dense(1)])
    keras.backend.clear_session()
    model = make()
    model.compile(optimizer="sgd", loss="mse")
    model.fit(np.ones((8, 4)), np.ones((8, 1)), verbose=0, callbacks=[AsyncCheckpoint(d)])
    with pytest.raises(cc.IncompatibleCheckpointError, match=r"(?s)Names such as 'seed_generator_1', "
                       r"'sequential_1', 'dense_2' may be Keras' numbering.*clear_session\(\)"):
        load_weights(make(), d)
    keras.backend.clear_session()
    assert load_weights(make(), d) == 1   # as the message says
    with pytest.raises(cc.IncompatibleCheckpointError) as e:   # a real difference: no such advice
        load_weights(_model(width=9), run[0])
    assert "numbering" not in str(e.value)


def test_a_model_frozen_for_inference_or_fine_tuning_takes_the_weights_too(run):
    """model.trainable = False (inference, feature extraction) or a frozen layer moves variables to
    non_trainable_variables; load_weights refused the model ("checkpoint has it: no") though
    every variable was in the checkpoint, under trainable_variables."""
    d, saved, _ = run
    want = _flat(saved[max(saved)])
    frozen = _model()
    frozen.trainable = False
    partly = _model()
    partly.get_layer("h").trainable = False
    for model in (frozen, partly):
        assert load_weights(model, d) == max(saved)
        for v in model.variables:
            group = "non_trainable_variables" if "moving" in v.path else "trainable_variables"
            np.testing.assert_array_equal(np.asarray(v.value), want[f"{group}/{v.path}"], err_msg=v.path)
    assert partly.get_layer("h").trainable_variables == []   # (the flags are the model's own still)
