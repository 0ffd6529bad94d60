"""Experiment trackers (`metrics.loggers`): the leader's steps, evaluations, config and events written to
TensorBoard, MLflow and Weights & Biases (or a tracker of your own), off the training path.

- `base.py`: what a tracker is (the calls its writer makes) and the config as flat hyperparameters.
- `registry.py`: each name's class, and the check that its package is installed (one line naming the extra).
- `writer.py`: one tracker's bounded queue and thread: drops and counts when full, disables one that raises,
  abandons one that hangs.
- `hub.py`: the leader's trackers: fans each logged line out to the writers, tails the run's events from Redis.
- `tensorboard.py`, `mlflow.py`, `wandb.py`: the three built-in trackers.
"""
