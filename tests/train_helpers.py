"""Settings of the short training runs the tests make (`draftsmith.train.TrainConfig` fields): no warmup, no held-out
split, no checkpoints but the final one, no progress bar, TensorBoard or plot — what the run computes is unchanged."""

QUIET_RUN = dict(warmup=0, eval_fraction=0.0, save_every=0, progress=False, tensorboard=False, plot=False)


def no_log(*a, **k):
    """A `log=` callback that prints nothing."""
