"""The operating system layer: page-cache control, writeback, file primitives, publishing calls.

* ``pagecache``: fadvise/madvise/mincore; ``release_mapped`` (unmap a file
  mapping's range keeping its page cache; ``MADV_DONTNEED`` only where
  ``private_copies`` (pagemap) finds no written private page); ``drop_read`` (a
  sequential reader's drop, from the 2 MiB folio block a piece starts in and past
  the read-ahead at its end).
* ``writeback``: a thread that sends written windows to disk with
  ``sync_file_range`` and drops them once written, so the page cache holds a few
  windows (the sink's, and each rank's of :mod:`ptdstream.distributed`).
* ``threads``: ``FdThread``, the writer, writeback and O_DIRECT threads, waited
  for through Ctrl-C before their file descriptor is closed.
* ``files``: exact ``pread``/``pwrite``, input checks, ``open_input`` /
  ``open_input_fd`` (every input opened non-blocking, a regular file only: a FIFO,
  socket, device or folder refused by name and kind), ``same_file`` /
  ``refuse_overwrite``, ``stdout_input`` / ``refuse_stdout_input`` (standard output
  open on an input; ``-`` compares stdin's file), ``refuse_stdin_output`` (standard
  input open on an output), ``files_of`` (a folder input's files), the
  case-sensitivity probe.
* ``heap``: ``malloc_trim``, the C heap's free pages handed back to the system;
  ``reusing_heap_blocks`` (a quantization's temporaries reused from the heap,
  glibc's mmap and trim thresholds raised and then restored).
* ``fsops``: every publishing rename, link, unlink and fsync, behind one hook
  that tests use to kill a process at each of them.
* ``marks``: the random mark (an extended attribute) ptdstream puts on each temp
  file it creates, which recovery checks before it moves or removes one.
"""

__all__: list[str] = []
