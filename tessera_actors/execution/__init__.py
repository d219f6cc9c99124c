"""The execution core the device actors run, and its reference forms."""
