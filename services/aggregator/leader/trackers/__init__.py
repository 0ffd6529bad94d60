"""Experiment trackers (`metrics.loggers`): the leader's steps, evaluations, config and events written to
TensorBoard, MLflow and Weights & Biases (or a tracker of your own), off the training path.

- `base.py`: what a tracker is (the calls its writer makes) and the config as flat hyperparameters.
- `registry.py`: each name's class, and the check that its package is installed (one line naming the extra).
- `writer.py`: one tracker's bounded queue and thread: drops and counts when full, disables one that raises,
  abandons one that hangs.
- `written.py`: what a tracker has written for sure, so a restarted leader's replay of metrics.jsonl skips it.
- `hub.py`: the leader's side: each logged line into a bounded queue for the trackers' process, the run's
  events tailed from Redis (a restarted leader carries on the same tracker runs after replaying the lines before
  it); at the end, the process's summary (or, if it does not answer, its kill).
- `child.py`: the trackers' own process (their packages out of the leader's interpreter lock): a writer each.
- `tensorboard.py`, `mlflow.py`, `wandb.py`: the three built-in trackers.
"""
