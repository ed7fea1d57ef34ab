"""results.md: the benchmark's numbers as markdown tables (what README.md's table is made from)."""

from jaxspec.bench.plots import groups
from jaxspec.config import VERIFY_MODES


def _f(v, d=1):
    return "–" if v is None else f"{v:.{d}f}"


def _range(s, d=1):
    """mean (min–max) of a metrics.spread."""
    if s is None or s["mean"] is None:
        return "–"
    return f"{s['mean']:.{d}f} ({s['min']:.{d}f}–{s['max']:.{d}f})"


def _kv(d):
    return "; ".join(f"{k} {_kv(v) if isinstance(v, dict) else v}" for k, v in d.items())


def markdown(results) -> list[str]:
    meta = results["meta"]
    lines = [
        f"# jaxspec bench: {meta['workload']['name']}"
        + (" — SMOKE (CPU: no meaning as timings)" if meta["smoke"] else ""),
        "",
        f"- date: {meta['date']}",
        f"- machine: {meta['machine']}",
        f"- command: `{meta['command']}`",
        f"- workload: {_kv(meta['workload'])}",
        f"- config: {_kv(meta['config'])}",
    ]
    for s in results.get("settings", []):
        if s.get("calibration"):
            c = s["calibration"]
            lines.append(
                f"- setting {s['name']}: a = {c['a']:.4g}, b = {c['b']:.4g} (slope {c['slope']} per std of "
                f"x; predicted mean accept length {c['predicted']:.2f} at block {meta['config']['block']}; "
                f"x mean {c['x']['mean']:.3f}, std {c['x']['std']:.3f} over {c['x']['rows']} rows)"
            )
    lines += [f"- {note}" for note in results.get("notes", [])] + [""]
    lines += [
        "Per concurrency c and mode: decode tokens/s = c x mean per-request (tokens after the first / time "
        "after the first token), mean over repeats (min–max); x none paired by repeat; TTFT ms mean / p50 / "
        "p99; accept = mean accept length; verified and tier = tokens a step verifies (anchors + planned "
        "drafts) and computes (the tier); running = requests a step; steps/s; output tokens/s = all output "
        "tokens / wall.",
        "",
    ]
    for (temperature, setting), pts in sorted(groups(results["points"]).items(), key=lambda kv: str(kv[0])):
        lines += [
            f"## T = {temperature:g}" + ("" if setting is None else f", {setting}"),
            "",
            "| c | mode | decode tok/s | x none | TTFT ms | accept | verified | tier | running | steps/s "
            "| output tok/s | compact >= others |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for p in sorted(pts, key=lambda p: (p["concurrency"], VERIFY_MODES.index(p["mode"]))):
            ttft = "/".join(_f(p[f"ttft_ms_{q}"]["mean"]) for q in ("mean", "p50", "p99"))
            ok = p.get("not_below_others")
            lines.append(
                f"| {p['concurrency']} | {p['mode']} | {_range(p['decode_tokens_per_s'])} "
                f"| {_range(p.get('speedup_vs_none'), 2)} | {ttft} | {_f(p['accept_length']['mean'], 2)} "
                f"| {_f(p['verified_per_step']['mean'])} | {_f(p['tier_tokens_per_step']['mean'])} "
                f"| {_f(p['running']['mean'])} | {_f(p['steps_per_s']['mean'])} "
                f"| {_range(p['output_tokens_per_s'])} | {'–' if ok is None else ('yes' if ok else 'NO')} |"
            )
        lines.append("")
    goals = results.get("goals")
    if goals:
        ok = goals["compact_not_below_others_every_level"]
        lines += [
            "## goals",
            "",
            "- compact >= max(none, static) within the spread at every level: "
            + ("–" if ok is None else ("yes" if ok else "NO")),
            "- c = 1 decode speedup over none: "
            + (", ".join(f"{k} {_f(v, 2)}x" for k, v in goals["c1_speedup_vs_none"].items()) or "–"),
            "- host share of a c = 1 step: "
            + (", ".join(f"{k} {_f(v if v is None else 100 * v)}%" for k, v in goals["c1_host_share"].items()) or "–"),
            "",
        ]
    shares = [h for lv in results["levels"] for h in lv.get("host_share", [])]
    if shares:
        lines += [
            "## host share of a c = 1 step (1 - GPU busy / wall; busy: the time some kernel runs, from a profiler"
            " trace of the host loop)",
            "",
            "| mode | setting | wall ms a step | wall ms traced | GPU busy ms a step | kernel time summed ms "
            "| kernels a step | host share |",
            "|---|---|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {h['mode']} | {h['setting'] or '–'} | {_f(h['wall_ms'], 3)} | {_f(h['traced_wall_ms'], 3)} "
            f"| {_f(h['gpu_busy_ms'], 3)} | {_f(h.get('kernel_sum_ms'), 3)} | {_f(h['kernels_per_step'], 0)} "
            f"| {_f(h['host_share'] and 100 * h['host_share'])}% |"
            for h in shares
        ]
        lines.append("")
    lines += [
        "## compile and cost tables (compiled in warm-up / timed runs: steps and prefills should be 0)",
        "",
        "| c | compile wall s | programs | compiled in warm-up | compiled in timed runs | cost table |",
        "|---|---|---|---|---|---|",
    ]
    for lv in results["levels"]:
        ct = lv.get("cost_table")
        table = (
            "–"
            if ct is None
            else (f"profiled in {ct['seconds']:.1f} s" if ct["profiled"] else "reused")
            + f", noise {ct.get('noise', 0.0):.1%} ({ct['path']})"
        )
        late = sum(
            len(r["compiles"]) for p in results["points"] if p["concurrency"] == lv["concurrency"] for r in p["repeats"]
        )
        warm = [n for n in lv.get("compiled_in_warm_up", []) if "step" in n or "prefill" in n]
        lines.append(
            f"| {lv['concurrency']} | {lv['compile_wall_s']:.1f} | {len(lv['compile'])} | {len(warm)} "
            f"| {late} | {table} |"
        )
    return lines + [""]
