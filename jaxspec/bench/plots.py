"""The benchmark's PNGs (matplotlib, the `plot` extra, imported here only): per temperature and
acceptance setting, decode tokens/s against concurrency for each mode, and the speedup over none;
bars span the repeats (min to max)."""

import os

COLORS = {"none": "tab:gray", "static": "tab:blue", "cap-accept": "tab:orange", "compact": "tab:green"}


def groups(points) -> dict:
    """{(temperature, setting): points}: mode none's points join every setting of their
    temperature (setting None when no spec mode ran)."""
    settings = sorted({p["setting"] for p in points if p["setting"] is not None}) or [None]
    out = {}
    for p in points:
        for setting in settings if p["setting"] is None else [p["setting"]]:
            out.setdefault((p["temperature"], setting), []).append(p)
    return out


def tag(temperature, setting) -> str:
    return f"T{temperature:g}" + ("" if setting is None else f"_{setting}")


def _series(points, mode, field):
    pts = sorted(
        (p for p in points if p["mode"] == mode and p.get(field) and p[field]["mean"] is not None),
        key=lambda p: p["concurrency"],
    )
    c = [p["concurrency"] for p in pts]
    mean = [p[field]["mean"] for p in pts]
    err = [[m - p[field]["min"] for m, p in zip(mean, pts)], [p[field]["max"] - m for m, p in zip(mean, pts)]]
    return c, mean, err


def plot(points, out_dir, title) -> list[str]:
    """Write throughput_<tag>.png and speedup_<tag>.png per group into out_dir; returns the paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import ScalarFormatter

    paths = []
    for (temperature, setting), pts in sorted(groups(points).items(), key=lambda kv: str(kv[0])):
        modes = [m for m in COLORS if any(p["mode"] == m for p in pts)]
        for kind, field, ylabel in (
            ("throughput", "decode_tokens_per_s", "decode tokens/s"),
            ("speedup", "speedup_vs_none", "decode tokens/s / none"),
        ):
            fig, ax = plt.subplots(figsize=(6.4, 4.2))
            for mode in modes:
                c, mean, err = _series(pts, mode, field)
                if c:
                    ax.errorbar(c, mean, yerr=err, marker="o", capsize=3, color=COLORS[mode], label=mode)
            if kind == "speedup":
                ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
            ax.set_xscale("log", base=2)
            ax.xaxis.set_major_formatter(ScalarFormatter())
            ax.set_xlabel("concurrency (requests in flight)")
            ax.set_ylabel(ylabel)
            ax.set_title(f"{title}, T={temperature:g}" + ("" if setting is None else f", {setting}"), fontsize=9)
            ax.grid(True, alpha=0.3)
            ax.legend()
            fig.tight_layout()
            path = os.path.join(out_dir, f"{kind}_{tag(temperature, setting)}.png")
            fig.savefig(path, dpi=120)
            plt.close(fig)
            paths.append(path)
    return paths
