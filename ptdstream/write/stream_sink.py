"""A sink over a caller's open file (upstream's ``write_to_file(open_file)``)."""

from __future__ import annotations

from .sink import write_zeros


class StreamSink:
    """Write to an already-open binary file object (``io.BufferedIOBase``, ``BytesIO``).

    For callers that own the file (upstream's ``write_to_file(open_file)``):
    nothing is atomic or synced here; that is the caller's file.
    """

    def __init__(self, fileobj) -> None:
        self._file = fileobj
        self.nbytes = 0

    def write(self, data) -> None:
        view = memoryview(data).cast("B")
        done = 0
        while done < len(view):
            n = self._file.write(view[done:])
            done += len(view) - done if n is None else n
        self.nbytes += len(view)

    def write_zeros(self, nbytes: int) -> None:
        write_zeros(self.write, nbytes)
