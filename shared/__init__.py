"""The shared library every service and command builds on (installed as `cmemi.shared`); it imports no service.

One folder per concern:

- wire/         the wire format: messages, their parts, size limits, security, same-host links, flat layouts
- compression/  gradient codecs (worker encodes, aggregator decodes) and the compressed downlink
- core/         the determinism rules: data sharding, the reduction tree, the chunk grid, buffers, fragments
- config/       the config schema, its loading, and the user code it names (plugins, initial weights)
- coordination/ Redis: keys, membership and heartbeats, counters that only grow, watched reads
- runtime/      what every process does: start-up, logging, metrics, exit codes, lifelines, the zygote
- memory/       memory a process hands over or back: shared-memory slots, the C heap's trim
- errors.py     the one error tree (CmemiError: UserError, WireError, FaultError, Interrupt)
"""
