"""The stages of a Hugging Face export, printed as they run (:class:`ptdstream.progress.Stages`).

optimum-executorch 1.1.0's ``main_export`` runs, in order
(``optimum/exporters/executorch/__main__.py`` and ``convert.py``): the task's
loader (``from_pretrained``, its quantization and set-up), then the recipe from
``convert.recipe_registry``: ``model.export()`` (one ``torch.export.export`` per
method), ``to_edge_transform_and_lower`` and ``to_executorch``, then the save of
every program (``write_to_file``, ``write_tensor_data_to_file``). Inside
:func:`export_stages` each of these begins a stage line when it starts:

* ``load DIR``: from the start;
* ``torch.export``: each ``torch.export.export`` call while the recipe's
  ``model.export()`` runs, numbered, with the class exported (optimum may
  export a method twice; the program names are known only when it returns);
* ``lower and emit``: when ``model.export()`` returns, naming the programs;
* ``save``: when the recipe returns.

Three hooks, all through :func:`ptdstream.upstream.patching.shadowed` or on
optimum's own model object, restored on leaving: ``torch.export.export``, the
recipe registry ``convert`` reads (a view of the real one whose recipes are
wrapped as they are looked up) and the
``export`` of the model object a recipe receives (an instance attribute).
:func:`export_stages` is entered innermost, so a hook another context set on the
same name first keeps its own (``shadowed`` keeps the first value): then only
the stage lines are missing.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

from ..progress import Stages
from ..upstream.patching import shadowed

__all__ = ["export_stages"]


@contextlib.contextmanager
def export_stages(stages: Stages, model_dir: str) -> Iterator[None]:
    """Print the stages of the optimum export run inside (module docstring) on
    ``stages``; the last one (the save) ends when the block returns. On an error
    the stage that failed prints no ``done`` line."""
    import torch.export
    from optimum.exporters.executorch import convert

    state = {"exporting": False, "methods": 0}
    stages.begin(f"load {model_dir} (from_pretrained and optimum's task set-up)")

    real_export = torch.export.export

    @functools.wraps(real_export)
    def export(mod: Any, *args: Any, **kwargs: Any) -> Any:
        if state["exporting"]:
            state["methods"] += 1
            stages.begin(f"torch.export {state['methods']} ({type(mod).__name__})")
        return real_export(mod, *args, **kwargs)

    recipes = _StagedRecipes(convert.recipe_registry, stages, state)
    try:
        with shadowed(torch.export, "export", export), shadowed(convert, "recipe_registry", recipes):
            yield
    except BaseException:
        stages.abandon()
        raise
    stages.end()


class _StagedRecipes(dict):
    """What ``convert`` reads as ``recipe_registry``: each recipe of the real registry
    (filled by ``discover_recipes()`` when the export starts), looked up there when
    asked for and wrapped by :func:`_staged_recipe`."""

    def __init__(self, registry: dict, stages: Stages, state: dict) -> None:
        super().__init__()
        self._registry, self._stages, self._state = registry, stages, state

    def get(self, name: Any, default: Any = None) -> Any:
        recipe = self._registry.get(name)
        return default if recipe is None else _staged_recipe(name, recipe, self._stages, self._state)

    def __getitem__(self, name: Any) -> Any:
        return _staged_recipe(name, self._registry[name], self._stages, self._state)

    def __contains__(self, name: object) -> bool:
        return name in self._registry

    def __iter__(self) -> Iterator[Any]:
        return iter(self._registry)

    def __len__(self) -> int:
        return len(self._registry)


def _staged_recipe(name: str, recipe: Callable[..., Any], stages: Stages, state: dict) -> Callable[..., Any]:
    """``recipe`` beginning the export, lowering and save stages around its steps."""

    @functools.wraps(recipe)
    def run(model: Any, *args: Any, **kwargs: Any) -> Any:
        real = model.export

        def export(*a: Any, **k: Any) -> Any:
            state["exporting"] = True
            try:
                programs = real(*a, **k)
            finally:
                state["exporting"] = False
            names = list(programs) if isinstance(programs, dict) else []
            which = f"program{'s' * (len(names) != 1)} {', '.join(map(repr, names))}" if names else "the programs"
            stages.begin(f"lower and emit {which} (recipe {name}: to_edge_transform_and_lower, to_executorch)")
            return programs

        model.export = export  # the object optimum's task made for this export, not upstream code
        try:
            managers = recipe(model, *args, **kwargs)
        finally:
            vars(model).pop("export", None)
        stages.begin(f"save {', '.join(f'{n}.pte' for n in managers)} and its .ptd files with ptdstream")
        return managers

    return run
