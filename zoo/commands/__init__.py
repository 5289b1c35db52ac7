"""Subcommands of the ``zoo`` command line, one module each."""


def add_device(p):
    """The ``--device`` option of a command that runs a model."""
    p.add_argument("--device", default=None,
                   help="device to run on: cpu, cuda, cuda:1, ... (default: the first GPU when there is one, else cpu)")


def device_of(value):
    """``--device``, else the device zoo would use (the first GPU when there is one, else the CPU); a
    device torch does not know, or a GPU that is not there, is a ValueError naming the option."""
    import torch

    if value is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(value)
    except RuntimeError:
        raise ValueError(f"--device {value!r} is not a device (cpu, cuda, cuda:1, mps, ...)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {value}: this torch has no CUDA device (torch.cuda.is_available() is False)")
    return device
