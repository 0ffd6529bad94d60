"""Small models' step time against a plain loop and `cmemi up`'s start-up (bench/small.py), for
docs/benchmarks/small.md."""

from __future__ import annotations

from scripts.tables import provenance
from scripts.tables.provenance import load, measured, measured_at, span


def small() -> str:
    """bench/small.py: small models' step time against a plain loop, and `cmemi up`'s start-up (optional file)."""
    if not (provenance.RESULTS / "small.json").is_file():
        return "No results yet: `make bench BENCHES=small BENCH_ARGS=` writes `bench/results/small.json`."
    d = load("small")
    m = d["machine"]
    lines = [f"Measured with `{d['command']}` on {m['cpus']} CPU cores, torch {m['torch']}, 1-minute load average "
             f"{span([m['loadavg_at_start'][0], m['loadavg_at_end'][0]], '{:.1f}')}; {d['dataset']}, {d['optimizer']}, "
             f"batch {d['global_batch']} in {d['microbatches']} microbatches, {d['steps']} steps "
             f"(median of {d['repeats']}); ms per step = training wall-clock time per step after "
             f"{d['warmup_skipped']} warm-up steps.", "",
             "| workload | plain PyTorch loop (all cores) | CMEMI 1 worker | CMEMI 1 worker, 1 loader | CMEMI 2 workers "
             "| CMEMI 2 workers, 1 loader each |", "|---|---|---|---|---|---|"]
    for wl, x in d["ms_per_step"].items():
        r = d["ratios"][wl]
        cells = [f"{x[v]:.2f} ms ({r[f'{v}_vs_plain']:.2f}×)" if v in x else "–"
                 for v in ("cmemi_1w", "cmemi_1w_loader", "cmemi_2w", "cmemi_2w_loader")]
        lines.append(f"| {wl} | {x['plain']:.2f} ms | " + " | ".join(cells) + " |")
    w = d.get("wire_us_per_message")
    if w:
        lines += ["", "One parameter message (encode, send, receive, decode on loopback), tensor by tensor against "
                  "flat buffers (`shared/wire/layout.py`): " + "; ".join(
                      f"{name} ({x['tensors']} tensors, {x['bytes'] / 1e3:.0f} kB) {x['per_tensor_us']:.0f} → "
                      f"{x['flat_us']:.0f} µs" for name, x in w.items()) + "."]
    st = d["startup"]
    lines += ["", f"`cmemi up digits` → its first step: **{st['first_step_s']:.1f} s** (target ≤ 5 s on an idle machine; "
              f"load average {' '.join(str(x) for x in st['load_avg'])} when it was measured). When each process "
              "reached each phase (seconds since `cmemi up` started; CPU seconds it had used by then):", "",
              "| process | phases | CPU s |", "|---|---|---|"]
    for name, phases in [*st["processes"].items(), ("run", st["run"])]:
        cpu = st["cpu_s"].get(name)
        lines.append(f"| {name} | {', '.join(f'{k} {v:.2f}' for k, v in phases.items())} | "
                     f"{'' if cpu is None else f'{cpu:.2f}'} |")
    lines += ["", measured("small")]
    if (slow := d.get("slow_import")) and "median_first_step_s" in slow:
        t, ok = slow["targets"], {True: "met", False: "missed"}
        lines += ["", f"A user module slow to import and to build its data (`bench/slow_import_model.py`, measured with "
                  f"`{slow['command']}`, median of {len(slow['runs'])}): T = {slow['median_plain_import_and_dataset_s']:.2f} s "
                  f"in a plain Python process; `cmemi up` with 2 workers reached its first step at "
                  f"**{slow['median_first_step_s']:.2f} s** (T + {slow['median_first_step_minus_plain_s']:.2f} s; goal T + 3 s: "
                  f"{ok[t['first_step_within_T_plus_3s']]}) and returned **{slow['median_returned_after_last_step_s']:.2f} s** "
                  f"after its last step (goal ≤ 2 s: {ok[t['returns_within_2s_of_last_step']]}). "
                  + measured_at(slow, "bench/results/small.json (slow_import)")]
    return "\n".join(lines)
