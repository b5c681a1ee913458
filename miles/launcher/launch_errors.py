"""The errors of a launch refused before anything started: raised by train_launch and the checks it
runs first (launch_checks)."""


class LaunchError(RuntimeError):
    """A launch refused before anything started; the message says why and how to fix it."""


class TrainArgvError(LaunchError):
    """train_diffusion.py's own parser or rules reject the assembled argv."""
