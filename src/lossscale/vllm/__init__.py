"""The float16 audit's plan inside vLLM: float16 rollouts that compute as the trainer does.

::

    LOSSSCALE_PLAN=plan.json python my_rollouts.py   # vllm.LLM(..., dtype="float16")

lossscale registers a ``vllm.general_plugins`` entry point, which vLLM loads in every process
that builds a model (the front end, the engine core, its workers). With ``LOSSSCALE_PLAN``
naming a plan saved by :meth:`lossscale.torch.Float16Audit.save`, an engine started in
float16 (``dtype="float16"``, or ``"auto"``, which becomes float16) computes as
``torch.autocast`` computes the model with the plan applied: the plan's modules in float32
with float32 weights loaded unrounded from the checkpoint, every other matmul in float16, the
residual stream and the norms (their weights too) in float32. Attention and its KV cache stay
in float16 (vLLM has one dtype for them). A plan module that vLLM fuses with others (``q_proj``
in ``qkv_proj``, ``gate_proj`` in ``gate_up_proj``) keeps the fused module (logged once).
Weights pushed in with ``reload_weights`` keep these dtypes. vLLM's own float16 refusal of
Gemma 2 and 3 (their float16 residual stream) is lifted for a planned engine. Without the
variable nothing changes; vLLM's ``VLLM_PLUGINS`` without ``lossscale`` leaves the plugin out
with the variable set (a trainer keeping the plan beside bfloat16 rollouts). Importing this
package imports torch and vLLM (``import lossscale`` alone never does).

Raises (at engine build, with ``LOSSSCALE_PLAN`` set):
  ImportError: the vLLM release is not 0.32.x (the entry point itself loads on any release,
    so that an engine without the variable is never touched).
  ValueError: the engine's dtype is not float16; the file is not a plan; the architecture is
    not LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, Gemma2ForCausalLM or
    Gemma3ForCausalLM; the model lacks one of the plan's modules (naming it).
"""

from lossscale._extras import require

require("vllm", "PyTorch and vLLM", "vllm", "torch", "vllm")


from lossscale.vllm._hooks import check_version, install, plan_path
from lossscale.vllm._model import resolve


def register() -> None:
    """The ``vllm.general_plugins`` entry point: on a supported vLLM, wrap its model config
    and loader (:func:`install`: each reads ``LOSSSCALE_PLAN`` when an engine is built, and
    does what vLLM's does without it); on another, nothing unless the variable is set.

    Raises:
      ImportError: ``LOSSSCALE_PLAN`` is set and vLLM is not 0.32.x.

    Example:
      >>> import lossscale.vllm
      >>> lossscale.vllm.register()  # what vLLM calls in each of its processes
    """
    import vllm

    try:
        check_version(vllm.__version__)
    except ImportError:
        if plan_path() is not None:
            raise
        return
    install()


__all__ = ["check_version", "register", "resolve"]
