"""The aggregator's training state and its one step per global step (`Trainer`), split by job.

- `optimizing.py`: `Trainer`: the model, the optimizer and the LR schedule; one step of each per global step.
- `scaler.py`: `LossScaler`: the fp16 loss scale, one decision per step from the overflow flag.
- `rows.py`: `OwnRows`: a sharded server keeps only its own rows, and the leader builds the whole model at the end.
- `outward.py`: `Outward`: what leaves the state: the parameters as they go out to workers, and the result's hashes.

`from cmemi.services.aggregator.common.trainer import Trainer` reads as it did when this was one module.
"""

from cmemi.services.aggregator.common.trainer.optimizing import Trainer
from cmemi.services.aggregator.common.trainer.scaler import LossScaler

__all__ = ["LossScaler", "Trainer"]
