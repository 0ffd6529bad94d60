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
