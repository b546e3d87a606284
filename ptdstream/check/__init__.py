"""Check written artifacts: byte identity (``compare``), what the runtime's loaders
check (``structure``), what is inside (``inspection``) and integrity manifests
(``manifest``, with its generated flatbuffer code in ``manifest_fb``)."""

__all__: list[str] = []
