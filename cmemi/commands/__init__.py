"""The `cmemi` subcommands that start no cluster: they read a run (its Redis or its files) or train in one process.

- `status/`: `cmemi status`: what a run is doing now, from its Redis or its files (a package: see its map).
- `dashboard/`: `cmemi dashboard RUN_DIR`: a live page of the run in the browser (a package: see its map).
- `logs.py`: `cmemi logs RUN_DIR [ROLE]`: the services' logs of a run, merged in time order.
- `events.py`: `cmemi events RUN_DIR`: each fault's recovery timeline, read back from events.jsonl.
- `plot.py`: `cmemi plot RUN_DIR`: loss, eval, learning rate and throughput of a run, faults marked.
- `checkpoints.py`: `cmemi checkpoints list|verify|export RUN_DIR`: inspect, check and export a run's checkpoints.
- `hf_export.py`: `cmemi checkpoints export RUN_DIR --format hf`: a run's weights as a Hugging Face save_pretrained directory.
- `reference.py`: `cmemi reference CONFIG`: the config trained in one process, as the cluster would; its params_sha256.
- `configs.py`: where a config argument points: a YAML path, or the name of an example installed with the package.
"""
