"""Megatron-core's grad scalers on lossscale's rule, and one scale for a chained optimizer.

``DynamicGradScaler`` and ``ConstantGradScaler`` take Megatron-core's arguments in its order,
offer its ``scale`` / ``inv_scale`` / ``update(found_inf)`` / ``state_dict`` (its keys, both
ways), and add lossscale's ceiling (``max_scale``) and stall alarm. ``share_grad_scaler``
gives every sub-optimizer of ``get_megatron_optimizer``'s result one scaler, updated once per
step with the flag agreed over all of them::

    from lossscale.megatron import share_grad_scaler
    optimizer = get_megatron_optimizer(config, model_chunks)
    share_grad_scaler(optimizer)        # Megatron's settings and state, one decision per step

Importing this package imports torch (``import lossscale`` alone never does); it does not
import megatron-core.
"""

from lossscale._extras import require

require("megatron", "PyTorch", "megatron", "torch")  # the extra named when torch is missing


from lossscale.megatron._chained import share_grad_scaler
from lossscale.megatron._scaler import ConstantGradScaler, DynamicGradScaler

__all__ = ["ConstantGradScaler", "DynamicGradScaler", "share_grad_scaler"]
