"""The export's refusal (torch-free, so `python3 -m miles.export --help` answers at once)."""


class ExportError(ValueError):
    """A refusal: the message is the one line the user sees."""
