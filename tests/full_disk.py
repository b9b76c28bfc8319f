"""A stand-in for ``open`` on a full disk, for monkeypatching into the module under test: the
file opens, and its first write raises ENOSPC (OSError 28) as a real full disk does."""


class FullDiskFile:
    def __init__(self, *args, **kwargs):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def write(self, text):
        raise OSError(28, "No space left on device")
