"""Write and publish: plans streamed into sinks, temp files synced and renamed.

``tempfiles`` (names, leftovers) -> ``sink`` (the ``Sink`` protocol,
``ChunkedFileSink``), ``stream_sink`` -> ``writer`` (one file's plan into a sink)
-> ``publish`` (a set of synced temp files, all or none) -> ``set_writer`` (a
whole ``SavePlan``).
"""

__all__: list[str] = []
