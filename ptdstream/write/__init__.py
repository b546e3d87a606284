"""Write and publish: plans streamed into sinks, temp files synced and published as a set.

* ``tempfiles``: temp, backup and journal names (any byte a name may hold);
  liveness by ``flock``, not pid; folder locks.
* ``sink_protocol``: the ``Sink`` protocol the writer writes to, the
  ``SinkState`` enum, ``write_zeros``.
* ``folder``: the folder step (``prepare_folder``, once per folder before its
  first temp file) and ``resolve_target`` (the file a write to a path replaces).
* ``sink``: ``ChunkedFileSink``, one temp file's life (creates, writes, syncs,
  publishes or aborts it); ``direct_io`` (O_DIRECT staging, several writes in
  flight); ``stream_sink`` (a pipe or standard output).
* ``writer``: one ``FilePlan`` into a sink, every source read once through the
  ring and checked against its planned size, prefix and digest.
* ``publish`` (the folder step once per folder, then a set of synced temp files,
  all or none) over ``journal`` (publishing under a journal, ``recover``,
  ``clean_folder``), ``journal_codec`` (the journal read as untrusted),
  ``journal_state`` (each file compared with what the journal recorded,
  and proven the save's own by its owner and mark),
  ``journal_peers`` (a set across folders), ``journal_write``.
* ``set_writer``: a whole ``SavePlan``.

The publishing protocol, call by call, is in docs/ARCHITECTURE.md.
"""

__all__: list[str] = []
