"""``LossScaleOptimizer`` for Keras 3: TensorFlow's API as a Keras optimizer, on the core rule.

It subclasses Keras's own ``keras.optimizers.LossScaleOptimizer``, so that ``model.compile``
under ``mixed_float16`` recognises it and does not wrap it in a second loss-scale optimizer,
and replaces its constructor, its state and its update: the scale follows
:func:`lossscale.core.dynamic_update` (TensorFlow's rule, with a floor and a ceiling) evaluated
with ``keras.ops`` on the backend's tensors, and the state lives in Keras variables, so it is
saved with the optimizer and threads through ``stateless_apply`` on JAX.

Two protocols, one optimizer:

* Keras 3's trainers call ``scale_loss(loss)`` and hand the **scaled** gradients to ``apply``
  / ``apply_gradients`` / ``stateless_apply``: the optimizer unscales them.
* TensorFlow's custom loop calls ``get_scaled_loss``, then ``get_unscaled_gradients`` and hands
  the **unscaled** gradients to ``apply_gradients``. The optimizer recognises the tensors that
  ``get_unscaled_gradients`` returned (by identity, within the same step) and does not unscale
  them again. A mix of the two in one call is a ``ValueError``.

Either way it checks the gradients, applies the inner optimizer only when all are finite, and
advances the scale.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import keras
from keras import ops

from lossscale.core._rule import DynamicState, dynamic_update
from lossscale.core._settings import (
    EXTENSION_DEFAULTS,
    ScaleSettings,
    extension_config,
    scale_settings,
    upgrade_optimizer_config,
)
from lossscale.core._stall import DEFAULT_STALL_STEPS, report_stall, stall_alarm, stall_update
from lossscale.keras._namespace import KERAS

_KERAS_LSO: Any = keras.optimizers.LossScaleOptimizer
#: Keras 3 LossScaleOptimizer keywords that may appear at their defaults in saved configs.
_BASE_DEFAULTS = {
    "weight_decay": None,
    "clipnorm": None,
    "global_clipnorm": None,
    "clipvalue": None,
    "use_ema": False,
    "ema_momentum": 0.99,
    "ema_overwrite_frequency": None,
    "loss_scale_factor": None,
    "gradient_accumulation_steps": None,
}
_HALF = ("float16", "bfloat16")


#: Modules tf_keras / TensorFlow 2.x write for a built-in optimizer (None: no module at all).
_TF_KERAS_MODULES = (None, "keras.optimizers", "keras.optimizers.legacy")
#: tf_keras optimizer config keys Keras 3 optimizers do not take, and the values that mean
#: nothing there (``jit_compile`` is a tf_keras optimizer's own compilation switch; Keras 3
#: compiles the whole train step as ``model.compile(jit_compile=...)`` says).
_TF_KERAS_ONLY_KEYS: dict[str, tuple[Any, ...]] = {
    "jit_compile": (True, False),
    "is_legacy_optimizer": (True, False),
    "decay": (0, 0.0),
}


def _keras3_optimizer_config(serialized: dict[str, Any]) -> dict[str, Any]:
    """A tf_keras built-in optimizer's serialized config, without the keys Keras 3 refuses.

    Raises:
      ValueError: a legacy optimizer's learning-rate ``decay`` other than 0 (Keras 3 has no
        such argument: use a learning-rate schedule).
    """
    inner = dict(serialized.get("config", {}))
    for key, meaningless in _TF_KERAS_ONLY_KEYS.items():
        if key not in inner:
            continue
        value = inner.pop(key)
        if value not in meaningless:
            raise ValueError(
                f"Cannot load the inner optimizer: its tf_keras config has {key}={value!r}, "
                "which Keras 3 optimizers do not support (use a learning-rate schedule)"
            )
    return {"class_name": serialized["class_name"], "config": inner}


def _unscale_one(grad: Any, inv: Any) -> Any:
    """``grad * inv`` in ``grad``'s dtype: float32 math for half and float32 gradients (the
    float32 reciprocal ``inv``, as TensorFlow), float64 math for float64 ones."""
    grad = ops.convert_to_tensor(grad)
    if keras.backend.standardize_dtype(grad.dtype) == "float64":
        return ops.multiply(grad, ops.cast(inv, "float64"))
    return ops.cast(ops.multiply(ops.cast(grad, "float32"), inv), grad.dtype)


@keras.saving.register_keras_serializable(package="lossscale")
class LossScaleOptimizer(_KERAS_LSO):  # type: ignore[misc,valid-type]
    """TensorFlow's ``tf.keras.mixed_precision.LossScaleOptimizer`` for Keras 3.

    Pass it to ``model.compile`` (any backend), or use it in a custom loop::

        opt = lossscale.keras.LossScaleOptimizer(keras.optimizers.SGD(0.1))
        model.compile(optimizer=opt, loss="mse")        # model.fit scales and unscales

        with tf.GradientTape() as tape:                   # TensorFlow's custom loop
            scaled_loss = opt.get_scaled_loss(loss_fn())
        grads = opt.get_unscaled_gradients(tape.gradient(scaled_loss, variables))
        opt.apply_gradients(zip(grads, variables))        # skipped when a gradient is inf/NaN

    Args:
      inner_optimizer: the Keras optimizer to wrap (not a loss-scale optimizer).
      dynamic: bool; False gives a fixed scale (``initial_scale`` required), which never
        skips, as TensorFlow.
      initial_scale: default 2**15 when dynamic.
      dynamic_growth_steps: default 2000 when dynamic; None when not.
      min_loss_scale, max_loss_scale, hysteresis, hysteresis_refill: keyword-only extensions
        (TensorFlow's behaviour at their defaults; see :func:`lossscale.core.dynamic_rule`).
      stall_steps, on_stall: the stall alarm (see :func:`lossscale.core.stall_alarm`),
        checked when the state is read on the host (``dynamic_counter``, ``check_stall()``).
      name: the optimizer's name; the other keywords Keras 3's own LossScaleOptimizer accepts
        in saved configs are accepted at their defaults.

    For example, a finite step applies; an overflowing one is skipped and halves the scale:

    >>> import numpy as np, keras
    >>> from lossscale.keras import LossScaleOptimizer
    >>> opt = LossScaleOptimizer(keras.optimizers.SGD(0.5), initial_scale=8.0)
    >>> w = keras.Variable(np.array([1.0, 2.0], np.float32))
    >>> opt.apply([keras.ops.convert_to_tensor(np.array([16.0, 32.0], np.float32))], [w])
    >>> keras.ops.convert_to_numpy(w).tolist(), float(keras.ops.convert_to_numpy(opt.loss_scale))
    ([0.0, 0.0], 8.0)
    >>> opt.apply([keras.ops.convert_to_tensor(np.array([np.inf, 1.0], np.float32))], [w])
    >>> keras.ops.convert_to_numpy(w).tolist(), float(keras.ops.convert_to_numpy(opt.loss_scale))
    ([0.0, 0.0], 4.0)

    A skipped step leaves the model's variables and the inner optimizer's variables (slots and
    ``iterations``) bit-identical: ``iterations`` counts applied steps only, on every backend
    (Keras 3's choice; TensorFlow's counted skipped steps too), so learning-rate schedules do
    not advance on skipped steps. Device: the check, the unscale and the rule are a few fused
    backend ops inside the train step; no host sync.
    """

    def __init__(
        self,
        inner_optimizer: Any,
        dynamic: Any = True,
        initial_scale: Any = None,
        dynamic_growth_steps: Any = None,
        *,
        min_loss_scale: Any = 1.0,
        max_loss_scale: Any = EXTENSION_DEFAULTS["max_loss_scale"],
        hysteresis: Any = 1,
        hysteresis_refill: Any = "on_backoff",
        stall_steps: Any = DEFAULT_STALL_STEPS,
        on_stall: Any = "warn",
        name: str | None = None,
        **kwargs: Any,
    ) -> None:
        settings = scale_settings(
            dynamic,
            initial_scale,
            dynamic_growth_steps,
            min_loss_scale=min_loss_scale,
            max_loss_scale=max_loss_scale,
            hysteresis=hysteresis,
            hysteresis_refill=hysteresis_refill,
        )
        self._setup(inner_optimizer, settings, stall_steps, on_stall, name, kwargs)

    def _setup(
        self,
        inner_optimizer: Any,
        settings: ScaleSettings,
        stall_steps: Any,
        on_stall: Any,
        name: str | None,
        kwargs: dict[str, Any],
    ) -> None:
        if not isinstance(inner_optimizer, keras.optimizers.Optimizer):
            raise TypeError(
                f'"inner_optimizer" must be a keras.optimizers.Optimizer, got {inner_optimizer!r}'
            )
        if isinstance(inner_optimizer, _KERAS_LSO):
            raise TypeError(
                "LossScaleOptimizer cannot wrap another loss-scale optimizer, got "
                f"{inner_optimizer!r}"
            )
        if getattr(inner_optimizer, "_lossscale_wrapped", False):
            raise ValueError(
                '"inner_optimizer" is already wrapped by a LossScaleOptimizer; an optimizer can '
                "only be wrapped by one"
            )
        for key, default in _BASE_DEFAULTS.items():
            if key in kwargs and kwargs.pop(key) != default:
                raise ValueError(
                    f"LossScaleOptimizer does not support {key!r}; set it on the inner optimizer"
                )
        if kwargs:
            raise TypeError(f"LossScaleOptimizer got unexpected keyword arguments {sorted(kwargs)}")
        alarm = stall_alarm(stall_steps, on_stall)
        # Keras's Optimizer, not Keras's LossScaleOptimizer: its constructor refuses a fixed
        # scale; the state and the update are this class's own.
        keras.optimizers.Optimizer.__init__(self, learning_rate=0.0, name=name)
        self.inner_optimizer = inner_optimizer
        self._settings = settings
        self._alarm = alarm
        self._stall_warned = False
        self._unscaled_ids: set[int] = set()
        self.initial_scale = settings.initial_scale
        self.dynamic_growth_steps = (
            None if settings.rule is None else settings.rule.increment_period
        )
        inner_optimizer.loss_scale_factor = None  # the inner optimizer must not scale again
        inner_optimizer._lossscale_wrapped = True

    # -- state ------------------------------------------------------------------------------
    def build(self, var_list: list[Any]) -> None:
        """Create the scale's variables (the scale, the two counters, the stall count) and
        build the inner optimizer."""

        def variable(name: str, dtype: str, value: float) -> Any:
            return self.add_variable(
                shape=(),
                dtype=dtype,
                initializer=keras.initializers.Constant(value),
                aggregation="none",
                name=name,
            )

        self.dynamic_scale = variable("dynamic_scale", "float32", self.initial_scale)
        self.step_counter = variable("step_counter", "int32", 0)  # TF's good_steps
        self.nonfinite_steps = variable("nonfinite_steps", "int32", 0)
        self.stalled_steps = variable("stalled_steps", "int32", 0)
        self.inner_optimizer.build(var_list)
        keras.optimizers.Optimizer.build(self, var_list)

    def _own_values(self) -> list[Any]:
        return [self.dynamic_scale, self.step_counter, self.nonfinite_steps, self.stalled_steps]

    def _advance(self, finite: Any) -> None:
        """Advance the scale by the core rule (dynamic only) and the stall count (no sync)."""
        rule = self._settings.rule
        if rule is None:
            return
        scale = ops.convert_to_tensor(self.dynamic_scale)
        state = DynamicState(
            scale,
            ops.convert_to_tensor(self.step_counter),
            ops.convert_to_tensor(self.nonfinite_steps),
        )
        stalled = stall_update(
            ops.convert_to_tensor(self.stalled_steps), finite, scale, rule, KERAS
        )
        new = dynamic_update(state, finite, rule, KERAS)
        self.dynamic_scale.assign(new.loss_scale)
        self.step_counter.assign(new.good_steps)
        self.nonfinite_steps.assign(new.nonfinite_steps)
        self.stalled_steps.assign(stalled)

    # -- TensorFlow's attributes ----------------------------------------------------------------
    @property
    def dynamic(self) -> bool:
        """Whether the loss scale is dynamic."""
        return self._settings.dynamic

    @property
    def loss_scale(self) -> Any:
        """The current scale, a float32 backend tensor (the initial scale before ``build``)."""
        if not self.built:
            return ops.convert_to_tensor(self.initial_scale, "float32")
        return ops.convert_to_tensor(self.dynamic_scale)

    @property
    def dynamic_counter(self) -> int | None:
        """Consecutive finite steps toward the next growth (Python int; None when fixed).
        Reads the state (a host sync on a GPU) and runs the stall alarm's check."""
        if not self.dynamic:
            return None
        if not self.built:
            return 0
        self.check_stall()
        return int(ops.convert_to_numpy(self.step_counter))

    def check_stall(self) -> None:
        """The stall alarm's host-side check (reads two scalars: a host sync on a GPU)."""
        if not self.built or self._settings.rule is None:
            return
        count = int(ops.convert_to_numpy(self.stalled_steps))
        scale = float(ops.convert_to_numpy(self.dynamic_scale))
        self._stall_warned = report_stall(
            count,
            scale,
            self._alarm,
            warned=self._stall_warned,
            where="LossScaleOptimizer",
            stacklevel=4,
        )

    # -- scaling --------------------------------------------------------------------------
    def scale_loss(self, loss: Any) -> Any:
        """Keras 3's trainer protocol: ``loss * scale`` in at least float32."""
        return self.get_scaled_loss(loss)

    def get_scaled_loss(self, loss: Any) -> Any:
        """``loss * loss_scale``; a float16/bfloat16 loss comes back float32 (TensorFlow's
        float16 cast overflows to inf). A callable returns a callable."""
        if callable(loss) and not ops.is_tensor(loss):
            fn: Callable[[], Any] = loss
            return lambda: self.get_scaled_loss(fn())
        loss = ops.convert_to_tensor(loss)
        if str(loss.dtype).removeprefix("torch.") in _HALF or "float16" in str(loss.dtype):
            loss = ops.cast(loss, "float32")
        return ops.multiply(loss, ops.cast(self.loss_scale, loss.dtype))

    def get_unscaled_gradients(self, grads: Iterable[Any]) -> list[Any]:
        """New tensors ``g * (1 / loss_scale)`` in each gradient's dtype, as TensorFlow: the
        float32 reciprocal, in float32 math for float16/bfloat16/float32 gradients and in
        float64 math for float64 ones (no precision lost, no float32 overflow); ``None`` kept.
        ``apply_gradients`` recognises them and does not unscale again."""
        inv = ops.divide(1.0, ops.cast(self.loss_scale, "float32"))
        out = [None if g is None else _unscale_one(g, inv) for g in grads]
        self._unscaled_ids = {id(g) for g in out if g is not None}
        return out

    def _grads_are_unscaled(self, grads: list[Any]) -> bool:
        present = [g for g in grads if g is not None]
        marked = [id(g) in self._unscaled_ids for g in present]
        self._unscaled_ids = set()
        if any(marked) and not all(marked):
            raise ValueError(
                "apply_gradients got a mix of gradients from get_unscaled_gradients (unscaled) "
                "and others (scaled by scale_loss/get_scaled_loss): pass all of one kind"
            )
        return bool(present) and all(marked)

    def _unscale(self, grads: list[Any], already: bool) -> list[Any]:
        if already or (not self.dynamic and self.initial_scale == 1):
            return list(grads)
        inv = ops.divide(1.0, ops.cast(self.dynamic_scale, "float32"))
        return [None if g is None else _unscale_one(g, inv) for g in grads]

    # -- the step -------------------------------------------------------------------------------
    def check_finite(self, grads: list[Any]) -> Any:
        """0-d bool backend tensor: whether every gradient is finite (no sync)."""
        flags = [ops.all(ops.isfinite(g)) for g in grads if g is not None]
        if not flags:
            return ops.convert_to_tensor(True)
        return ops.all(ops.stack(flags))

    def apply(self, grads: Any, trainable_variables: Any = None) -> None:
        """Check, unscale (unless ``get_unscaled_gradients`` did), apply the inner optimizer when
        every gradient is finite (always, for a fixed scale), and advance the scale."""
        grads = list(grads)
        if not getattr(self, "built", False):
            self.build(trainable_variables)
            self.built = True
        already = self._grads_are_unscaled(grads)
        if keras.backend.backend() == "tensorflow":
            self._tf_apply(grads, trainable_variables, already)
        else:
            self._common_apply(grads, trainable_variables, already)

    def _common_apply(
        self, grads: list[Any], trainable_variables: Any, already: bool = False
    ) -> None:
        unscaled = self._unscale(grads, already)
        if not self.dynamic:
            self.inner_optimizer.apply(unscaled, trainable_variables=trainable_variables)
            return
        # judged on what the inner optimizer would apply, as TensorFlow (a scaled gradient can be
        # finite while its unscaled value is not)
        finite = self.check_finite(unscaled)

        def apply_inner() -> None:
            self.inner_optimizer.apply(unscaled, trainable_variables=trainable_variables)

        if keras.backend.backend() == "jax":
            # JAX's eager apply (custom loops; the JAX trainer uses stateless_apply): a traced
            # cond cannot assign variables, so the decision is read on the host (one sync)
            if bool(ops.convert_to_numpy(finite)):
                apply_inner()
        else:
            ops.cond(finite, apply_inner, lambda: None)
        self._advance(finite)

    def _tf_apply(self, grads: list[Any], trainable_variables: Any, already: bool = False) -> None:
        import tensorflow as tf

        if not tf.distribute.has_strategy() or (
            tf.__internal__.distribute.strategy_supports_no_merge_call()
        ):
            self._common_apply(grads, trainable_variables, already)
            return

        def cross_replica(distribution: Any, grads: Any, trainable_variables: Any) -> None:
            # the gradients are all-reduced already, so every replica computes the same flag
            finite_per_replica = distribution.extended.call_for_each_replica(
                lambda g: self.check_finite(self._unscale(g, already)), args=(grads,)
            )
            finite = distribution.experimental_local_results(finite_per_replica)[0]

            def apply_fn() -> None:
                distribution.extended.call_for_each_replica(
                    lambda g, v: self.inner_optimizer.apply(
                        self._unscale(g, already), trainable_variables=v
                    ),
                    args=(grads, trainable_variables),
                )

            if self.dynamic:
                ops.cond(finite, apply_fn, lambda: None)
                self._advance(finite)
            else:
                apply_fn()

        tf.distribute.get_replica_context().merge_call(
            cross_replica, args=(grads, trainable_variables)
        )

    def stateless_apply(
        self, optimizer_variables: list[Any], grads: list[Any], trainable_variables: list[Any]
    ) -> tuple[list[Any], list[Any]]:
        """JAX's trainer protocol: the same step on explicit variable values."""
        if not self.built:
            raise ValueError(
                "To call `stateless_apply`, LossScaleOptimizer must be built: call "
                "optimizer.build(trainable_variables) first"
            )
        grads = list(grads)
        already = self._grads_are_unscaled(grads)
        mapping = list(zip(self.variables, optimizer_variables, strict=True))
        with keras.StatelessScope(state_mapping=mapping) as scope:
            unscaled = self._unscale(grads, already)
            inner_values = [scope.get_current_value(v) for v in self.inner_optimizer.variables]

            def apply_inner() -> tuple[list[Any], list[Any]]:
                new_vars, new_inner = self.inner_optimizer.stateless_apply(
                    inner_values, unscaled, trainable_variables
                )
                return list(new_vars), list(new_inner)

            if self.dynamic:
                finite = self.check_finite(unscaled)
                new_vars, new_inner = ops.cond(
                    finite, apply_inner, lambda: (list(trainable_variables), inner_values)
                )
                self._advance(finite)
            else:
                new_vars, new_inner = apply_inner()
            own = [scope.get_current_value(v) for v in self._variables]
        return new_vars, own + new_inner

    # -- config -----------------------------------------------------------------------------------
    def get_config(self) -> dict[str, Any]:
        """TensorFlow's keys (``inner_optimizer``, ``dynamic``, ``initial_scale``,
        ``dynamic_growth_steps``) and ``name``; the extensions when not at their defaults."""
        config: dict[str, Any] = {
            "name": self.name,
            "inner_optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
            "dynamic": self.dynamic,
            "initial_scale": self.initial_scale,
            "dynamic_growth_steps": self.dynamic_growth_steps,
        }
        config.update(extension_config(self._settings.rule, self._alarm))
        return config

    @classmethod
    def from_config(cls, config: dict[str, Any], custom_objects: Any = None) -> LossScaleOptimizer:
        """Load a config written by this class, by Keras 3's own LossScaleOptimizer (no
        ``dynamic``: dynamic), by tf_keras / TensorFlow 2.4+, or by TensorFlow ≤ 2.3
        (``optimizer`` + ``loss_scale``; see :func:`lossscale.core.upgrade_optimizer_config`)."""
        config = upgrade_optimizer_config(config)
        inner_config = config.pop("inner_optimizer")
        if isinstance(inner_config, dict) and inner_config.get("module") in _TF_KERAS_MODULES:
            # tf_keras / TensorFlow 2.x: a built-in optimizer by class name (and its module)
            inner = keras.optimizers.deserialize(
                _keras3_optimizer_config(inner_config), custom_objects=custom_objects
            )
        else:
            inner = keras.saving.deserialize_keras_object(
                inner_config, custom_objects=custom_objects
            )
        return cls(inner, **config)
