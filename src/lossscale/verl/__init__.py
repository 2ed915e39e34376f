"""verl's FSDP engines on lossscale's scaler: name this module where verl imports modules.

::

    VERL_USE_EXTERNAL_MODULES=lossscale.verl python -m verl.trainer.main_ppo \\
        +actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=fp16 \\
        actor_rollout_ref.rollout.dtype=float16 ...

``import verl`` imports every module named in ``VERL_USE_EXTERNAL_MODULES``, in the driver and
in every Ray worker (``actor_rollout_ref.model.external_lib=lossscale.verl`` works too, in the
workers that build a model). Importing this package imports torch and verl (``import
lossscale`` alone never does) and wraps five methods of verl 0.9's ``FSDPEngine``: its engines
build :class:`ShardedGradScaler` where verl builds torch's (verl's arguments kept, the
environment's settings over them), the scale is saved with verl's checkpoints and restored on
resume, and a training step whose optimizer steps were all skipped does not advance verl's LR
schedule. Settings, from the environment (each read when an engine is built, and checked on
import): ``LOSSSCALE_INIT_SCALE``, ``LOSSSCALE_GROWTH_INTERVAL``, ``LOSSSCALE_MIN_LOSS_SCALE``,
``LOSSSCALE_MAX_LOSS_SCALE``, ``LOSSSCALE_HYSTERESIS``.

Raises (on import):
  ImportError: verl is missing or is not 0.9.x.
  ValueError: one of those variables is malformed or out of range (naming it).
"""

from lossscale._extras import require

require("verl", "PyTorch and verl", "verl", "torch", "verl")


from lossscale.verl._patch import checkpoint_file, is_patched, patch, settings, unpatch
from lossscale.verl._scaler import ShardedGradScaler
from lossscale.verl._settings import Settings

patch()

__all__ = [
    "Settings",
    "ShardedGradScaler",
    "checkpoint_file",
    "is_patched",
    "patch",
    "settings",
    "unpatch",
]
