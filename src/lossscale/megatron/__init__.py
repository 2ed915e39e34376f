"""Megatron-core's grad scalers on lossscale's rule, and one scale for a chained optimizer.

``DynamicGradScaler`` and ``ConstantGradScaler`` take Megatron-core's arguments in its order,
offer its ``scale`` / ``inv_scale`` / ``update(found_inf)`` / ``state_dict`` (its keys, both
ways), and add lossscale's ceiling (``max_scale``) and stall alarm.

Importing this package imports torch (``import lossscale`` alone never does); it does not
import megatron-core.
"""

from lossscale._extras import require

require("megatron", "PyTorch", "torch", "torch")  # the extra named when torch is missing


from lossscale.megatron._scaler import ConstantGradScaler, DynamicGradScaler  # noqa: E402

__all__ = ["ConstantGradScaler", "DynamicGradScaler"]
