#!/usr/bin/python3
"""Plot floe-eval's CSV: p90 relative error against the fraction of KV bytes read, one
line per method, log axes.  Usage: bench/plot_eval.py CSV PNG [--title TEXT]

Uses Debian's python3-matplotlib.  Run under /usr/bin/python3 (the shebang does); if
another interpreter starts it without matplotlib, it re-runs itself under
/usr/bin/python3, and says how to install the package if that has none either.
"""
import argparse
import csv
import os
import sys

COLUMNS = ["method", "budget", "keys_read_frac", "bytes_read_frac", "err_p50", "err_p90",
           "err_p99", "err_max", "us_per_query", "speedup_vs_dense", "cert_frac", "cert_held"]
SYSTEM_PYTHON = "/usr/bin/python3"


def import_pyplot():
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        return plt
    except ImportError:
        if os.path.realpath(sys.executable) != os.path.realpath(SYSTEM_PYTHON) and os.path.exists(SYSTEM_PYTHON):
            os.execv(SYSTEM_PYTHON, [SYSTEM_PYTHON] + sys.argv)
        sys.exit("plot_eval.py: matplotlib is missing; install it with: apt-get install -y python3-matplotlib")


def read_rows(path):
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        if reader.fieldnames != COLUMNS:
            sys.exit(f"plot_eval.py: {path}: columns {reader.fieldnames} are not floe-eval's {COLUMNS}")
        rows = list(reader)
    if not rows:
        sys.exit(f"plot_eval.py: {path}: no rows")
    return rows


def main(argv):
    parser = argparse.ArgumentParser(description="Plot floe-eval's CSV: p90 error against KV bytes read.")
    parser.add_argument("csv", help="a CSV written by floe-eval --csv")
    parser.add_argument("png", help="the picture to write")
    parser.add_argument("--title", help="plot title (default: the CSV's file name)")
    args = parser.parse_args(argv[1:])
    csv_path, png_path, title = args.csv, args.png, args.title
    rows = read_rows(csv_path)
    plt = import_pyplot()

    errors = [float(r["err_p90"]) for r in rows]
    visible = [e for e in errors if e > 1e-5] or errors
    bottom = max(min(visible) / 3, 1e-12)
    top = max(errors) * 2

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.6), dpi=120, sharey=True)
    panels = [("bytes_read_frac", "fraction of KV bytes read (keys + values + summaries)"),
              ("keys_read_frac", "fraction of tokens attended exactly (keys read)")]
    methods = list(dict.fromkeys(r["method"] for r in rows))
    for ax, (column, label) in zip(axes, panels):
        for method in methods:
            points = sorted((float(r[column]), float(r["err_p90"]), float(r["budget"]))
                            for r in rows if r["method"] == method)
            xs = [x for x, _, _ in points]
            ys = [max(y, bottom * 1.05) for _, y, _ in points]  # errors below the axis sit on its edge
            line, = ax.plot(xs, ys, "o-" if len(points) > 1 else "v", label=method,
                            markersize=5 if len(points) > 1 else 9)
            for (x, y, b), shown in zip(points, ys):
                text = f"{b:g}" if len(points) > 1 else f"p90 {y:.1e}"
                ax.annotate(text, (x, shown), textcoords="offset points", xytext=(4, 4 if len(points) > 1 else 8),
                            fontsize=7, color=line.get_color(), ha="left" if len(points) > 1 else "right")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_ylim(bottom, top)
        ax.set_xlabel(label)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("p90 relative L2 error vs dense in double")
    axes[0].legend(fontsize=8, loc="lower left")
    fig.suptitle(title or f"floe-eval: {os.path.basename(csv_path)}", fontsize=10)
    fig.text(0.01, 0.01, "point labels: budget (fraction of N); a method with one point (dense) is drawn at the "
             "bottom edge when its error is below the axis", fontsize=6.5, color="gray")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(png_path)
    print(f"plot_eval.py: wrote {png_path}")


if __name__ == "__main__":
    main(sys.argv)
