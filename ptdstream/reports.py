"""The report protocol every ptdstream operation returns.

Save, verify, inspect, manifest, pack, unpack and extract each return a frozen
dataclass mixing in :class:`Report`: ``summary()`` is text for people (one or a
few lines), ``to_dict()`` is plain data (fields, nested dataclasses as dicts, plus
the derived properties named in ``derived``), ``to_json()`` is that as a JSON
string. Bytes become hex strings and enums their values in JSON.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, ClassVar

__all__ = ["RATE_MIN_NBYTES", "Report", "rate"]

#: The fewest bytes for which a summary prints a rate (GB/s, MB/s): 64 MiB, the page-drop
#: window. Below it the fixed costs of a write (an fsync of each file and of its folder,
#: the renames, the journal: tens of milliseconds on a disk, whatever the size) make most
#: of the time, so a rate measures that latency, not throughput: a 41 KB ``.ptd`` written
#: in 0.02 s would read "0.00 GB/s". The fields (``gbps``, ``mbps``) are there whatever the size.
RATE_MIN_NBYTES = 64 << 20


def rate(nbytes: int, seconds: float, unit: str = "GB/s") -> str:
    """``"1.23 GB/s"`` (or ``"123 MB/s"``) of ``nbytes`` in ``seconds``, or ``""`` below
    :data:`RATE_MIN_NBYTES` or for no time: where a rate would not mean throughput."""
    if nbytes < RATE_MIN_NBYTES or seconds <= 0:
        return ""
    if unit == "MB/s":
        return f"{nbytes / seconds / 1e6:.0f} MB/s"
    return f"{nbytes / seconds / 1e9:.2f} GB/s"


class Report:
    """Mixin for report dataclasses: ``summary()``, ``to_dict()``, ``to_json() -> str``."""

    #: Properties added to :meth:`to_dict` beside the dataclass fields (``"ok"``, ``"gbps"``...).
    derived: ClassVar[tuple[str, ...]] = ()

    def summary(self) -> str:
        """Text for people: one line or a few."""
        raise NotImplementedError

    def to_dict(self) -> dict:
        """The fields (nested dataclasses as dicts) and the :attr:`derived` properties."""
        out = dataclasses.asdict(self)  # type: ignore[call-overload]  # every Report is a dataclass
        for name in self.derived:
            out[name] = getattr(self, name)
        return out

    def to_json(self) -> str:
        """:meth:`to_dict` as indented JSON (bytes as hex, enums as values)."""
        import json

        return json.dumps(self.to_dict(), indent=2, default=_plain)

    def write_json(self, stream) -> None:
        """Write :meth:`to_json`'s text to the text ``stream``, followed by a newline,
        piece by piece: the whole text is never held (100,000 keys make 85 MB of
        JSON, whose pieces ``json.dumps`` would keep in a list first)."""
        import json

        encoder = json.JSONEncoder(indent=2, default=_plain)
        buffer, size = [], 0
        for chunk in encoder.iterencode(self.to_dict()):
            buffer.append(chunk)
            size += len(chunk)
            if size >= 1 << 16:
                stream.write("".join(buffer))
                buffer, size = [], 0
        buffer.append("\n")
        stream.write("".join(buffer))


def _plain(value: Any) -> Any:
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value).hex()
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    return str(value)
