"""Every figure the tools draw, in one module: the slice montage (``app.analysis.report`` and the
TensorBoard image of each validation, ``app.engine.tracking``), the training curves, the grain size
distribution (``app.analysis.grains``, ``app.analysis.report``), and their PNG bytes.

matplotlib is imported inside each function: the trainer pays for it only when it logs images.
Figures are drawn on the Agg canvas (no display needed).
"""

from __future__ import annotations

import io
import math
from typing import Any

import numpy as np

from app.engine.validation import pick_slices
from app.labels import scheme_of_names

GROUND_TRUTH_COLOUR = "#00d0ff"  # cyan and orange: apart for the common colour blindnesses
PREDICTION_COLOUR = "#ff8c00"
# --num-classes K >= 2: foreground class c in CLASS_COLOURS[c - 1] (Okabe-Ito, cycled)
CLASS_COLOURS = ("#e69f00", "#56b4e9", "#009e73", "#f0e442", "#cc79a7", "#d55e00", "#0072b2")
CLASS_ALPHA = 0.4
GRAIN_ALPHA = 0.45
PANEL_INCHES = 2.4
DPI = 100


def _canvas(fig) -> np.ndarray:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    return np.asarray(canvas.buffer_rgba())[..., :3].copy()


def grain_colours(instances: np.ndarray) -> np.ndarray:
    """RGBA ``(..., 4)`` float image: each grain id a random bright colour, background clear."""
    palette = np.random.default_rng(0).uniform(0.2, 1.0, (int(instances.max()) + 1, 4))
    palette[:, 3] = GRAIN_ALPHA
    palette[0] = 0.0
    return palette[instances]


def class_colour(c: int) -> str:
    return CLASS_COLOURS[(c - 1) % len(CLASS_COLOURS)]


def class_fill(classes: np.ndarray, k: int) -> np.ndarray:
    """RGBA ``(..., 4)`` float image of a class map: class c in its colour, background clear."""
    from matplotlib.colors import to_rgba

    palette = np.array([(0.0, 0.0, 0.0, 0.0)] + [to_rgba(class_colour(c)) for c in range(1, k)])
    palette[1:, 3] = CLASS_ALPHA
    return palette[np.clip(classes, 0, k - 1)]


def montage_figure(
    image: np.ndarray,
    label: np.ndarray,
    prediction: np.ndarray,
    title: str,
    n_slices: int = 8,
    z_labels: list[int] | None = None,
    instances: np.ndarray | None = None,
    classes: list[str] | None = None,
) -> np.ndarray:
    """RGB ``(H, W, 3)`` uint8 montage of up to ``n_slices`` z-slices of ``(D, H, W)`` arrays.

    Slices are evenly spaced through the z-range holding foreground (label or prediction);
    ``z_labels`` names the slices of a stack that is itself a subset of a volume (the
    TensorBoard sample); otherwise a slice is named by its index. With ``instances`` (the
    prediction's grains) the grains are filled, one colour each, instead of the prediction's
    outline. With ``classes`` (K >= 2 names, background first) ``label`` and ``prediction`` are
    class maps: each foreground class has its own colour, its prediction filled and its ground
    truth outlined in it.
    """
    from matplotlib.figure import Figure

    image, label, prediction = (np.asarray(a) for a in (image, label, prediction))
    if image.ndim != 3 or image.shape != label.shape or image.shape != prediction.shape:
        raise ValueError(
            f"montage_figure needs three (D, H, W) arrays of one shape, got "
            f"{image.shape}, {label.shape}, {prediction.shape}"
        )
    class_label, class_prediction = label, prediction
    overlay, legend = scheme_of_names(classes).choose(
        binary=(_mask_overlay, _mask_legend), classes=(_class_overlay, _class_legend)
    )
    label, prediction = label > 0.5, prediction > 0.5
    picks = pick_slices(label, prediction, max(1, n_slices))
    names = z_labels if z_labels is not None else list(range(image.shape[0]))
    low, high = np.percentile(image[picks], (0.5, 99.5))

    cols = min(len(picks), 4)
    rows = math.ceil(len(picks) / cols)
    height, width = image.shape[1:]
    panel_w = PANEL_INCHES
    panel_h = PANEL_INCHES * min(max(height / width, 0.25), 4.0)
    gap, caption, top, bottom = 0.08, 0.25, 0.45, 0.35  # inches
    fig_w = cols * (panel_w + gap) + gap
    fig_h = top + rows * (panel_h + caption) + bottom
    fig = Figure(figsize=(fig_w, fig_h), dpi=DPI)
    fig.suptitle(title, fontsize=10, y=1 - 0.12 / fig_h, va="top")
    for i, z in enumerate(picks):
        row, col = divmod(i, cols)
        left = gap + col * (panel_w + gap)
        lower = fig_h - top - caption - row * (panel_h + caption) - panel_h
        ax = fig.add_axes((left / fig_w, lower / fig_h, panel_w / fig_w, panel_h / fig_h))
        ax.imshow(
            image[z],
            cmap="gray",
            vmin=low,
            vmax=high if high > low else low + 1,
            interpolation="nearest",
            aspect="auto",
        )
        shown = (label[z], prediction[z], class_label[z], class_prediction[z])
        outlines = overlay(ax, *shown, None if instances is None else instances[z], classes)
        for mask, colour in outlines:
            if mask.any() and not mask.all():  # a contour needs both sides of the level
                ax.contour(mask.astype(np.float32), levels=[0.5], colors=[colour], linewidths=1.2)
        ax.set_title(f"z = {names[z]}", fontsize=8, pad=3)
        ax.set_axis_off()
    handles, ncol = legend(instances, classes)
    fig.legend(
        handles=handles,
        loc="lower center",
        ncol=ncol,
        fontsize=8,
        frameon=False,
        bbox_to_anchor=(0.5, 0.02 / fig_h),
    )
    return _canvas(fig)


def _mask_overlay(ax, label, prediction, class_label, class_prediction, instances, classes):
    """The binary montage: the prediction outlined, or its grains (``instances``) filled."""
    outlines = [(label, GROUND_TRUTH_COLOUR)]
    if instances is None:
        outlines.append((prediction, PREDICTION_COLOUR))
    else:
        ax.imshow(grain_colours(instances), interpolation="nearest", aspect="auto")
    return outlines


def _class_overlay(ax, label, prediction, class_label, class_prediction, instances, classes):
    """The K-class montage: each class's prediction filled, its ground truth outlined."""
    fill = class_fill(class_prediction, len(classes))
    ax.imshow(fill, interpolation="nearest", aspect="auto")
    return [(class_label == c, class_colour(c)) for c in range(1, len(classes))]


def _mask_legend(instances, classes) -> tuple[list, int]:
    from matplotlib.lines import Line2D

    handles = [
        Line2D([], [], color=GROUND_TRUTH_COLOUR, lw=2, label="ground truth"),
        Line2D([], [], color=PREDICTION_COLOUR, lw=2, label="prediction")
        if instances is None
        else Line2D([], [], color="#b0b0b0", lw=6, alpha=0.8, label="predicted grains"),
    ]
    return handles, 2


def _class_legend(instances, classes) -> tuple[list, int]:
    from matplotlib.lines import Line2D

    handles = [
        Line2D([], [], color=class_colour(c), lw=2, label=f"{name}: truth (line)")
        for c, name in enumerate(classes[1:], start=1)
    ] + [Line2D([], [], color="#b0b0b0", lw=6, alpha=0.8, label="prediction (fill)")]
    return handles, len(handles)


def curves_figure(records: list[dict[str, Any]], title: str, learned_floor: float | None = None):
    """A 2x2 matplotlib Figure of the training curves of ``metrics.jsonl`` records; the
    validation panel draws the classical floor the records hold (``floor_dice``, the last one
    logged) and ``learned_floor`` (``app.analysis.learned_floor``) as horizontal lines."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    def series(key: str) -> tuple[list[int], list[float]]:
        points = [(r["epoch"], r[key]) for r in records if r.get(key) is not None]
        return [p[0] for p in points], [p[1] for p in points]

    fig = Figure(figsize=(10, 7), dpi=DPI)
    fig.suptitle(title)
    axes = fig.subplots(2, 2)
    panels = [
        (axes[0, 0], "loss (BCE + Dice)", [("train_loss", "train", "-"), ("val_loss", "val", "-")]),
        (
            axes[0, 1],
            "validation",
            [
                ("dice", "Dice", "-"),
                ("iou", "IoU", "-"),
                ("dice_per_volume_mean", "Dice, per-volume mean", "--"),
            ],
        ),
        (axes[1, 0], "learning rate", [("lr", "lr", "-")]),
        (
            axes[1, 1],
            "throughput (samples/s, all processes)",
            [("samples_per_s", "samples/s", "-")],
        ),
    ]
    for ax, name, lines in panels:
        for key, label, style in lines:
            x, y = series(key)
            if x:
                ax.plot(x, y, style, marker="o", markersize=3, label=label)
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("epoch")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        if ax.lines and len(lines) > 1:
            ax.legend(fontsize=8)
    x, y = series("lr")
    if y and min(y) > 0 and max(y) > min(y):
        axes[1, 0].set_yscale("log")
    x, y = series("dice")
    if x:
        best = int(np.argmax(y))
        axes[0, 1].axvline(x[best], color="grey", ls=":", lw=1)
        axes[0, 1].annotate(
            f"best {y[best]:.3f} @ {x[best]}",
            (x[best], y[best]),
            textcoords="offset points",
            xytext=(-4, -12),
            ha="right",
            fontsize=8,
        )
        axes[0, 1].set_ylim(0, 1)
    _, logged = series("floor_dice")
    floors = [
        ("classical floor", logged[-1] if logged else None, "tab:grey", "--"),
        ("learned floor", learned_floor, "tab:red", "-."),
    ]
    for name, dice, colour, style in floors:
        if dice is not None:
            axes[0, 1].axhline(dice, color=colour, ls=style, lw=1, label=f"{name} {dice:.3f}")
    if any(dice is not None for _, dice, _, _ in floors):
        axes[0, 1].legend(fontsize=8)
    fig.tight_layout()
    return fig


def psd_figure(series: dict[str, np.ndarray], unit: str, title: str):
    """Histogram (by number) and cumulative % passing (by volume) of each set of diameters."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4), dpi=100)
    fig.suptitle(title, fontsize=10)
    hist_ax, cum_ax = fig.subplots(1, 2)
    nonempty = [d for d in series.values() if len(d)]
    top = max((float(np.max(d)) for d in nonempty), default=1.0)
    bins = np.linspace(0, top * 1.02, 31)
    for name, diameters in series.items():
        diameters = np.sort(np.asarray(diameters, dtype=np.float64))
        label = f"{name} ({diameters.size} grains)"
        hist_ax.hist(diameters, bins=bins, histtype="step", lw=1.5, label=label)
        if diameters.size:
            passing = 100 * np.cumsum(diameters**3) / np.sum(diameters**3)
            cum_ax.step(diameters, passing, where="post", lw=1.5, label=name)
    hist_ax.set(xlabel=f"equivalent diameter ({unit})", ylabel="grains", title="by number")
    cum_ax.set(
        xlabel=f"equivalent diameter ({unit})",
        ylabel="% of grain volume finer",
        title="cumulative, by volume (% passing)",
        ylim=(0, 100),
    )
    for ax in (hist_ax, cum_ax):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        ax.title.set_fontsize(9)
    fig.tight_layout()
    return fig


def figure_png(fig) -> bytes:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    buffer = io.BytesIO()
    FigureCanvasAgg(fig).print_png(buffer)
    return buffer.getvalue()


def png_bytes(rgb: np.ndarray) -> bytes:
    from matplotlib.image import imsave

    buffer = io.BytesIO()
    imsave(buffer, rgb, format="png")
    return buffer.getvalue()
