"""Tiny programs that call each shipped kernel library's operators, and the runtime's verdict.

``python _kernel_programs.py export OUT_DIR`` exports one program per library into
OUT_DIR and prints ``{library: path}`` as JSON: ``portable`` (``aten::add``),
``optimized`` (``aten::_fft_r2c``), ``quantized`` (``quantized_decomposed::quantize_per_tensor``),
``llm`` (``llama::custom_sdpa``).

``python _kernel_programs.py both OUT_DIR`` imports the runtime, exports in a forked
child (which loads the libraries) and then judges in the parent, whose runtime has none
loaded yet: ``{"programs": {library: path}, "stages": [{"loaded": module or null,
"operators": [...], "verdicts": {path: "ok" or the refusal}}, ...]}``, the runtime's
registry and its load of every program (and of ``unknown.pte``: the llm program with its
operator renamed to one no library has), first with no library loaded, then after
importing each library's module in turn (``KERNEL_MODULES``). One interpreter start.
"""

import json
import os
import sys


def export(folder: str) -> dict[str, str]:
    import executorch.extension.llm.custom_ops.custom_ops  # registers torch.ops.llama
    import executorch.kernels.quantized  # noqa: F401 - registers quantized_decomposed's out variants
    import torch
    from executorch.exir import to_edge_transform_and_lower
    from torch.ao.quantization.fx import _decomposed  # noqa: F401 - registers torch.ops.quantized_decomposed

    class Add(torch.nn.Module):
        def forward(self, x):
            return x + 1

    class Fft(torch.nn.Module):
        def forward(self, x):
            return torch.view_as_real(torch.fft.rfft(x))

    class Quantize(torch.nn.Module):
        def forward(self, x):
            return torch.ops.quantized_decomposed.quantize_per_tensor(x, 0.1, 0, -128, 127, torch.int8)

    class Sdpa(torch.nn.Module):
        def forward(self, q, k, v):
            return torch.ops.llama.custom_sdpa(q, k, v, 0, None, 0.0, True)

    cases = {"portable": (Add(), (torch.randn(4),)), "optimized": (Fft(), (torch.randn(8),)),
             "quantized": (Quantize(), (torch.randn(4),)), "llm": (Sdpa(), (torch.randn(1, 2, 2, 8),) * 3)}
    out = {}
    for name, (model, inputs) in cases.items():
        program = to_edge_transform_and_lower(torch.export.export(model, inputs)).to_executorch()
        out[name] = os.path.join(folder, f"{name}.pte")
        with open(out[name], "wb") as f:
            f.write(program.buffer)
    return out


def judge(ptes: list[str]) -> list[dict]:
    import importlib

    os.environ.setdefault("ET_LOG_LEVEL", "Fatal")
    from executorch.runtime import Runtime

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
    from ptdstream.check.runtime.registry import KERNEL_MODULES

    rt = Runtime.get()
    stages = []
    for module in [None, *[m for m in KERNEL_MODULES.values() if m]]:
        if module is not None:
            importlib.import_module(module)
        verdicts = {}
        for pte in ptes:
            try:
                program = rt.load_program(pte)
                for name in program.method_names:
                    program.load_method(name)
                verdicts[pte] = "ok"
            except Exception as e:  # noqa: BLE001 - the binding raises RuntimeError; any error is a refusal
                verdicts[pte] = f"{type(e).__name__}: {e}"[:300]
        stages.append({"loaded": module, "operators": sorted(rt.operator_registry.operator_names),
                       "verdicts": verdicts})
    return stages


def both(folder: str) -> dict:
    os.environ.setdefault("ET_LOG_LEVEL", "Fatal")
    from executorch.runtime import Runtime

    Runtime.get()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child loads the libraries into its own copy of the runtime
        code = 1
        try:
            os.close(r)
            programs = export(folder)
            with open(programs["llm"], "rb") as f:
                data = f.read()
            assert data.count(b"llama::custom_sdpa") == 1
            programs["unknown"] = os.path.join(folder, "unknown.pte")
            with open(programs["unknown"], "wb") as f:  # same length: the flatbuffer stays valid
                f.write(data.replace(b"llama::custom_sdpa", b"llama::custom_sdpz"))
            os.write(w, json.dumps(programs).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        text = f.read()
    _, status = os.waitpid(pid, 0)
    if status != 0:
        raise SystemExit(f"export failed: status {status}")
    programs = json.loads(text)
    return {"programs": programs, "stages": judge(list(programs.values()))}


if __name__ == "__main__":
    print("RESULT " + json.dumps(both(sys.argv[2]) if sys.argv[1] == "both" else export(sys.argv[2])))
