"""Markdown from a results JSON: the detailed table, the summary table, and the README section.

    python -m fastattn.bench.report --readme README.md [--results bench/results/results.json]

rewrites only the part of README.md between `<!-- bench:start -->` and `<!-- bench:end -->`, so
the README's benchmark section is always generated from the committed results, never typed.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

START, END = "<!-- bench:start -->", "<!-- bench:end -->"
PLOTS = {"throughput.png": "forward throughput vs L", "memory.png": "peak extra memory vs L",
         "decode.png": "decode bandwidth vs KV length", "backward.png": "backward throughput vs L"}

_SHORT = (("not available", "n/a"), ("skipped: the dense", "skipped (memory)"),
          ("skipped", "skipped"), ("timed out", "timeout"), ("out of memory", "OOM"),
          ("failed", "failed"), ("round", "partial"))


def short_error(msg: str) -> str:
    for prefix, label in _SHORT:
        if msg.startswith(prefix):
            return label
    return "error"


def _f(x, fmt: str) -> str:
    return "" if x is None else format(x, fmt)


def header(data: dict) -> str:
    m, p = data["meta"], data["probes"]
    v = {k: val for k, val in m["versions"].items() if val}
    vers = ", ".join(f"{k} {val}" for k, val in v.items())
    sg = ", ".join(f"{k[6:]} {p[k]['gflops']:.0f}" for k in p
                   if k.startswith("sgemm-") and "gflops" in p[k])
    bw = p.get("bandwidth_gbytes_per_s")
    commit = f" (fastattn commit {m['fastattn_commit']})" if m.get("fastattn_commit") else ""
    lines = [
        f"- **command:** `{m['command']}`, {m['date']}{commit}, "
        f"took {m.get('elapsed_s', 0) / 60:.1f} min",
        f"- **machine:** {m['cpu']}, {m['cpus']} CPUs, {m['memory_gib']} GiB, {m['system']}; "
        f"**{m['threads']} threads** for every implementation",
        f"- **versions:** {vers}",
        f"- **measured peaks (same run):** float32 GEMM {sg} GF/s (peak = the faster); "
        f"read bandwidth {_f(bw, '.1f')} GB/s",
        f"- load average at start / end: {m.get('load_average_start')} / "
        f"{m.get('load_average_end')} — the machine is shared and noisy: compare ratios of "
        f"interleaved runs more than absolute numbers",
    ]
    missing = {k: r for k, r in m.get("implementations", {}).items() if r}
    if missing:
        lines.append("- **not run here:** " + "; ".join(f"{k} ({r})" for k, r in missing.items()))
    return "\n".join(lines)


def _impls(data: dict) -> list[str]:
    return data["meta"]["impls"]


def summary_table(data: dict) -> str:
    """One row per case, one column per implementation: the headline figure and the torch ratio."""
    impls = _impls(data)
    lines = ["| case | " + " | ".join(impls) + " |", "|---|" + "---:|" * len(impls)]
    for rec in data["records"]:
        decode = rec["shape"]["L"] == 1
        cells = []
        for impl in impls:
            e = rec["results"].get(impl, {"error": "not run"})
            if "time_ms" not in e:
                cells.append(short_error(e["error"]))
                continue
            val = f"{e['gbytes_per_s']:.1f}" if decode else f"{e['gflops']:.1f}"
            ratio = f" ({e['time_vs_torch']:.2f})" if "time_vs_torch" in e else ""
            flag = "*" if "error" in e else ""
            cells.append(f"{val}{ratio}{flag}")
        lines.append(f"| {rec['case']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


SUMMARY_NOTE = ("GF/s (decode rows: GB/s of q, k, v and out moved) and, in brackets, the time "
                "÷ torch's time (median of per-round ratios; below 1 = faster than torch). "
                "Forward FLOPs 4·B·H·L·S·d, causal half, backward 2.5×. "
                "`*`: some rounds failed.")


def detail_table(data: dict) -> str:
    lines = ["| case | implementation | ms | GF/s | % sgemm peak | GB/s | % bandwidth | "
             "time ÷ torch | extra MB | first call s | note |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for rec in data["records"]:
        decode = rec["shape"]["L"] == 1
        for impl, e in rec["results"].items():
            if "time_ms" not in e:
                lines.append(f"| {rec['case']} | {impl} | | | | | | | | | {e['error']} |")
                continue
            # bytes moved only bound decode; for the GEMM-bound cases they would mislead
            gbs, pct_bw = ((_f(e["gbytes_per_s"], ".2f"), _f(e.get("pct_bandwidth"), ".0f"))
                           if decode else ("", ""))
            lines.append(
                f"| {rec['case']} | {impl} | {e['time_ms']:.2f} | {e['gflops']:.1f} | "
                f"{_f(e.get('pct_sgemm'), '.0f')} | {gbs} | "
                f"{pct_bw} | {_f(e.get('time_vs_torch'), '.2f')} | "
                f"{_f(e.get('extra_mb'), '.1f')} | {e['first_call_s']:.2f} | "
                f"{e.get('error', '')} |")
    return "\n".join(lines)


def shapes_note(data: dict) -> str:
    sweeps = {}
    for rec in data["records"]:
        s = rec["shape"]
        sweeps.setdefault(rec["sweep"], s)
    parts = [f"{name}: B={s['B']}, Hq={s['Hq']}, Hkv={s['Hkv']}, d={s['D']}"
             + (", one query (L=1) against S keys" if s["L"] == 1 else ", L=S")
             + (", causal" if s["causal"] else "") for name, s in sweeps.items()]
    return "Shapes (float32) — " + "; ".join(parts) + "."


def markdown(data: dict) -> str:
    """The whole report (results.md)."""
    return "\n\n".join([
        f"# fastattn benchmark ({data['meta']['preset']} preset)", header(data),
        "## Summary", SUMMARY_NOTE, summary_table(data), shapes_note(data),
        "## Every measurement",
        "extra MB: peak RSS during one call minus the RSS before it (output included). "
        "first call: the untimed warm-up (JIT compilation, thread start-up).",
        detail_table(data), ""])


def readme_section(data: dict, results_dir: str, readme_dir: str) -> str:
    rel = os.path.relpath(results_dir, readme_dir).replace(os.sep, "/")
    imgs = [f"![{alt}]({rel}/{name})" for name, alt in PLOTS.items()
            if os.path.exists(os.path.join(results_dir, name))]
    return "\n\n".join([
        f"The last full run, generated from [`{rel}/results.json`]({rel}/results.json) (every "
        f"measurement, with % of the machine's GEMM peak and bandwidth and the peak memory, is "
        f"in [`{rel}/results.md`]({rel}/results.md)). To redo it: `python -m fastattn.bench "
        f"--preset full && python -m fastattn.bench.report --readme README.md`.",
        header(data), SUMMARY_NOTE, summary_table(data), shapes_note(data), "\n".join(imgs)])


def replace_section(text: str, section: str) -> str:
    """`text` with what lies between the markers replaced by `section`; nothing else changes."""
    i, j = text.find(START), text.find(END)
    if i < 0 or j < 0 or j < i:
        raise ValueError(f"the README needs the markers {START} and {END}, in that order")
    return text[:i + len(START)] + "\n" + section.strip() + "\n" + text[j:]


def update_readme(readme: str, results_json: str) -> None:
    with open(results_json) as f:
        data = json.load(f)
    with open(readme) as f:
        text = f.read()
    section = readme_section(data, os.path.dirname(os.path.abspath(results_json)),
                             os.path.dirname(os.path.abspath(readme)))
    new = replace_section(text, section)
    if new != text:
        with open(readme, "w") as f:
            f.write(new)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fastattn.bench.report", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", default="bench/results/results.json")
    ap.add_argument("--readme", help="rewrite this README's benchmark section")
    ap.add_argument("--markdown", help="write the full report here")
    args = ap.parse_args(argv)
    if not (args.readme or args.markdown):
        ap.error("nothing to do: give --readme and/or --markdown")
    if args.markdown:
        with open(args.results) as f:
            text = markdown(json.load(f))
        with open(args.markdown, "w") as f:
            f.write(text)
    if args.readme:
        update_readme(args.readme, args.results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
