"""Check written artifacts: byte identity (``compare``), what the runtime's loaders
check (``structure``, over the runtime's own rules in ``runtime/``) and what is
inside (``inspection``). Integrity manifests are their own stage: :mod:`ptdstream.manifest`."""

__all__: list[str] = []
