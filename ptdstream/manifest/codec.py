"""An integrity manifest's data (:class:`IntegrityManifest`) and its bytes in
ptdstream's own flatbuffer schema (``schema/manifest.fbs``, identifier ``PSM1``,
generated code in ``ptdstream/manifest/manifest_fb``): :func:`to_bytes` (deterministic)
and :func:`from_bytes` (bounded work on untrusted input)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import flatbuffers

from ..errors import FormatError
from ..format.fb_roots import shown
from .naming import MIN_PIECE_NBYTES

__all__ = [
    "ALGORITHM",
    "IDENTIFIER",
    "MIN_PIECE_NBYTES",
    "FileManifest",
    "IntegrityManifest",
    "SectionEntry",
    "check_entry",
    "from_bytes",
    "to_bytes",
]

ALGORITHM = "xxh3-128"
IDENTIFIER = b"PSM1"
#: The largest block size a manifest may give (bytes): a block is buffered whole
#: while it is checked (ptdstream writes 4 KiB blocks).
MAX_BLOCK_NBYTES = 1 << 20
#: The smallest block size a manifest may give (bytes, unless 0: no blocks): the
#: 4 KiB blocks ptdstream writes; smaller ones would cost a check per few bytes.
MIN_BLOCK_NBYTES = 4096


@dataclass(frozen=True)
class SectionEntry:
    """A section: name, first key (or None), offset and size in bytes, and (version >= 2)
    the xxh3-128 digest of its bytes."""

    name: str
    key: str | None
    offset: int
    nbytes: int
    digest: bytes | None = None


@dataclass(frozen=True)
class FileManifest:
    """One file's entry: name, kind ("pte"/"ptd"/"file"), size and piece size in
    bytes, piece digests (16 bytes each), sections, and ``(key, nbytes, digest)``."""

    name: str
    kind: str
    nbytes: int
    piece_nbytes: int
    pieces: tuple[bytes, ...]
    sections: tuple[SectionEntry, ...]
    keys: tuple[tuple[str, int, bytes], ...]
    block_nbytes: int = 0
    blocks: tuple[int, ...] = ()


@dataclass(frozen=True)
class IntegrityManifest:
    """A whole manifest: one :class:`FileManifest` per file, in the order given."""

    files: tuple[FileManifest, ...]
    algorithm: str = ALGORITHM
    version: int = 2


def to_bytes(manifest: IntegrityManifest) -> bytes:
    """Serialize with the generated builder (``ptdstream/manifest/manifest_fb``); deterministic."""
    from .manifest_fb import FileEntry as FE
    from .manifest_fb import KeyFingerprint as KF
    from .manifest_fb import Manifest as M
    from .manifest_fb import Section as S
    from .manifest_fb.Digest128 import CreateDigest128

    b = flatbuffers.Builder(1024)

    def string(value: str) -> int:  # names and keys read from files: any bytes (surrogateescape)
        return b.CreateString(value, errors="surrogateescape")

    def digest_vector(start_fn, digests: Sequence[bytes]) -> int:
        start_fn(b, len(digests))
        for d in reversed(digests):
            CreateDigest128(b, int.from_bytes(d[:8], "little"), int.from_bytes(d[8:], "little"))
        return b.EndVector()

    def table_vector(start_fn, offsets: list[int]) -> int:
        start_fn(b, len(offsets))
        for o in reversed(offsets):
            b.PrependUOffsetTRelative(o)
        return b.EndVector()

    file_offsets = []
    for fm in manifest.files:
        sections = []
        for s in fm.sections:
            name = string(s.name)
            key = string(s.key) if s.key is not None else None
            S.SectionStart(b)
            S.SectionAddName(b, name)
            if key is not None:
                S.SectionAddKey(b, key)
            S.SectionAddOffset(b, s.offset)
            S.SectionAddSize(b, s.nbytes)
            if s.digest is not None:
                S.SectionAddDigest(b, CreateDigest128(b, int.from_bytes(s.digest[:8], "little"),
                                                      int.from_bytes(s.digest[8:], "little")))
            sections.append(S.SectionEnd(b))
        keys = []
        for key_text, nbytes, digest in fm.keys:
            k = string(key_text)
            KF.KeyFingerprintStart(b)
            KF.KeyFingerprintAddKey(b, k)
            KF.KeyFingerprintAddSize(b, nbytes)
            KF.KeyFingerprintAddDigest(
                b,
                CreateDigest128(b, int.from_bytes(digest[:8], "little"), int.from_bytes(digest[8:], "little")),
            )
            keys.append(KF.KeyFingerprintEnd(b))
        pieces = digest_vector(FE.FileEntryStartPiecesVector, fm.pieces)
        section_vec = table_vector(FE.FileEntryStartSectionsVector, sections)
        key_vec = table_vector(FE.FileEntryStartKeysVector, keys)
        blocks = None
        if fm.block_nbytes:
            FE.FileEntryStartBlocksVector(b, len(fm.blocks))
            for check in reversed(fm.blocks):
                b.PrependUint32(check)
            blocks = b.EndVector()
        name = string(fm.name)
        kind = string(fm.kind)
        FE.FileEntryStart(b)
        FE.FileEntryAddName(b, name)
        FE.FileEntryAddKind(b, kind)
        FE.FileEntryAddSize(b, fm.nbytes)
        FE.FileEntryAddPieceSize(b, fm.piece_nbytes)
        FE.FileEntryAddPieces(b, pieces)
        FE.FileEntryAddSections(b, section_vec)
        FE.FileEntryAddKeys(b, key_vec)
        if blocks is not None:
            FE.FileEntryAddBlockSize(b, fm.block_nbytes)
            FE.FileEntryAddBlocks(b, blocks)
        file_offsets.append(FE.FileEntryEnd(b))
    files = table_vector(M.ManifestStartFilesVector, file_offsets)
    algorithm = b.CreateString(manifest.algorithm)
    M.ManifestStart(b)
    M.ManifestAddVersion(b, manifest.version)
    M.ManifestAddAlgorithm(b, algorithm)
    M.ManifestAddFiles(b, files)
    b.Finish(M.ManifestEnd(b), file_identifier=IDENTIFIER)
    return bytes(b.Output())


def from_bytes(data: bytes, name: str = "manifest") -> IntegrityManifest:
    """Parse a manifest.

    The work is bounded by the data's size, as for the .pte/.ptd readers: tables
    and strings may be shared by many offsets in a flatbuffer (a few KB naming a
    million entries), so every entry and string byte read is counted against a
    budget of ``4 * len(data) + 4096``; a manifest that exceeds it is refused
    instead of being expanded.

    Every count and size of a file entry is checked against the file size it
    gives before the manifest is returned (:func:`check_entry`): piece and block
    sizes within bounds, one piece digest per piece and one check per block,
    sections and keys inside the file. The files they describe are checked
    against them when verified, in bounded reads.

    Raises:
        FormatError: wrong identifier, a structure that does not parse or points
            outside the data, more work than its size allows, or a file entry
            whose counts or sizes do not fit (naming the manifest, the file and
            the field).
    """
    from .manifest_fb.Manifest import Manifest as M

    if len(data) < 8 or data[4:8] != IDENTIFIER:
        raise FormatError(f"{name}: not a ptdstream manifest (identifier {bytes(data[4:8])!r})")
    budget = [len(data) + 4096]

    def spend(units: int) -> None:
        budget[0] -= units
        if budget[0] < 0:
            raise FormatError(
                f"{name}: manifest describes more entries than its {len(data)} bytes can hold "
                "(tables shared by many offsets); refused"
            )

    def text(value) -> str:
        spend(len(value) if value is not None else 0)
        return _str(value)

    try:
        root = M.GetRootAs(data, 0)
        files = []
        spend(root.FilesLength())
        for i in range(root.FilesLength()):
            fe = root.Files(i)
            spend(fe.PiecesLength() + fe.SectionsLength() + fe.KeysLength())
            pieces = tuple(_digest(fe.Pieces(j)) for j in range(fe.PiecesLength()))
            sections = []
            for j in range(fe.SectionsLength()):
                sec = fe.Sections(j)
                key = sec.Key()
                digest = sec.Digest()
                sections.append(SectionEntry(text(sec.Name()), text(key) if key is not None else None,
                                             sec.Offset(), sec.Size(),
                                             _digest(digest) if digest is not None else None))
            spend(fe.BlocksLength())
            blocks = tuple(fe.Blocks(j) for j in range(fe.BlocksLength()))
            keys = []
            for j in range(fe.KeysLength()):
                k = fe.Keys(j)
                keys.append((text(k.Key()), k.Size(), _digest(k.Digest())))
            entry = FileManifest(text(fe.Name()), text(fe.Kind()), fe.Size(), fe.PieceSize(), pieces,
                                 tuple(sections), tuple(keys), fe.BlockSize(), blocks)
            check_entry(entry, i, name)
            files.append(entry)
        return IntegrityManifest(tuple(files), text(root.Algorithm()), root.Version())
    except FormatError:
        raise
    except Exception as e:  # noqa: BLE001 - the generated reader trusts its input
        raise FormatError(f"{name}: manifest does not parse ({type(e).__name__}: {e})") from None


def check_entry(entry: FileManifest, index: int, name: str = "manifest") -> None:
    """Refuse a file entry whose counts and sizes do not fit its file size
    (``entry.nbytes``): a piece size below :data:`MIN_PIECE_NBYTES`, a block
    size other than 0 or within ``[MIN_BLOCK_NBYTES, MAX_BLOCK_NBYTES]`` (a block
    is buffered whole), a
    piece count other than ``ceil(nbytes / piece_size)``, a block count other
    than ``ceil(nbytes / block_size)`` (0 without blocks), a section or key
    reaching past the file's end. ``index`` is the entry's place in the manifest.

    Raises:
        FormatError: naming the manifest ``name``, the entry, the field and both numbers.
    """
    where = f"{name}: file entry {index} ({shown(entry.name, True)})"

    def refuse(field: str, got: int, want: str) -> None:
        raise FormatError(f"{where}: {field} is {got}, {want}: the manifest does not describe this file "
                          "(damaged or not written by ptdstream); refused, write it again with ptdstream manifest")

    nbytes = entry.nbytes
    if entry.piece_nbytes < MIN_PIECE_NBYTES:
        refuse("piece_size", entry.piece_nbytes, f"less than the {MIN_PIECE_NBYTES} bytes a piece may have")
    if entry.block_nbytes > MAX_BLOCK_NBYTES:
        raise FormatError(f"{name}: file entry {index} gives block size {entry.block_nbytes} bytes, more than "
                          f"the {MAX_BLOCK_NBYTES} a manifest may give (ptdstream writes 4096); refused")
    if 0 < entry.block_nbytes < MIN_BLOCK_NBYTES:
        refuse("block_size", entry.block_nbytes, f"less than the {MIN_BLOCK_NBYTES} bytes a block may have "
               "(0: no blocks; ptdstream writes 4096)")
    want = -(-nbytes // entry.piece_nbytes)
    if len(entry.pieces) != want:
        refuse("the count of pieces", len(entry.pieces),
               f"not the {want} pieces of {entry.piece_nbytes} bytes its size {nbytes} needs")
    want = -(-nbytes // entry.block_nbytes) if entry.block_nbytes else 0
    if len(entry.blocks) != want:
        refuse("the count of blocks", len(entry.blocks),
               f"not the {want} blocks of {entry.block_nbytes} bytes its size {nbytes} needs")
    for j, section in enumerate(entry.sections):
        if section.offset + section.nbytes > nbytes:
            refuse(f"section {j} ({shown(section.name, True)}) offset + size", section.offset + section.nbytes,
                   f"past the file's end at {nbytes}")
    for key, key_nbytes, _ in entry.keys:
        if key_nbytes > nbytes:
            refuse(f"key {shown(key, True)} size", key_nbytes, f"more than the file's size {nbytes}")


def _str(value) -> str:
    return value.decode("utf-8", "surrogateescape") if isinstance(value, bytes) else str(value)


def _digest(d) -> bytes:
    return d.Lo().to_bytes(8, "little") + d.Hi().to_bytes(8, "little")
