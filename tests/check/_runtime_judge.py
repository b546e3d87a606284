"""Judge files with the real ExecuTorch runtime, surviving its crashes.

Run as ``python tests/check/_runtime_judge.py MEM_HEADROOM_BYTES``. Reads JSON lines
``[pte_path, ptd_path_or_null]`` from stdin until EOF; writes one JSON line per job:
``["ok", ""]`` when ``Runtime.get().load_program(pte, data_path=ptd)`` and
``load_method`` of every method succeed, else ``["refused", message]`` or
``["crash", signal]``. The runtime is imported once; a forked child judges jobs in
order, and a child killed by a signal (a segfault or an abort on a corrupt file) is
replaced by a new fork that goes on with the next job. Each child's address space is
capped at the parent's size plus MEM_HEADROOM_BYTES, so planned buffers of absurd
sizes fail to allocate instead of exhausting the machine.
"""

import json
import os
import resource
import sys


def _vm_size() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


def _judge(rt, pte, ptd):
    try:
        program = rt.load_program(pte, data_path=ptd)
        for name in sorted(program.method_names):
            program.load_method(name)
    except Exception as e:  # noqa: BLE001 - the binding raises RuntimeError; anything else is a refusal too
        return ["refused", f"{type(e).__name__}: {e}"[:300]]
    return ["ok", ""]


def main() -> None:
    headroom = int(sys.argv[1])
    os.environ.setdefault("ET_LOG_LEVEL", "Fatal")
    from executorch.runtime import Runtime

    rt = Runtime.get()
    jobs = [json.loads(line) for line in sys.stdin if line.strip()]
    limit = _vm_size() + headroom
    out = sys.stdout
    i = 0
    while i < len(jobs):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 2)  # runtime logs
            with os.fdopen(w, "w") as pipe:
                for pte, ptd in jobs[i:]:
                    pipe.write(json.dumps(_judge(rt, pte, ptd)) + "\n")
                    pipe.flush()
            os._exit(0)
        os.close(w)
        with os.fdopen(r) as pipe:
            for line in pipe:
                out.write(line)
                i += 1
        _, status = os.waitpid(pid, 0)
        if i < len(jobs) and (os.WIFSIGNALED(status) or os.WEXITSTATUS(status)):
            sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else -os.WEXITSTATUS(status)
            out.write(json.dumps(["crash", str(sig)]) + "\n")
            i += 1
        out.flush()


if __name__ == "__main__":
    main()
