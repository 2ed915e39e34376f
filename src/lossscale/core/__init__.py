"""The functional core: the pure dynamic update rule over an array namespace.

Use this directly in hand-written or traced training loops (``jax.jit``, ``torch.compile``);
the stateful classes (:class:`lossscale.DynamicLossScale`) and the framework adapters are thin
layers over these functions.
"""

from lossscale.core._backends import ArrayNamespace, namespace_of
from lossscale.core._rule import (
    HYSTERESIS_REFILLS,
    DynamicRule,
    DynamicState,
    dynamic_rule,
    dynamic_state,
    dynamic_update,
)
from lossscale.core._settings import (
    ScaleSettings,
    fixed_value,
    loss_scale_settings,
    scale_settings,
    upgrade_optimizer_config,
)
from lossscale.core._stall import (
    DEFAULT_STALL_STEPS,
    LossScaleStalledError,
    LossScaleStalledWarning,
    StallAlarm,
    report_stall,
    stall_alarm,
    stall_update,
)
from lossscale.core._tree import Leaves, all_finite, flatten_grads
from lossscale.core._validation import FLOAT32_MAX

__all__ = [
    "DEFAULT_STALL_STEPS",
    "FLOAT32_MAX",
    "HYSTERESIS_REFILLS",
    "ArrayNamespace",
    "DynamicRule",
    "DynamicState",
    "Leaves",
    "LossScaleStalledError",
    "LossScaleStalledWarning",
    "ScaleSettings",
    "StallAlarm",
    "all_finite",
    "dynamic_rule",
    "dynamic_state",
    "dynamic_update",
    "fixed_value",
    "flatten_grads",
    "loss_scale_settings",
    "namespace_of",
    "report_stall",
    "scale_settings",
    "stall_alarm",
    "stall_update",
    "upgrade_optimizer_config",
]
