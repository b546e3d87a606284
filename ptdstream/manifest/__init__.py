"""Integrity manifests of a saved set: written by the save, checked by verify.

A manifest (``schema/manifest.fbs``, identifier ``PSM1``) lists, for each file: its
name (no folder), kind, size, every section (from :mod:`ptdstream.format.reader`), the
xxh3-128 digest of every fixed-size piece (8 MiB by default; the last may be
shorter) and, for each named-data key, the xxh3-128 fingerprint of its bytes.
Its bytes depend only on the files it describes: files are listed in the order
given, sections in file order, keys in the file's key order.

``describe`` writes one (``ptdstream.save(..., manifest=True)``, ``ptdstream
manifest``), ``verify`` checks files against one (``ptdstream verify
--manifest``); ``naming`` holds what a command line checks before the readers
load (the default manifest path, the smallest piece size); ``codec`` holds its
data and bytes (every count and size checked against the file size it gives), ``narrow`` the finer digests that locate a
difference, ``manifest_fb`` the code flatc generates from the schema
(``tools/gen_manifest_schema.sh``).
"""

__all__: list[str] = []
