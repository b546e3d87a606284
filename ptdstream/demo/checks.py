"""What the demo proves about the files it saved: the tied embedding is stored once,
and the ExecuTorch runtime's outputs match eager PyTorch."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from . import METHODS

__all__ = ["ATOL", "RuntimeCheck", "TiedEmbedding", "check_runtime", "find_tied_embedding"]

ATOL = 1e-4
RTOL = 1e-4


@dataclass(frozen=True)
class TiedEmbedding:
    """Where the tied embedding's bytes sit in a .ptd.

    ``keys`` all name segment ``segment_index`` (``nbytes`` long);
    ``copies`` counts the segments holding those bytes (1 = stored once).
    """

    keys: tuple[str, ...]
    segment_index: int
    nbytes: int
    copies: int


def find_tied_embedding(ptd_path: str, weight) -> TiedEmbedding:
    """Locate ``weight`` (a contiguous CPU tensor) in ``ptd_path``.

    Reads the file's section map with :func:`ptdstream.format.reader.read_artifact` and
    only the segments of the tensor's size. XNNPACK names the tensor by the
    SHA-256 hex of its bytes; the emitter names it by FQN.

    Raises:
        KeyError: the SHA-256 key is not in the file.
    """
    from ..format.reader import read_artifact

    data = weight.detach().contiguous().numpy().tobytes()
    art = read_artifact(ptd_path)
    key = hashlib.sha256(data).hexdigest()
    index = art.keys[key]
    keys = tuple(k for k, i in art.keys.items() if i == index)
    copies = 0
    with open(ptd_path, "rb") as f:
        for seg in art.segments:
            if seg.nbytes == len(data):
                f.seek(seg.start)
                copies += f.read(seg.nbytes) == data
    return TiedEmbedding(keys, index, len(data), copies)


@dataclass(frozen=True)
class RuntimeCheck:
    """ExecuTorch runtime outputs against eager PyTorch, per method."""

    max_abs_diff: dict[str, float]
    matches: dict[str, bool]
    xnnpack_available: bool

    @property
    def ok(self) -> bool:
        """Whether every output of the runtime matched eager PyTorch's."""
        return all(self.matches.values())


def check_runtime(model, pte_path: str, ptd_path: str, seed: int = 1) -> RuntimeCheck:
    """Run every demo method with the ExecuTorch runtime and compare with ``model``.

    Loads through ``executorch.runtime.Runtime.load_program(pte, data_path=ptd)``
    (1.5.1's Python API taking a .ptd), on fresh random tokens drawn from
    ``seed``; outputs match when ``torch.allclose(atol=ATOL, rtol=RTOL)``.
    """
    import torch
    from executorch.runtime import Runtime

    runtime = Runtime.get()
    program = runtime.load_program(pte_path, data_path=ptd_path)
    generator = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    diffs, matches = {}, {}
    for name, seq_len in METHODS:
        tokens = torch.randint(0, vocab, (1, seq_len), generator=generator)
        got = program.load_method(name).execute([tokens])[0]
        with torch.no_grad():
            want = model(tokens)
        diffs[name] = float((got - want).abs().max())
        matches[name] = bool(torch.allclose(got, want, atol=ATOL, rtol=RTOL))
    return RuntimeCheck(diffs, matches, runtime.backend_registry.is_available("XnnpackBackend"))
