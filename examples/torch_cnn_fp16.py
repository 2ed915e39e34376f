"""A small CNN trained in float16 with ``lossscale.torch.LossScaleOptimizer``.

What it shows, on synthetic image data (no download):

* mixed precision with ``torch.autocast`` in float16 (``--dtype bfloat16`` also works), on
  CUDA when available, else on the CPU: CPU autocast supports float16, but torch's CPU float16
  convolution backward is a slow reference kernel, hence the tiny model (3 x 8 x 8 images, two
  convolutions) and one CPU thread by default;
* gradient accumulation: ``opt.get_scaled_loss(loss).backward()`` for each micro-batch and one
  ``opt.step()`` at the boundary (the scale only changes in ``step()``);
* gradient clipping: ``opt.unscale_()`` first, then ``torch.nn.utils.clip_grad_norm_`` on the
  true gradients (``step()`` does not unscale them a second time);
* an LR scheduler advanced with ``opt.step_scheduler(scheduler)``, so that skipped steps do not
  advance the schedule;
* one injected overflow (a gradient multiplied by inf, as a float16 overflow would leave it):
  that step is skipped, the parameters do not move, the loss scale halves, and
  ``opt.nonfinite_gradients(model)`` names the parameter whose gradient overflowed.

Run it::

    python examples/torch_cnn_fp16.py              # 60 optimizer steps
    python examples/torch_cnn_fp16.py --quick      # 25 steps, ~10 s on 2 CPU cores (CI)
    python examples/torch_cnn_fp16.py --device cuda --steps 200

It exits with status 1 if training did not work: the final loss is not below 70% of the
initial loss, the injected overflow was not skipped, or the scheduler advanced on a skipped
step.
"""

from __future__ import annotations

import argparse
import sys

import torch
from torch import nn

from lossscale.torch import LossScaleOptimizer

N_CLASSES = 10
IMAGE = 8  # 3 x 8 x 8 images


def make_data(
    patterns: torch.Tensor, n: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Synthetic images: the pattern of a random class plus as much noise."""
    labels = torch.randint(0, N_CLASSES, (n,), generator=generator)
    noise = torch.randn(n, 3, IMAGE, IMAGE, generator=generator)
    return patterns[labels] + noise, labels


def make_model() -> nn.Module:
    """Two 3x3 convolutions with max pooling, then a linear classifier."""
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),  # 8 x 8 x 8
        nn.ReLU(),
        nn.MaxPool2d(2),  # 8 x 4 x 4
        nn.Conv2d(8, 16, 3, padding=1),  # 16 x 4 x 4
        nn.ReLU(),
        nn.MaxPool2d(2),  # 16 x 2 x 2
        nn.Flatten(),
        nn.Linear(64, N_CLASSES),
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few steps (for CI)")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps (default 60)")
    parser.add_argument(
        "--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu or cuda"
    )
    parser.add_argument(
        "--dtype", choices=("float16", "bfloat16"), default="float16", help="autocast dtype"
    )
    parser.add_argument("--micro-batches", type=int, default=4, help="accumulated per step")
    parser.add_argument("--micro-batch-size", type=int, default=16)
    parser.add_argument("--overflow-step", type=int, default=5, help="step with an injected inf")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--threads", type=int, default=1, help="CPU threads (default 1: the model is tiny)"
    )
    args = parser.parse_args(argv)
    if args.steps is None:
        args.steps = 25 if args.quick else 60
    if args.steps <= args.overflow_step:
        parser.error(f"--steps must be greater than --overflow-step ({args.overflow_step})")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)  # more threads only wait for each other here
    dtype = getattr(torch, args.dtype)
    generator = torch.Generator().manual_seed(args.seed)
    batch = args.micro_batches * args.micro_batch_size
    patterns = torch.randn(N_CLASSES, 3, IMAGE, IMAGE, generator=generator)  # one per class
    x_all, y_all = make_data(patterns, batch * 8, generator)  # 8 distinct batches, cycled
    x_all, y_all = x_all.to(device), y_all.to(device)
    x_eval, y_eval = make_data(patterns, 512, generator)
    x_eval, y_eval = x_eval.to(device), y_eval.to(device)

    model = make_model().to(device)
    # dynamic_growth_steps=10 (TensorFlow's default is 2000) so that growth shows in a short run.
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt = LossScaleOptimizer(inner, dynamic_growth_steps=10)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.steps)

    def eval_loss() -> float:
        with torch.no_grad(), torch.autocast(device.type, dtype=dtype):
            return float(nn.functional.cross_entropy(model(x_eval), y_eval))

    print(
        f"torch {torch.__version__}, device {device}, autocast {args.dtype}, {args.steps} steps "
        f"of {args.micro_batches} micro-batches x {args.micro_batch_size}"
    )
    initial_loss = eval_loss()
    print(f"initial loss {initial_loss:.4f}")
    scheduler_steps = 0
    for step in range(args.steps):
        start = (step % 8) * batch
        step_loss = torch.zeros((), device=device)  # mean loss over the step's batch
        for micro in range(args.micro_batches):
            lo = start + micro * args.micro_batch_size
            x = x_all[lo : lo + args.micro_batch_size]
            y = y_all[lo : lo + args.micro_batch_size]
            with torch.autocast(device.type, dtype=dtype):
                loss = nn.functional.cross_entropy(model(x), y) / args.micro_batches
            opt.get_scaled_loss(loss).backward()  # float32 scaled loss; grads accumulate
            step_loss += loss.detach()

        if step == args.overflow_step:  # what a float16 overflow leaves behind
            grad = next(model.parameters()).grad
            assert grad is not None
            with torch.no_grad():
                grad.mul_(float("inf"))
            before = [p.detach().clone() for p in model.parameters()]
            scale_before = float(opt.loss_scale)

        opt.unscale_()  # true gradients from here on: clip them
        grad_norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        opt.step()  # reuses unscale_()'s check; applies or skips; updates the scale
        if opt.step_scheduler(scheduler):  # only after an applied step
            scheduler_steps += 1
        applied = bool(opt.last_step_applied)
        if not applied:  # which parameters overflowed (costs nothing unless called)
            print(f"non-finite gradients at step {step}: {opt.nonfinite_gradients(model)}")
        opt.zero_grad()

        if step == args.overflow_step or step % 5 == 0 or step == args.steps - 1:
            print(
                f"step {step:3d}  loss {float(step_loss):.4f}  "
                f"grad norm {float(grad_norm):8.3g}  scale {float(opt.loss_scale):8.0f}  "
                f"lr {scheduler.get_last_lr()[0]:.2e}  {'applied' if applied else 'SKIPPED'}"
            )
        if step == args.overflow_step:
            params = list(model.parameters())
            unchanged = all(torch.equal(a, b) for a, b in zip(before, params, strict=True))
            print(
                f"injected overflow at step {step}: skipped={not applied}, "
                f"parameters unchanged={unchanged}, "
                f"scale {scale_before:.0f} -> {float(opt.loss_scale):.0f}"
            )
            if applied or not unchanged or float(opt.loss_scale) != scale_before / 2:
                sys.exit("FAILED: the injected overflow was not skipped")

    final_loss = eval_loss()
    skipped = int(opt.skipped_steps)
    print(f"skipped steps {skipped}")
    print(f"loss scale {float(opt.loss_scale):.0f}")
    print(f"scheduler steps {scheduler_steps} (of {args.steps} optimizer steps)")
    print(f"final loss {final_loss:.4f} (initial {initial_loss:.4f})")
    if skipped < 1:
        sys.exit("FAILED: no step was skipped")
    if scheduler_steps != args.steps - skipped or scheduler.last_epoch != scheduler_steps:
        sys.exit("FAILED: the LR scheduler advanced on a skipped step")
    if not final_loss < 0.7 * initial_loss:
        sys.exit(f"FAILED: the loss did not go down ({initial_loss:.4f} -> {final_loss:.4f})")
    print("OK")


if __name__ == "__main__":
    main()
