"""Route executorch's own save paths through ptdstream, for call sites that cannot change.

After :func:`install`:

* ``ExecutorchProgramManager(...)`` records the ``ExecutorchBackendConfig`` it was
  built with (so layout parameters need no guessing);
* ``manager.save(path)`` writes the .pte **and** every ``<tag>.ptd`` beside it,
  atomically, and raises on failure (upstream writes only the .pte and logs);
* ``manager.write_to_file(open_file)`` streams the .pte into the caller's file;
* ``manager.write_tensor_data_to_file(outdir)`` writes each .ptd atomically.

:func:`uninstall` restores the originals; :func:`installed` is the context-manager form.
"""

from __future__ import annotations

import contextlib
import os
from typing import Dict, Iterator

from .config import record_backend_configs, stop_recording_backend_configs

_ORIGINALS: Dict[str, object] = {}


def _save(self, path: str) -> None:
    from .save import save

    save(self, path)


def _write_to_file(self, open_file) -> None:
    from .save import plan_manager
    from .sink import StreamSink
    from .sources import BufferRing
    from .writer import write_plan

    name = os.path.basename(getattr(open_file, "name", "model.pte") or "model.pte")
    plan = plan_manager(self, "model.pte" if not str(name).endswith(".pte") else str(name))
    _, pte_plan = plan.files[-1]
    write_plan(pte_plan, StreamSink(open_file), BufferRing(count=2))


def _write_tensor_data_to_file(self, outdir) -> None:
    from .save import SavePlan, plan_manager, write_save_plan

    plan = plan_manager(self, os.path.join(os.fspath(outdir), "unused.pte"), data_dir=os.fspath(outdir))
    write_save_plan(SavePlan(plan.files[:-1], plan.options, plan.dedup_saved_nbytes))


def install() -> None:
    """Patch ``ExecutorchProgramManager`` (idempotent); see the module docstring."""
    from executorch.exir import ExecutorchProgramManager

    record_backend_configs()
    for name, fn in (
        ("save", _save),
        ("write_to_file", _write_to_file),
        ("write_tensor_data_to_file", _write_tensor_data_to_file),
    ):
        current = getattr(ExecutorchProgramManager, name)
        if current is not fn:
            _ORIGINALS.setdefault(name, current)
            setattr(ExecutorchProgramManager, name, fn)


def uninstall() -> None:
    """Restore executorch's own methods."""
    from executorch.exir import ExecutorchProgramManager

    for name, fn in _ORIGINALS.items():
        setattr(ExecutorchProgramManager, name, fn)
    _ORIGINALS.clear()
    stop_recording_backend_configs()


@contextlib.contextmanager
def installed() -> Iterator[None]:
    """``with ptdstream.patch.installed(): ...`` routes saves through ptdstream inside."""
    install()
    try:
        yield
    finally:
        uninstall()
