"""Probes of upstream code shared by the door's and the hooks' tests."""

import inspect


def global_users(module, name):
    """Names of the module's functions (methods included) whose code loads the global ``name``."""
    import dis

    def codes(code):
        yield code
        for const in code.co_consts:
            if inspect.iscode(const):
                yield from codes(const)

    functions = [v for v in vars(module).values() if inspect.isfunction(v) and v.__module__ == module.__name__]
    for cls in (v for v in vars(module).values() if inspect.isclass(v) and v.__module__ == module.__name__):
        functions += [f for f in vars(cls).values() if inspect.isfunction(f)]
    for function in functions:
        for code in codes(function.__code__):
            if any(i.opname == "LOAD_GLOBAL" and i.argval == name for i in dis.get_instructions(code)):
                yield function.__name__
                break
