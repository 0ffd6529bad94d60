"""Coordination through Redis: what may be lost when Redis restarts empty, and what may not.

- keys        every Redis key CMEMI uses, under cmemi:{run}:
- membership  register, heartbeat with a TTL, fences, the events stream
- counters    incarnations and terms that only ever grow, never from a wall clock
- watch       Redis reads off a service's loop, on a thread that keeps the last answer
- heard       the leader's word on each worker (when it last heard it over ZeroMQ): a second liveness channel
"""
