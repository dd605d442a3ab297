"""What `treeflash bench` reports: an aligned table, one JSON object per row (--out,
written as rows are measured) and a plot (--plot, which needs matplotlib)."""
from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

from treeflash.errors import TreeflashError, UsageError
from treeflash.files import probe_write


def grouped(rows: list[dict], keys: tuple[str, ...]) -> dict[tuple, list[dict]]:
    """The rows by their values of `keys`, groups in the order they first appear."""
    groups = {}
    for r in rows:
        groups.setdefault(tuple(r[k] for k in keys), []).append(r)
    return groups


def _cell(value, fmt: str) -> str:
    if value is None:
        return "-"
    if fmt == "onoff":
        return "on" if value else "off"
    return fmt.format(value)


def format_table(rows: list[dict], columns) -> str:
    """Aligned text table: text columns left-aligned, numbers right-aligned, None as '-'."""
    cells = [[_cell(r.get(key), fmt) for _, key, fmt in columns] for r in rows]
    widths = [max([len(title)] + [len(c[i]) for c in cells]) for i, (title, _, _) in enumerate(columns)]
    left = [fmt == "onoff" or any(isinstance(r.get(key), str) for r in rows) for _, key, fmt in columns]

    def line(values):
        return "  ".join(v.ljust(w) if lft else v.rjust(w) for v, w, lft in zip(values, widths, left)).rstrip()

    return "\n".join([line([t for t, _, _ in columns]), line(["-" * w for w in widths])] + [line(c) for c in cells])


SHAPE_SETTING = ("context", "batch_size", "temperature", "graphs")  # the rows of one state


def print_ratios(rows: list[dict]) -> None:
    """verify(N)/AR and round(N)/AR per setting: the cost of verifying a bigger tree."""
    for (c, bs, t, g), sel in grouped(rows, SHAPE_SETTING).items():
        for op in ("verify", "round"):
            pairs = "  ".join(f"N={r['N']}: {r['vs_ar']:.2f}" for r in sel if r["op"] == op)
            if pairs:
                print(f"{op}(N)/AR  C={c} bs={bs} T={t:g} graphs {'on' if g else 'off'}:  {pairs}")


class RowsFile:
    """--out, checked before the (long) run, so a bad path fails at once, but emptied (or
    made) only when the first row comes: a run that fails before measuring anything
    leaves the results of an earlier run as they were, and no new empty file. Rows are
    written as they are measured, so an interrupted GPU run keeps what it measured."""

    def __init__(self, path: str):
        self.path, self.file = path, None
        if Path(path).exists():
            open(path, "a", encoding="utf-8").close()  # writable, and left as it is
        else:
            probe_write(Path(path).resolve().parent)

    def write(self, row: dict) -> None:
        if self.file is None:
            self.file = open(self.path, "w", encoding="utf-8")
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


def open_out(path: str | None, inputs=()) -> RowsFile | None:
    """--out as a `RowsFile`. Refused if it is one of the run's `inputs` (files, or
    folders it lies in): writing it would empty it, and a model's config.json or the
    prompt file was lost that way."""
    if not path:
        return None
    if path == "-" or Path(path).exists() and not Path(path).is_file() or _standard_stream(path):
        raise UsageError(f"--out {path} is not a file of its own: the rows go to a file, emptied when the first "
                         f"comes (standard output has the table)")
    check_not_an_input("--out", path, inputs)
    try:
        return RowsFile(path)
    except OSError as e:
        raise TreeflashError(f"cannot write {path}: {e.strerror}") from None


def check_not_an_input(option: str, path: str, inputs) -> None:
    """Refuse an output path that is one of the run's `inputs` (files, or folders it lies in)."""
    target = Path(path).resolve()
    for given in inputs:
        source = Path(given).resolve()
        if target == source or source in target.parents:
            raise UsageError(f"{option} {path} is {'an input' if target == source else f'inside {given}'}, "
                             f"which this run reads: choose another path")


def _standard_stream(path: str) -> bool:
    """Whether `path` is where standard output or error goes (/dev/stdout of a command
    whose output is redirected to a file is that file: the rows would empty it)."""
    try:
        node = os.stat(path)
    except OSError:
        return False
    for stream in (sys.stdout, sys.stderr):
        try:
            other = os.fstat(stream.fileno())
        except (AttributeError, OSError, ValueError):  # closed, or not a file (a test's capture)
            continue
        if (node.st_dev, node.st_ino) == (other.st_dev, other.st_ino):
            return True
    return False


def emit(out: RowsFile | None, row: dict) -> None:
    if out is not None:
        out.write(row)


def close_out(out, path: str | None) -> None:
    if out is not None:
        out.close()
        if out.file is not None:
            print(f"wrote {path}", file=sys.stderr)


PLOT_FORMATS = (".png", ".svg", ".pdf", ".jpg", ".jpeg", ".eps", ".ps", ".tif", ".tiff", ".webp")  # matplotlib's


def check_plot_path(path: str | None, out: str | None, inputs=()) -> None:
    """Refuse a --plot that cannot be written before the run, not after it: a folder, a
    name matplotlib would add .png to or cannot write, an unwritable folder, no matplotlib,
    --out's file (the plot would replace the rows) or one of the run's `inputs` (a prompt
    file was replaced by the plot)."""
    if not path:
        return
    if out and Path(path).resolve() == Path(out).resolve():
        raise UsageError(f"--plot and --out are the same file {path}: the plot would replace the rows")
    check_not_an_input("--plot", path, inputs)
    if Path(path).is_dir():
        raise UsageError(f"--plot {path} is a folder: give a file name ending in .png, .svg or .pdf")
    if Path(path).suffix.lower() not in PLOT_FORMATS:
        raise UsageError(f"--plot {path}: the name must end in .png, .svg or .pdf (or {', '.join(PLOT_FORMATS[3:])})")
    folder = Path(path).resolve().parent
    try:
        probe_write(folder)
    except OSError:
        raise UsageError(f"cannot write the plot {path}: {folder} is not a writable folder") from None
    if importlib.util.find_spec("matplotlib") is None:
        raise UsageError("--plot needs matplotlib (pip install matplotlib), or leave --plot out")


def _pyplot():
    """matplotlib's pyplot, drawing to files only (`check_plot_path` found it)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_pairs(rows: list[dict], path: str) -> None:
    """tokens/s per method/budget, one line per (batch size, temperature, graphs)."""
    plt = _pyplot()
    if not rows:
        return
    labels = list(dict.fromkeys(r["label"] for r in rows))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.0 * len(labels) + 2), 4.5))
    for (bs, t, g), sel in grouped(rows, ("batch_size", "temperature", "graphs")).items():
        pts = {r["label"]: r["tokens_per_s"] for r in sel}
        xs = [i for i, lab in enumerate(labels) if lab in pts]
        ax.plot(xs, [pts[labels[i]] for i in xs], marker="o",
                label=f"bs {bs}, T {t:g}, graphs {'on' if g else 'off'}")
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, rotation=30, ha="right")
    ax.set_ylabel("tokens/s")
    ax.set_title("treeflash bench: tokens/s by method")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    _save(fig, plt, path)


def plot_shape(rows: list[dict], path: str) -> None:
    """verify(N) and round(N) time against N, one color per setting, with the AR step
    as a dotted line: where tree size stops being free."""
    plt = _pyplot()
    if not rows:
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, (key, sel) in enumerate(grouped(rows, SHAPE_SETTING).items()):
        tag = f"C={key[0]} bs {key[1]}" + (f" T {key[2]:g}" if key[2] else "") + ("" if key[3] else " eager")
        color = f"C{i % 10}"
        for op, style in (("verify", "-o"), ("round", "--s")):
            pts = [(r["N"] + 1, r["time_us"]) for r in sel if r["op"] == op]
            if pts:
                ax.plot(*zip(*pts), style, color=color, label=f"{op} {tag}")
        ar = [r["time_us"] for r in sel if r["op"] == "ar"]
        if ar:
            ax.axhline(ar[0], ls=":", lw=1, color=color)
    ticks = sorted({r["N"] + 1 for r in rows if r["op"] in ("verify", "round")})
    ax.set_xscale("log", base=2)
    ax.set_xticks(ticks)
    ax.set_xticklabels([str(t) for t in ticks])
    ax.set_xlabel("tokens verified per round (N + 1)")
    ax.set_ylabel("time (us)")
    ax.set_title(f"treeflash bench --shape {rows[0]['shape']} (dotted: AR step)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    _save(fig, plt, path)


def _save(fig, plt, path: str) -> None:
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=120)
    except OSError as e:
        raise TreeflashError(f"cannot write {path}: {e.strerror}") from None
    finally:
        plt.close(fig)
    print(f"wrote {Path(path)}", file=sys.stderr)
