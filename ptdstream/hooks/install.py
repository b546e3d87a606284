"""Route executorch's own save paths through ptdstream, for call sites that cannot change.

After :func:`install` (or inside :func:`installed`):

* ``ExecutorchProgramManager(...)`` records the ``ExecutorchBackendConfig`` it was
  built with (so layout parameters need no guessing);
* ``manager.save(path)`` writes the .pte **and** every ``<tag>.ptd`` beside it,
  atomically, and raises on failure (upstream writes only the .pte and logs);
* ``manager.write_to_file(open_file)`` streams the .pte into the caller's file;
* ``manager.write_tensor_data_to_file(outdir)`` writes each .ptd atomically.

Every change is a scoped patch (:func:`ptdstream.upstream.patching.shadowed`):
:func:`uninstall`, or leaving :func:`installed`, restores executorch's own methods.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator

from ..manager import plan_manager
from ..save import save
from ..sources import BufferRing
from ..upstream import adapter
from ..upstream.patching import Scope, shadowed
from ..write.set_writer import write_save_plan
from ..write.stream_sink import StreamSink
from ..write.writer import write_plan

__all__ = ["install", "installed", "record_backend_configs", "stop_recording_backend_configs",
           "uninstall"]

_installed = Scope()
_recording = Scope()


def _save(self, path: str) -> None:
    save(self, path)


def _write_to_file(self, open_file) -> None:
    # The name only labels messages: a file object's ``name`` may be a path, a
    # descriptor number (``tempfile.TemporaryFile``), a pseudo-name or absent.
    name = getattr(open_file, "name", None)
    name = os.path.basename(name) if isinstance(name, str) and name.endswith(".pte") else "model.pte"
    plan = plan_manager(self, name)
    program = plan.program.plan  # type: ignore[union-attr]  # plan_manager always plans the program
    write_plan(program, StreamSink(open_file), BufferRing(count=2))


def _write_tensor_data_to_file(self, outdir) -> None:
    outdir = os.fspath(outdir)
    plan = plan_manager(self, os.path.join(outdir, "unused.pte"), data_dir=outdir)
    write_save_plan(plan.without_program())


@contextlib.contextmanager
def recording_backend_configs() -> Iterator[None]:
    """While active, every ``ExecutorchProgramManager`` built records its config.

    The config is stored on the manager (read back by
    :func:`ptdstream.upstream.adapter.recorded_backend_config`); nothing else
    changes. Managers built meanwhile keep their config after the context exits.
    """
    cls = adapter.manager_class()
    init = cls.__init__

    @functools.wraps(init)
    def recording_init(self, *args, **kwargs):
        config = adapter.backend_config_argument(init, (self,) + args, kwargs)
        setattr(self, adapter.RECORDED_CONFIG_ATTR, config)
        init(self, *args, **kwargs)

    with shadowed(cls, "__init__", recording_init):
        yield


@contextlib.contextmanager
def installed() -> Iterator[None]:
    """``with ptdstream.hooks.install.installed(): ...`` routes saves through
    ptdstream inside, and records configs; everything is restored on exit."""
    cls = adapter.manager_class()
    with recording_backend_configs(), shadowed(cls, "save", _save), \
            shadowed(cls, "write_to_file", _write_to_file), \
            shadowed(cls, "write_tensor_data_to_file", _write_tensor_data_to_file):
        yield


def install() -> None:
    """Route executorch's save paths through ptdstream until :func:`uninstall`
    (idempotent); see the module docstring."""
    _installed.open(installed)


def uninstall() -> None:
    """Restore executorch's own methods (idempotent)."""
    _installed.close()


def record_backend_configs() -> None:
    """Record configs (see :func:`recording_backend_configs`) until
    :func:`stop_recording_backend_configs` (idempotent)."""
    _recording.open(recording_backend_configs)


def stop_recording_backend_configs() -> None:
    """Stop recording configs (managers already built keep theirs)."""
    _recording.close()
