"""The memory budget of one training step, drawn: lesson 05 (05_all_stages).

* ``budget_figure``: :func:`minizero.analysis.budget.step_budget` at every stage, without and with
  activation checkpointing, against the GPU's memory;
* ``calculator()``: ipywidgets sliders (the model's shape, s, b, N, GPU memory, checkpointing,
  attention kernel) that redraw ``budget_figure``; built only where a widget front end can show
  it (:func:`minizero.course.plots.widgets_available`).
"""

from __future__ import annotations

from minizero.course.plots import STAGE_NAMES, short_count, stack


def budget_axes(ax, rows: list[tuple[str, dict[str, float]]], capacity_gb: float, title: str):
    """Stacked bars of :func:`minizero.analysis.budget.step_budget` parts (GB), one per
    ``(label, parts)``, and a line at the GPU's memory; each bar says its total, red where it does
    not fit."""
    for i, (_, parts) in enumerate(rows):
        top = stack(ax, i, {k: v / 1e9 for k, v in parts.items()}, 0.7, labelled=i == 0)
        fits = top <= capacity_gb
        ax.text(i, top, f"{top:.1f}", ha="center", va="bottom", fontsize=7,
                color="k" if fits else "C3", fontweight=None if fits else "bold")  # fmt: skip
    ax.axhline(capacity_gb, color="C3", lw=1, ls="--")
    ax.text(len(rows) - 0.5, capacity_gb, f" {capacity_gb:g} GB", color="C3", va="bottom",
            ha="right", fontsize=8)  # fmt: skip
    ax.set_xticks(range(len(rows)), [label for label, _ in rows], fontsize=8)
    ax.set_ylabel("bytes per rank at the peak (GB)")
    top = max(sum(p.values()) for _, p in rows) / 1e9
    ax.set_ylim(0, max(top, capacity_gb) * 1.15)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, loc="upper right")


def budget_figure(
    cfg,
    world: int,
    *,
    micro_batch: int = 1,
    capacity_gb: float = 80,
    flash: bool = True,
    dropout: bool = False,
    logit_bytes: float = 6.0,
    stage: int | None = None,
    checkpointing: bool | None = None,
    where: str = "",
    ax=None,
):
    """:func:`budget_axes` for ``TinyGPT(cfg)`` at every stage, without and with activation
    checkpointing (``stage`` / ``checkpointing`` narrow it). ``where``: where the constants were
    measured, for the title."""
    import matplotlib.pyplot as plt

    from minizero.analysis.budget import gpt_params, step_budget

    fig = None
    if ax is None:
        fig, ax = plt.subplots(figsize=(10, 4.5))
    rows = []
    for ck in (False, True) if checkpointing is None else (checkpointing,):
        for s in STAGE_NAMES if stage is None else (stage,):
            parts = step_budget(cfg, world=world, stage=s, micro_batch=micro_batch,
                                checkpointing=ck, flash=flash, dropout=dropout,
                                logit_bytes=logit_bytes)  # fmt: skip
            rows.append((f"{s}: {STAGE_NAMES[s]}" + ("\nckpt" if ck else ""), parts))
    attn = "flash attention" if flash else "scores stored" + (", dropout" if dropout else "")
    title = (
        f"Ψ = {short_count(gpt_params(cfg))} (L={cfg.n_layer}, h={cfg.n_embd}, a={cfg.n_head}, "
        f"V={cfg.vocab_size}), s={cfg.block_size}, b={micro_batch}, N={world}, bf16 AdamW, {attn}"
    )
    if where:
        title += f"\nconstants measured on {where}"
    budget_axes(ax, rows, capacity_gb, title)
    return fig or ax.figure


def calculator(cfg=None, world: int = 8, micro_batch: int = 1, capacity_gb: float = 80):
    """Sliders that redraw :func:`budget_figure`: the model's shape, sequence length, micro-batch,
    ranks, the GPU's memory, activation checkpointing and the attention kernel (ipywidgets)."""
    import ipywidgets as W
    import matplotlib.pyplot as plt

    from minizero.models import GPTConfig

    cfg = cfg or GPTConfig(vocab_size=50304, block_size=4096, n_layer=32, n_head=32, n_embd=4096)
    log2 = lambda v, lo, hi, d: W.SelectionSlider(
        options=[2**k for k in range(lo, hi + 1)], value=v, description=d
    )
    controls = dict(
        n_layer=W.IntSlider(value=cfg.n_layer, min=1, max=128, description="layers L"),
        n_embd=log2(cfg.n_embd, 6, 15, "width h"),
        n_head=log2(cfg.n_head, 0, 8, "heads a"),
        vocab_size=W.IntSlider(cfg.vocab_size, min=256, max=262144, step=256, description="V"),
        block_size=log2(cfg.block_size, 6, 17, "sequence s"),
        micro_batch=log2(micro_batch, 0, 6, "micro-batch b"),
        world=log2(world, 0, 12, "ranks N"),
        capacity_gb=W.FloatSlider(value=capacity_gb, min=8, max=192, step=8, description="GPU GB"),
        checkpointing=W.ToggleButtons(
            options=[("both", None), ("off", False), ("on", True)], description="checkpoint"
        ),
        flash=W.Checkbox(value=True, description="flash attention (no s² scores)"),
    )
    out = W.Output()

    def redraw(_=None) -> None:
        v = {k: w.value for k, w in controls.items()}
        with out:
            out.clear_output(wait=True)
            if v["n_embd"] % v["n_head"]:
                print(f"width h = {v['n_embd']} must be a multiple of heads a = {v['n_head']}")
                return
            keys = ("vocab_size", "block_size", "n_layer", "n_head", "n_embd")
            shape = GPTConfig(**{k: v[k] for k in keys})
            budget_figure(shape, v["world"], micro_batch=v["micro_batch"],
                          capacity_gb=v["capacity_gb"], flash=v["flash"],
                          checkpointing=v["checkpointing"])  # fmt: skip
            plt.show()

    for w in controls.values():
        w.observe(redraw, names="value")
    redraw()
    return W.VBox([*controls.values(), out])
