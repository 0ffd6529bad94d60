"""Lower bounds on a synchronous data-parallel step's communication time, for `bench/cluster.py`.

N hosts, one link of R bit/s each way per host, P bytes of gradients (and as many of parameters):
- a single parameter server receives N·P and sends N·P through its one link. Sent one after the other
  (all gradients in, then all parameters out, as a synchronous server with no pipelining does) that is
  2·N·P/R; perfectly overlapped on a full-duplex link, N·P/R;
- ring all-reduce moves 2(N−1)/N·P each way per host: 2(N−1)/N·P/R.
Wire overheads (TCP/IP headers, message headers) and compute come on top.
"""

from __future__ import annotations


def comm_bounds_s(n: int, param_bytes: int, rate_bit_s: float) -> dict[str, float]:
    """Seconds per step, communication only, for n hosts on links of rate_bit_s each way."""
    if n < 1 or param_bytes <= 0 or rate_bit_s <= 0:
        raise ValueError(f"need n >= 1, param_bytes > 0, rate_bit_s > 0 (got {n}, {param_bytes}, {rate_bit_s})")
    p = param_bytes * 8 / rate_bit_s  # one model's worth of bytes through one link
    return {
        "single_server_sequential_s": 2 * n * p,
        "single_server_full_duplex_s": n * p,
        "ring_allreduce_s": 2 * (n - 1) / n * p,
        # K = n shards on the worker hosts: each host sends n-1 slices of P/n out and gets as many in, each way
        "colocated_shards_full_duplex_s": 2 * (n - 1) / n * p,
        # the same with compressed gradients: only the dense parameters (n-1 slices out of each host) remain
        "colocated_shards_params_only_s": (n - 1) / n * p,
        # n dedicated servers: each worker pushes P and pulls P (one each way, overlapped: full duplex)
        "dedicated_servers_full_duplex_s": p,
    }


def local_step_bounds_s(n: int, param_bytes: int, state_bytes: int, rate_bit_s: float, compute_s: float,
                        fragments: int = 1) -> dict[str, float]:
    """Seconds per step of the servers with local steps (docs/design/local-steps.md §10, "where the states go"): n hosts,
    each a worker with one replica and a co-located shard (K = n; the leader is shard 0), `compute_s` of compute per
    step (a round: H inner steps; streaming, F = `fragments` > 1: a segment of H / F), `state_bytes` of inner
    optimizer state per replica (SGD with momentum: P; Adam: 2P).

    A host's busiest direction is its ingress: the slices of the changes its shard collects ((n − 1)/n of P, or of P/F
    streaming) and then the other shards' slices of the parameters (as many). Whole rounds do that after their compute
    (a round starts from θ_t); streaming computes the next segment while the step is collected, so its link time
    overlaps compute. The states: whole rounds, every replica's every round (S); streaming, its parameters too (S + P),
    every F − 1 segments (`fragments.snapshot_period`), so R / (F − 1) of them a step. Placements:
    - `leader_s`: every state into the leader (today), on the step's path: the step commits once they are in;
    - `spread_s`: replica r's to shard r mod K, still beside its change: each server takes 1/K of them;
    - `after_change_s` (whole rounds): into the leader after the change, landing during the next round's compute
      (which needs the previous round's parameters kept by the servers until they land);
    - `no_states_s`: none at all, the ceiling of any placement.
    Wire overheads, the commit's round trip and CPU come on top."""
    if n < 1 or param_bytes <= 0 or state_bytes < 0 or rate_bit_s <= 0 or compute_s < 0 or fragments < 1:
        raise ValueError(f"need n >= 1, param_bytes > 0, state_bytes >= 0, rate_bit_s > 0, compute_s >= 0, fragments >= 1 "
                         f"(got {n}, {param_bytes}, {state_bytes}, {rate_bit_s}, {compute_s}, {fragments})")
    byte_s = rate_bit_s / 8
    slices = (n - 1) / n * param_bytes / fragments  # a host's ingress of the changes' slices, and of the parameters'
    if fragments > 1:
        states = n * (state_bytes + param_bytes) / max(1, fragments - 1)
    else:
        states = n * state_bytes
    off_host = (n - 1) / n  # the share of the states that crosses a link (a replica on the leader's host does not)

    def step(state_in: float) -> float:
        link = (2 * slices + state_in) / byte_s
        return max(compute_s, link) if fragments > 1 else compute_s + link

    out = {"compute_s": compute_s, "no_states_s": step(0), "leader_s": step(off_host * states),
           "spread_s": step(off_host * states / n)}
    if fragments == 1:
        out["after_change_s"] = max(out["no_states_s"], off_host * states / byte_s)
    return out
