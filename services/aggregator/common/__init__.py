"""What the leader and every shard k > 0 share: one rule, one place, whichever parameter server runs it.

- `admission.py`: who is a worker of this term, for the leader and every shard alike.
- `intake.py`: one intake for every parameter server: frames in, a message out or a drop.
- `gradients.py`: a gradient (or a shard's slice) decoded by the run's codec, its tensors checked before allocation.
- `misfits.py`: gradients an admitted worker sent that this server cannot take, counted per worker.
- `collector.py`: leases and the ordered summation of one global step's M microbatch gradients (no sockets).
- `trainer/`: the aggregator's model, optimizer and LR scheduler: one step of each per global step (`Trainer`).
- `userstep.py`: the user's optimizer and scheduler step; if it raises, one fatal error that names the step.
- `replicas.py`: the replicas' inner optimizer states (`train.local_steps`, DiLoCo), kept between rounds.
- `pace.py`: local steps: how many replicas a step each worker may hold, from how late its replicas land (a slow
  host costs its share, not everyone's time).
- `publish.py`: the parameters sent out: one copy and one wire encoding per parameter version.
- `outbox.py`: what a parameter server sends through its ROUTER: one logical message, in parts when bigger.
- `evaluation.py`: periodic evaluation in the background, on a copy of the weights, so the step loop does not stall.
- `totals.py`: what a run has done so far across terms (last loss, bytes moved, training time), carried in snapshots.
- `metricsfile.py`: metrics.jsonl appended to by each term's leader: a step's line once, a deposed leader's included.
- `dataprint.py`: the run's dataset fingerprint, held by the aggregator without reading the dataset.
"""
