"""What the numerics report costs: a sampled step against an unsampled one (docs/performance.md).

A small causal transformer (2 layers, d_model 64, 4 heads, 16 x 32 tokens, vocabulary 64) is
trained in float16 (``torch.autocast``) with ``lossscale.torch.GradScaler`` on one CPU thread,
with a :class:`lossscale.torch.NumericsMonitor` (float16, float8_e4m3fn, float8_e5m2; module
gradients too) sampling every 10th step. The same training without a monitor runs
interleaved with it, step by step on the same batches; each iteration (forward, backward,
``record()``, step, update) is timed, and the medians of the monitored run's sampled and
unsampled iterations are compared with the plain run's at the same steps. It also prints
the report at the scale the run settled on, and at scale 1 (one more backward pass without
scaling).

Run::

    python -m benchmarks.numerics_bench            # 400 steps
    python -m benchmarks.numerics_bench --quick    # 60 steps (CI)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from lossscale.numerics import recommend
from lossscale.torch import GradScaler, NumericsMonitor

VOCAB, LENGTH, BATCH, WIDTH = 64, 32, 16, 64
FORMATS = ("float16", "float8_e4m3fn", "float8_e5m2")


class TinyTransformer(torch.nn.Module):
    """Token and position embeddings, two causal encoder layers, a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.pos = torch.nn.Parameter(torch.randn(LENGTH, WIDTH) * 0.02)
        layer = torch.nn.TransformerEncoderLayer(WIDTH, 4, 2 * WIDTH, dropout=0.0, batch_first=True)
        self.blocks = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = torch.nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        mask = torch.nn.Transformer.generate_square_subsequent_mask(LENGTH)
        hidden = self.blocks(self.embed(tokens) + self.pos, mask=mask, is_causal=True)
        return self.head(hidden)  # type: ignore[no-any-return]


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Arithmetic sequences modulo the vocabulary: predict the next token."""
    start = torch.randint(0, VOCAB, (BATCH, 1))
    stride = torch.randint(1, 4, (BATCH, 1))
    tokens = (start + stride * torch.arange(LENGTH + 1)) % VOCAB
    return tokens[:, :-1], tokens[:, 1:]


def loss_of(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.float16):
        logits = model(x)
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten())


class Run:
    """One training run from seed-0 weights, with or without a monitor."""

    def __init__(self, monitored: bool) -> None:
        torch.manual_seed(0)
        self.model = TinyTransformer()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=3e-3)
        self.scaler = GradScaler("cpu", init_scale=2.0**16, growth_interval=10)
        self.monitor = (
            NumericsMonitor(self.model, self.scaler, every=10, formats=FORMATS, modules=True)
            if monitored
            else None
        )
        self.seconds: list[float] = []

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """One timed iteration: forward, backward, ``record()``, step, update."""
        start = time.perf_counter()
        self.scaler.scale(loss_of(self.model, x, y)).backward()
        if self.monitor is not None:
            self.monitor.record()
        self.scaler.step(self.opt)
        self.scaler.update()
        self.opt.zero_grad()
        self.seconds.append(time.perf_counter() - start)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="60 steps instead of 400")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    steps = 60 if args.quick else 400
    plain, monitored = Run(False), Run(True)
    torch.manual_seed(0)
    for step in range(steps):  # interleaved, alternating which goes first: same load for both
        x, y = batch()
        for run in (plain, monitored) if step % 2 else (monitored, plain):
            run.step(x, y)
    monitor = monitored.monitor
    assert monitor is not None
    sampled = [monitor.report.due(step) for step in range(steps)]
    # step 0 (warm-up) is left out of every median
    pairs = list(zip(plain.seconds, monitored.seconds, sampled, strict=True))[1:]
    base_off = statistics.median(p for p, _, on in pairs if not on)
    base_on = statistics.median(p for p, _, on in pairs if on)
    off = statistics.median(m for _, m, on in pairs if not on)
    on = statistics.median(m for _, m, on in pairs if on)
    print(f"{steps} steps, torch {torch.__version__}, 1 CPU thread, interleaved runs")
    print(
        f"unsampled step: {off * 1e3:.2f} ms, without a monitor {base_off * 1e3:.2f} ms "
        f"({off / base_off:.3f}x)"
    )
    print(
        f"sampled step: {on * 1e3:.2f} ms, without a monitor {base_on * 1e3:.2f} ms "
        f"({on / base_on:.3f}x)"
    )
    print(
        f"same training: final scales {plain.scaler.get_scale()} and {monitored.scaler.get_scale()}"
    )
    report = monitor.report
    print()
    print(report.table(top=8))
    print()
    print(recommend(report))
    torch.manual_seed(1)
    at_one = NumericsMonitor(monitor.model, None, every=1, formats=FORMATS, modules=True)
    loss_of(monitor.model, *batch()).backward()
    at_one.record()
    at_one.close()
    print()
    print(at_one.report.table(top=8))
    monitor.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
