"""Training: the run's settings (config), the loop, its checkpoints, resuming and the data.

``zoo.train`` is the function :func:`zoo.train.loop.train`; import the modules by their full path
(``from zoo.train.config import TrainConfig``)."""
