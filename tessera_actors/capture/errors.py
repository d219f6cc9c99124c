"""The one error of the capture package."""


class CaptureError(RuntimeError):
    """The forward pass cannot be recorded as a static kernel program."""
