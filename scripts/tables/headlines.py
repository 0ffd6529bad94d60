"""The README's headline figures: one per area, each from the results file its manual page's table is made from, with
a link to that page. The README keeps a newcomer's first ten minutes; the tables themselves live in the manual."""

from __future__ import annotations

from typing import Any

from scripts.tables import steplog
from scripts.tables.provenance import load, measured, sec


def overhead() -> tuple[str, str, str]:
    o = load("overhead")
    cb = o["ratios"]["compute_bound"]
    st = o["step_times"]["compute_bound"]["median_step_time_s"]
    return ("cost over plain PyTorch", f"compute-bound CNN, step time of CMEMI with 1 worker / a plain PyTorch loop: "
            f"**{cb['cmemi_1w_vs_plain']:.2f}×** ({sec(st['cmemi_1w'])} vs {sec(st['plain'])})",
            "docs/benchmarks/index.md")


def recovery() -> tuple[str, str, str]:
    wk = load("recovery")["cmemi_worker_kills"]
    return ("faults", f"worker SIGKILL → its replacement's first gradient accepted: "
            f"**{sec(wk['timeline_median_s']['first_grad_s'])}** (median of {wk['kills']} kills, warm spare), "
            f"{wk['steps']['steps_lost']} steps lost; {steplog.headline()}", "docs/concepts/faults.md")


def startup() -> tuple[str, str, str]:
    st = load("small")["startup"]
    return ("start-up", f"`cmemi up digits` → its first step: **{st['first_step_s']:.1f} s**",
            "docs/benchmarks/small.md")


def compression() -> tuple[str, str, str]:
    """charlm (AdamW) with `powersgd` both ways at the largest rank measured: the recipe for slow links."""
    rows = load("compression")["examples"]["charlm"]
    base = next(x for x in rows if x["codec"] == x.get("downlink", "none") == "none")
    both = [x for x in rows if x["codec"] == x.get("downlink") == "powersgd"]
    x = max(both, key=lambda r: r.get("powersgd_rank") or 0)
    rel = x.get("eval_vs_dense_rel", x["eval_vs_dense"] / base["eval_loss"])
    return ("compression", f"charlm, `powersgd` both ways (rank {x['powersgd_rank']}): **{x['ratio_vs_none']:.1f}×** "
            f"fewer bytes per step than `none`, eval loss {rel:+.1%} against dense both ways",
            "docs/benchmarks/compression.md")


def largest_n(name: str) -> tuple[str, dict[str, Any]]:
    return max(load(name)["by_n"].items(), key=lambda kv: int(kv[0]))


def scaling_out() -> tuple[str, str, str]:
    n, x = largest_n("cluster")
    r = x["runs"]["cmemi_kn_powersgd2"]["step_time_median_s"] / x["runs"]["ddp"]["step_time_median_s"]
    return ("scaling out", f"emulated cluster, N = {n} hosts on shaped links: K = N shards with `powersgd` both ways, "
            f"step time **{r:.2f}×** DDP's (dense)", "docs/benchmarks/cluster.md")


HOME = ("cluster_home_20mbit_kn_near", "cluster_home_20mbit_kn_near2", "cluster_home_20mbit_kn_near3")  # issue 48's home links: whole rounds, int4
# both ways, K = N, at 20 Mbit/s; two runs of one command, as the measured compute bound moves with the machine
HOME_BYTES = "cluster_home_bytes_kn"  # the same recipe's bytes per sample against synchronous cmemi_kn in one run


def local_steps() -> tuple[str, str, str]:
    runs = [largest_n(name) for name in HOME]
    n, x = runs[0]
    home = x["runs"]["cmemi_local_rare_kn"]
    shares = sorted(r["runs"]["cmemi_local_rare_kn"]["of_measured_compute_bound"] for _, r in runs)
    b = load(HOME_BYTES)["by_n"]["8"]["runs"]
    return ("local steps", f"emulated cluster, N = {n} hosts on {x['link']['rate'].replace('mbit', ' Mbit/s')} links: "
            f"whole rounds (H = {home['local_steps']}) with 4-bit changes both ways and a shard on every host at "
            f"**{shares[len(shares) // 2]:.0%}** of the compute bound measured in the same run (median of {len(runs)} "
            f"runs, {shares[0]:.0%}–{shares[-1]:.0%}), "
            f"**{b['cmemi_kn']['bytes_per_sample'] / b['cmemi_local_rare_kn']['bytes_per_sample']:,.0f}×** fewer bytes "
            "per sample than synchronous steps", "docs/benchmarks/local-steps.md")


def memory() -> tuple[str, str, str]:
    d = load("memory")
    k, r = min(d["by_shards"].items(), key=lambda kv: int(kv[0]))
    return ("memory", f"{d['model']['params'] / 1e6:.0f} M parameters, K = {k}: every process's peak summed is "
            f"**{r['cluster_vs_ddp_ranks']:.2f}×** two DDP ranks'", "docs/benchmarks/index.md")


TITLES = {"docs/benchmarks/index.md": "Benchmarks", "docs/concepts/faults.md": "Faults",
          "docs/benchmarks/small.md": "Small models and start-up", "docs/benchmarks/compression.md": "Compression",
          "docs/benchmarks/cluster.md": "The emulated cluster", "docs/benchmarks/local-steps.md": "Local steps"}


def headlines() -> str:
    rows = [overhead(), recovery(), startup(), compression(), scaling_out(), local_steps(), memory()]
    lines = ["| area | headline figure | manual page |", "|---|---|---|"]
    lines += [f"| {area} | {figure} | [{TITLES[page]}]({page}) |" for area, figure, page in rows]
    return "\n".join([*lines, "", measured("overhead", "recovery", *steplog.FILES, "small", "compression", "cluster",
                                           *HOME, HOME_BYTES, "memory")])
