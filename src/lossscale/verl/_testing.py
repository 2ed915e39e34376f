"""Test helpers: verl's FSDP engine built on the CPU (a CPU platform registered with verl's
platform plugin API, gloo), a tiny Llama saved from a config, a batch in verl's layout, and a
loss that overflows on demand."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch

from lossscale._testing import free_port


def cpu_platform() -> Any:
    """A verl platform for the CPU (verl 0.9 has none: ``get_device_name()`` answers
    ``"cuda"`` without one), registered with ``set_platform``: devices are ``"cpu"``,
    collectives gloo. Returns the platform."""
    from verl.plugin.platform import platform_manager
    from verl.plugin.platform.platform_base import PlatformBase

    class CPUPlatform(PlatformBase):  # type: ignore[misc]
        device_name = "cpu"
        vendor_name = "cpu"
        device_module = torch.cpu

        def is_available(self) -> bool:
            return False  # no accelerator: verl's checkpoints keep only the CPU's RNG state

        def is_platform_available(self, use_smi_check: bool = False) -> bool:
            return True

        def current_device(self) -> Any:
            return torch.device("cpu")

        def device_count(self) -> int:
            return 1

        def set_device(self, device_index: int) -> None:
            pass

        def synchronize(self, device_index: int | None = None) -> None:
            pass

        def manual_seed(self, seed: int) -> None:
            torch.manual_seed(seed)

        def manual_seed_all(self, seed: int) -> None:
            torch.manual_seed(seed)

        def set_allocator_settings(self, settings: str) -> None:
            pass

        def empty_cache(self) -> None:
            pass

        def get_device_capability(self, device_index: int = 0) -> tuple[None, None]:
            return None, None

        def communication_backend_name(self) -> str:
            return "gloo"

        def visible_devices_envvar(self) -> str:
            return "CUDA_VISIBLE_DEVICES"

        def nvtx_range(self, msg: str) -> Any:
            return contextlib.nullcontext()

        def profiler_start(self) -> None:
            pass

        def profiler_stop(self) -> None:
            pass

        def ray_resource_name(self) -> str:
            return "CPU"

        def ray_noset_envvars(self) -> list[str]:
            return []

        def is_ipc_supported(self) -> bool:
            return False

        def cudart(self) -> Any:
            return None

    platform = CPUPlatform()
    platform_manager.set_platform(platform)
    return platform


def cuda_platform() -> Any:
    """verl's own CUDA platform (``"nvidia"``), set as the current one (after a test that set
    :func:`cpu_platform` in the same process). Returns it."""
    from verl.plugin.platform import platform_manager

    platform = platform_manager.PlatformRegistry.get("nvidia")()
    platform_manager.set_platform(platform)
    return platform


@contextlib.contextmanager
def process_group(backend: str = "gloo") -> Iterator[None]:
    """A one-process group on 127.0.0.1 (a free port) for the block."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(free_port())
    torch.distributed.init_process_group(backend, rank=0, world_size=1)
    try:
        yield
    finally:
        torch.distributed.destroy_process_group()


@contextlib.contextmanager
def cpu_fsdp1() -> Iterator[None]:
    """verl's FSDP1 calls changed for the CPU, for the block: its ``FSDP(...)`` call with
    ``sync_module_states=False`` and ``device_id=cpu`` (torch's FSDP1 syncs module states on an
    accelerator only), and no move of the model "to the GPU" before a save (verl formats
    ``cpu:cpu`` there). The rest of verl's FSDP1 path runs as written."""
    from verl.workers.engine.fsdp import transformer_impl

    class CPUFSDP(transformer_impl.FSDP):  # type: ignore[misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs.update(sync_module_states=False, device_id=torch.device("cpu"))
            super().__init__(*args, **kwargs)

    saved = transformer_impl.FSDP, transformer_impl.load_fsdp_model_to_gpu
    transformer_impl.FSDP = CPUFSDP
    transformer_impl.load_fsdp_model_to_gpu = lambda module: None
    try:
        yield
    finally:
        transformer_impl.FSDP, transformer_impl.load_fsdp_model_to_gpu = saved


def on_cpu(strategy: str) -> contextlib.AbstractContextManager[None]:
    """What ``strategy`` (``"fsdp"`` or ``"fsdp2"``) needs to run on the CPU: FSDP1's
    :func:`cpu_fsdp1`; nothing for FSDP2."""
    return cpu_fsdp1() if strategy == "fsdp" else contextlib.nullcontext()


def dtype_probe(model: torch.nn.Module, names: dict[str, str]) -> dict[str, Any]:
    """Forward hooks on the modules named ``names`` (keys: labels; values: names as in the
    unwrapped model, FSDP1's ``_fsdp_wrapped_module.`` left out): each label gets the
    ``(input dtype, weight dtype, output dtype)`` of its module's first call."""
    seen: dict[str, Any] = {}
    found = {n.replace("_fsdp_wrapped_module.", ""): m for n, m in model.named_modules()}
    for label, name in names.items():

        def hook(m: Any, args: Any, out: Any, label: str = label) -> None:
            seen.setdefault(label, (args[0].dtype, m.weight.dtype, out.dtype))

        found[name].register_forward_hook(hook)
    return seen


def tiny_llama(path: str, seed: int = 0) -> str:
    """Save a 2-layer Llama (hidden 32, vocabulary 64) built from a config in ``path``."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)  # type: ignore[no-untyped-call]
    return path


def engine(
    model_path: str,
    strategy: str = "fsdp2",
    param_dtype: str = "fp16",
    total_training_steps: int = 20,
    warmup_steps: int = 0,
    checkpoint: dict[str, Any] | None = None,
    attention: str = "sdpa",
) -> Any:
    """verl's ``FSDPEngineWithLMHead`` on ``model_path``, initialised (built, sharded, its
    optimizer and LR scheduler made), as verl's ``EngineRegistry`` would build it on a GPU:
    float16 mixed precision (``param_dtype``), AdamW at LR 1e-3 with a cosine schedule, the
    model's ``attention`` implementation (verl's default, flash attention, is not on a CPU)."""
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    model_config = HFModelConfig(
        path=model_path,
        load_tokenizer=False,
        use_remove_padding=True,
        override_config={"attn_implementation": attention},
    )
    engine_config = FSDPEngineConfig(
        forward_only=False,
        strategy=strategy,
        mixed_precision={"param_dtype": param_dtype},
        use_torch_compile=False,
    )
    optimizer_config = FSDPOptimizerConfig(
        lr=1e-3,
        total_training_steps=total_training_steps,
        lr_warmup_steps=warmup_steps,
        lr_scheduler_type="cosine",
    )
    built = FSDPEngineWithLMHead(
        model_config=model_config,
        engine_config=engine_config,
        optimizer_config=optimizer_config,
        checkpoint_config=CheckpointConfig(**(checkpoint or {})),
    )
    built.initialize()
    return built


def batch(seed: int, size: int = 4, length: int = 16) -> Any:
    """A batch of ``size`` random sequences in verl's training layout (nested, no padding),
    with what ``train_batch`` reads (micro-batches of 2)."""
    from verl import DataProto
    from verl.utils import tensordict_utils as tu
    from verl.utils.model import compute_position_id_with_mask
    from verl.workers.utils.padding import left_right_2_no_padding

    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, 64, (size, length), generator=generator)
    mask = torch.ones(size, length, dtype=torch.long)
    half = length // 2
    data = DataProto.from_single_dict(
        {
            "input_ids": input_ids,
            "prompts": input_ids[:, :half],
            "attention_mask": mask,
            "position_ids": compute_position_id_with_mask(mask),
            "responses": input_ids[:, half:],
            "response_mask": mask[:, half:],
            "loss_mask": mask,
        }
    )
    td = left_right_2_no_padding(data.to_tensordict())
    tu.assign_non_tensor(
        td,
        temperature=1.0,
        micro_batch_size_per_gpu=2,
        use_dynamic_bsz=False,
        global_batch_size=size,
        use_remove_padding=True,
    )
    return td


def loss(overflow: bool = False) -> Callable[..., Any]:
    """A loss function in verl's form: the mean negative log-probability; ``overflow``: times
    infinity, so that every gradient is non-finite and the step must be skipped."""

    def loss_function(model_output: Any, data: Any, dp_group: Any = None) -> Any:
        value = -model_output["log_probs"].values().float().mean()
        if overflow:
            value = value * float("inf")
        return value, {}

    return loss_function


def train_step(built: Any, seed: int, overflow: bool = False) -> Any:
    """One verl training step: ``train_batch`` in train mode (zero_grad, forward, scaled
    backward, unscale_, clip, step, update), then the LR step, as verl's
    ``TrainingWorker.train_batch`` with ``update_lr_scheduler``. Returns the LR it reports."""
    with built.train_mode():
        built.train_batch(batch(seed), loss_function=loss(overflow))
    return built.lr_scheduler_step()


def parameters(built: Any) -> dict[str, torch.Tensor]:
    """This rank's shards of the engine's parameters, copied."""
    return {
        name: (p.to_local() if hasattr(p, "to_local") else p).detach().clone()
        for name, p in built.module.named_parameters()
    }


def optimizer_state(built: Any) -> dict[str, torch.Tensor]:
    """This rank's optimizer state (AdamW's moments and step counts), copied."""
    state = {}
    for i, slots in enumerate(built.optimizer.state.values()):
        for key, value in slots.items():
            tensor = value.to_local() if hasattr(value, "to_local") else value
            state[f"{i}.{key}"] = torch.as_tensor(tensor).clone()
    return state


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """The same keys and bit-identical tensors."""
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def skip_run(model_path: str, strategy: str) -> dict[str, Any]:
    """Three training steps of a fresh engine, the second overflowing: whether the skipped
    step left the weights and the optimizer state bit-identical, how far it moved the LR
    schedule (``epochs``), the scale after it, the LRs verl reported and the schedule's
    final step count."""
    built = engine(model_path, strategy)
    lrs = [train_step(built, 0)]
    weights, moments = parameters(built), optimizer_state(built)
    epoch = built.lr_scheduler.last_epoch
    lrs.append(train_step(built, 1, overflow=True))
    after_skip = {
        "weights": same(weights, parameters(built)),
        "moments": same(moments, optimizer_state(built)),
        "epochs": built.lr_scheduler.last_epoch - epoch,
        "scale": built.scaler.get_scale(),
    }
    lrs.append(train_step(built, 2))
    return {**after_skip, "lrs": lrs, "final_epoch": built.lr_scheduler.last_epoch}


def resume_run(model_path: str, strategy: str, folder: str) -> tuple[float, float, list[str]]:
    """Three steps (the second overflowing), verl's checkpoint in ``folder``, a fresh engine
    loading it: the scale of the run, the scale after resuming, the checkpoint's files."""
    built = engine(model_path, strategy)
    for seed, overflow in enumerate([False, True, False]):
        train_step(built, seed, overflow)
    built.save_checkpoint(folder, global_step=3)
    resumed = engine(model_path, strategy)
    resumed.load_checkpoint(folder)
    return built.scaler.get_scale(), resumed.scaler.get_scale(), sorted(os.listdir(folder))
