"""lossscale's rule behind DeepSpeed's loss-scaler interface, on the host.

DeepSpeed decides a step on the host: its optimizers reduce the overflow flag over the data- and
model-parallel groups (``all_reduce(MAX)``) and read it with ``.item()`` before they call
``loss_scaler.update_scale(overflow)``. :class:`DeepSpeedLossScaler` therefore keeps the scale
and its counters as host numbers and runs :func:`lossscale.core.dynamic_update` on NumPy
scalars: no device work, no extra sync, the same decision on every rank.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from lossscale.core import (
    DEFAULT_STALL_STEPS,
    DynamicRule,
    DynamicState,
    scale_settings,
    stall_alarm,
)
from lossscale.core import _validation as v
from lossscale.core._checkpoint import read_dynamic_state, read_fixed_state, scale_state_dict
from lossscale.core._host import check_host_stall, fresh_host_state, host_state, host_step
from lossscale.core._settings import extension_config

#: ``state_dict()`` keys besides the scale's own checkpoint dict.
_SKIPPED = "skipped_steps"


def _skipped_count(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 0:
        raise ValueError(f"{key} must be an int >= 0, got {value!r}")
    return int(value)


class DeepSpeedLossScaler:
    """A loss scaler for DeepSpeed's engines with lossscale's rule: a floor that never raises, a
    ceiling, hysteresis in DeepSpeed's modes, TensorFlow's growth timing and a stall alarm.

    :func:`lossscale.deepspeed.install` builds one from the engine's ``fp16`` config (and its
    keywords) and puts it where the engine calls its scaler; ``install`` takes no scaler, so
    build one yourself only for code that drives DeepSpeed's scaler interface directly. It has
    DeepSpeed's interface (``cur_scale``, ``loss_scale``, ``dynamic``, ``scale_loss``,
    ``backward``, ``update_scale``), satisfies :class:`lossscale.torch.ScaleReader`, and pickles
    with its state, as DeepSpeed's checkpoints of ZeRO stages 1-3 require.

    The rule is :class:`lossscale.core.DynamicRule`'s. The arguments are those of
    :class:`lossscale.torch.LossScaleOptimizer` (TensorFlow's names): ``dynamic``,
    ``initial_scale`` (default 2**15), ``dynamic_growth_steps`` (default 2000) and the
    keyword-only ``min_loss_scale`` (any float > 0), ``max_loss_scale``, ``hysteresis``,
    ``hysteresis_refill``, ``stall_steps`` and ``on_stall``. A fixed scale
    (``dynamic=False``) never changes; DeepSpeed still skips the steps that overflow.

    Host and device: every method works on Python numbers; ``scale_loss`` is one multiply
    kernel. Nothing here syncs: DeepSpeed has read the overflow flag before ``update_scale``.
    The stall alarm watches a dynamic scale only (a fixed one cannot back off).

    Raises:
      TypeError, ValueError: an argument of the wrong type or out of range, naming it.

    Example:
      >>> from lossscale.deepspeed import DeepSpeedLossScaler
      >>> scaler = DeepSpeedLossScaler(initial_scale=4.0, min_loss_scale=0.5, hysteresis=2,
      ...                              hysteresis_refill="on_growth")
      >>> for overflow in (True, True, True, True, False):
      ...     scaler.update_scale(overflow)
      ...     print(scaler.cur_scale, end=" ")
      4.0 2.0 1.0 0.5 0.5
      >>> scaler.skipped_steps
      4
    """

    def __init__(
        self,
        dynamic: Any = True,
        initial_scale: Any = None,
        dynamic_growth_steps: Any = None,
        *,
        min_loss_scale: Any = 1.0,
        max_loss_scale: Any = v.FLOAT32_MAX,
        hysteresis: Any = 1,
        hysteresis_refill: Any = "on_backoff",
        stall_steps: Any = DEFAULT_STALL_STEPS,
        on_stall: Any = "warn",
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
        self._settings = settings
        self._alarm = stall_alarm(stall_steps, on_stall)
        self._state: DynamicState | None = (
            fresh_host_state(settings.initial_scale, settings.rule) if settings.rule else None
        )
        self._skipped = 0
        self._stalled = 0
        self._warned = False
        self._last_applied = True

    # -- DeepSpeed's interface ------------------------------------------------------------
    @property
    def dynamic(self) -> bool:
        """Whether the scale changes (DeepSpeed's ``loss_scaler.dynamic``)."""
        return self._settings.dynamic

    @property
    def cur_scale(self) -> float:
        """The current scale, a Python float (a float32 value), as DeepSpeed reads it."""
        if self._state is None:
            return self._settings.initial_scale
        return float(self._state.loss_scale)

    @cur_scale.setter
    def cur_scale(self, value: Any) -> None:
        """Set the scale (DeepSpeed's ``optimizer.loss_scale = x``); the counters are kept.

        Raises:
          TypeError, ValueError: not a real number, not finite and > 0, above
            ``max_loss_scale``, or any change of a fixed scale; nothing changes.
        """
        if self._state is None:
            read_fixed_state(scale_state_dict(v.real("cur_scale", value)), self.cur_scale)
            return
        rule = self._settings.rule
        assert rule is not None
        scale = v.scale_at_most("cur_scale", value, rule.max_loss_scale, "max_loss_scale")
        self._state = self._state._replace(loss_scale=np.float32(scale))

    @property
    def loss_scale(self) -> float:
        """The current scale (DeepSpeed's name), a Python float."""
        return self.cur_scale

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * cur_scale``; a float16/bfloat16 loss comes back float32 (so that the product
        cannot overflow in half precision). One multiply kernel, no sync."""
        if loss.dtype in (torch.float16, torch.bfloat16):
            loss = loss.float()
        return loss * self.cur_scale

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> None:
        """``scale_loss(loss).backward(retain_graph=retain_graph)``, as DeepSpeed's scalers."""
        self.scale_loss(loss).backward(retain_graph=retain_graph)  # type: ignore[no-untyped-call]

    def update_scale(self, overflow: Any) -> None:
        """One step of the rule, given DeepSpeed's decision: ``overflow`` True means the engine
        skips this step (a non-finite gradient, or a non-finite gradient norm).

        Counts the skip, backs off (never below ``min_loss_scale``, never an exception) or
        grows, and runs the stall alarm: after ``stall_steps`` skipped steps in a row at the
        floor it warns once (``LossScaleStalledWarning``) or raises
        (``LossScaleStalledError``). Pure host work on Python numbers.

        Raises:
          TypeError: ``overflow`` is not a bool (Python, NumPy, or a one-element bool tensor,
            which is read: a host sync on an accelerator).
        """
        if isinstance(overflow, torch.Tensor) and overflow.numel() == 1:
            overflow = bool(overflow.item())
        if not isinstance(overflow, bool | np.bool_):
            raise TypeError(f"overflow must be a bool, got {overflow!r}")
        finite = not overflow
        self._last_applied = finite
        if not finite:
            self._skipped += 1
        rule = self._settings.rule
        if self._state is None or rule is None:
            return  # a fixed scale: nothing to update, no stall alarm (it cannot back off)
        used = float(self._state.loss_scale)
        self._state, self._stalled = host_step(self._state, finite, rule, self._stalled)
        self._warned = check_host_stall(
            self._stalled, used, self._alarm, warned=self._warned, where="DeepSpeed"
        )

    # -- lossscale's additions ------------------------------------------------------------
    @property
    def rule(self) -> DynamicRule | None:
        """The dynamic rule's settings (:class:`lossscale.core.DynamicRule`); None when fixed."""
        return self._settings.rule

    @property
    def skipped_steps(self) -> int:
        """Steps skipped since the start (restored from checkpoints)."""
        return self._skipped

    @property
    def last_step_applied(self) -> bool:
        """Whether the last step the engine decided was applied."""
        return self._last_applied

    def read_last_step_applied(self) -> bool:
        """:attr:`last_step_applied` (a host bool already: no sync). True before any step."""
        return self._last_applied

    def current_loss_scale(self) -> float:
        """:attr:`cur_scale`, the scale on the host, a Python float. With
        :meth:`read_last_step_applied`, what :class:`lossscale.torch.ScaleReader` reads."""
        return self.cur_scale

    @property
    def num_good_steps(self) -> int:
        """Consecutive finite steps counted toward the next growth (0 for a fixed scale)."""
        return 0 if self._state is None else int(self._state.good_steps)

    @property
    def num_nonfinite_steps(self) -> int:
        """The hysteresis allowance spent (see :class:`lossscale.core.DynamicRule`)."""
        return 0 if self._state is None else int(self._state.nonfinite_steps)

    def get_config(self) -> dict[str, Any]:
        """The constructor arguments that rebuild this scaler (its stall alarm included)."""
        s = self._settings
        config: dict[str, Any] = {"dynamic": s.dynamic, "initial_scale": s.initial_scale}
        if s.rule is not None:
            config["dynamic_growth_steps"] = s.rule.increment_period
        config.update(extension_config(s.rule, self._alarm))
        return config

    def state_dict(self) -> dict[str, Any]:
        """``{'loss_scale': <lossscale's scale checkpoint dict>, 'skipped_steps': int}``: plain
        Python numbers, loadable with ``torch.load(weights_only=True)``."""
        counters = None
        if self._state is not None:
            counters = (self.num_good_steps, self.num_nonfinite_steps)
        return {"loss_scale": scale_state_dict(self.cur_scale, counters), _SKIPPED: self._skipped}

    def load_state_dict(self, state_dict: Any) -> None:
        """Load :meth:`state_dict`'s dict, checked against this scaler's settings first.

        Raises:
          ValueError: naming the key, for a malformed dict, one of a fixed scale into a dynamic
            one (or the reverse), a counter outside this scaler's ranges, or a scale above
            ``max_loss_scale``; nothing changes.
        """
        if not isinstance(state_dict, dict) or set(state_dict) != {"loss_scale", _SKIPPED}:
            raise ValueError(
                "state_dict must be DeepSpeedLossScaler.state_dict()'s dict, with keys "
                f"['loss_scale', 'skipped_steps'], got {state_dict!r}"
            )
        skipped = _skipped_count(state_dict[_SKIPPED], "state_dict['skipped_steps']")
        rule = self._settings.rule
        if rule is None:
            read_fixed_state(state_dict["loss_scale"], self.cur_scale)
        else:
            scale, good, nonfinite = read_dynamic_state(state_dict["loss_scale"], rule)
            self.load_counters(scale, good, nonfinite)
        self._skipped = skipped

    def load_counters(self, scale: float, good_steps: int, nonfinite_steps: int) -> None:
        """Set the scale and the rule's two counters (already checked); the stall count
        restarts."""
        assert self._settings.rule is not None
        self._state = host_state(scale, good_steps, nonfinite_steps)
        self._stalled, self._warned = 0, False

    def __getstate__(self) -> dict[str, Any]:
        """Pickled as plain Python values: its config and :meth:`state_dict`."""
        return {"config": self.get_config(), "state": self.state_dict()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state["config"])  # type: ignore[misc]
        self.load_state_dict(state["state"])

    def __repr__(self) -> str:
        return (
            f"DeepSpeedLossScaler(cur_scale={self.cur_scale!r}, dynamic={self.dynamic}, "
            f"skipped_steps={self._skipped})"
        )
