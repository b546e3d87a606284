"""executorch's CUDA backend, several methods sharing every weight: upstream's weight collector vs ptdstream.

Run on a GPU machine (one table, side by side, one run):

    python benchmarks/bench_cuda_backend.py --gib 2 16 --out /tmp/bench-cuda-backend

The scenario of issue 6: ``--layers`` x ``nn.Linear(dim, dim)`` in bf16, resident
on the GPU (``dim`` 8192 at 2 GiB; at other sizes the width grows so that the
weights total ``--gib``), exported once per batch size (``--batches``, default
1 4 16, methods ``batch1``...) and lowered with ``to_edge_transform_and_lower``
and one ``CudaPartitioner`` per method, then ``to_executorch``; every method
shares every weight. Each variant runs in its own fresh Python process, one
after the other:

* ``raw``: one ``os.write`` + ``fsync`` of the weight bytes from a reused 64 MiB
  buffer (run before and after the two exports; the mean is the yardstick);
* ``raw_direct``: the disk's limit: O_DIRECT ``pwrite`` of 64 MiB pinned blocks,
  4 in flight, + ``fsync``;
* ``upstream``: lowering as executorch 1.5.1 does it (its collector copies each
  storage to the host in 8 MiB ``.cpu()`` chunks, SHA-256s and writes it, once
  per method), then ``write_to_file`` + ``write_tensor_data_to_file`` and an
  ``fsync`` of every file written;
* ``ptdstream``: the same lowering inside :func:`ptdstream.hooks.cuda.backend.stream_cuda_weights`,
  then ``ptdstream.save`` (fsync and rename included; buffered unless ``--direct 1``)
  with a per-stage timeline (:mod:`ptdstream.timeline`), then the same manager
  saved again in the other write mode (buffered / O_DIRECT), also timed by stage.

``--no-twins --device-copy-budget-gib 0`` measures the spill path: every
storage is copied through the pinned ring into an unlinked temp file while
lowering and read back from it at the save.

``--methods 3 10`` runs each method count (batches 1..N; ``--batches`` gives the
batch sizes of one run instead); ``--weights-on cuda cpu`` runs each placement of
the weights while exporting and lowering. Per stage (the up-front copies
entering ``preprocess_multimethod``, each method's compile and its
``materialize`` (collect), ``to_executorch``, the save): seconds, GPU allocated
and peak, host RSS. Upstream is run to its failure point: a CUDA out-of-memory
error, or (weights on the host) a copy that would leave less than
``--host-headroom-gib`` of ``MemAvailable``, ends its run and is reported with
the stage, the copies made and the methods compiled. "host RSS over the model"
is the peak RSS over the RSS once the model is built (CUDA context included
before, ptdstream's one-time GPU fingerprint kernels and pinned ring included
in it). With ``--check-outputs 1`` each method's ``.so`` is run through torch's
AOTI loader (constants bound by FQN from the model) on fixed inputs, and
ptdstream's outputs are compared with upstream's, bitwise. The ``.ptd`` of each
method count is compared with ptdstream's and upstream's at the fewest.
``--max-autotune 0`` adds the ``max_autotune=OFF`` compile spec to both
variants; on executorch 1.5.1 every compile of this model then fails
(``missing fallback kernels: aoti_torch_cuda_addmm_out``: Inductor's extern
addmm, which 1.5.1's AOTI shim lacks), so the default keeps autotuning on.
``--report JSON`` prints the table of a results file (``--json``'s, or the
``.runs.partial`` written after each run) without a GPU.

``--skip-upstream`` leaves upstream's export out (3 minutes at 2 GiB with 10
methods, over 5 at 16 GiB). GPU peak (``max_memory_allocated``) is reported for
lowering and for the save apart; "CUDA context RSS" is the host memory that
``torch.cuda.init()`` takes, and for ptdstream the one-time host memory of the
GPU fingerprint's, probe's and comparison's kernels (elementwise; no cuBLAS) and of
the pinned ring is measured before lowering, apart from "RSS+". At the save, GPU
memory allocated entering it, its peak and after it, and the reserved pool
entering and at its peak. ``--trim 1 0 full`` runs ptdstream once per
``trim_host_memory`` mode (``"malloc_trim"``, ``False``, ``True``), side by side;
host RSS is also split into anonymous and file-backed memory at each stage, and
what a ``gc.collect()`` then a ``malloc_trim(0)`` hand back at the end.
``--fingerprint-steps 1 2 4 8`` times the GPU fingerprint alone per ``STEP_ROWS``.

Weight handling (``weights s``; ``/raw`` divides it by the raw write) = the time spent in the collector's
``materialize`` (once per method: upstream's copy + hash + write, or ptdstream's device copy + GPU
fingerprint; upstream's includes its own ``gc.collect`` + ``malloc_trim``) plus
the save. RSS is sampled every 5 ms and from ``VmHWM``: "RSS+ weights" is the
largest rise during one ``materialize`` call or the save, over the RSS at its
start; "peak RSS" is the process's high-water mark during lowering and save
("peak+": over the RSS just before lowering; "x weights": peak RSS / weight bytes).
Byte identity (xxh3-128): the .ptd equals upstream's; the .pte (which holds the AOTI .so
compiled in its own process) equals upstream's serializer on the same manager.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _measure import (
    RssSampler,
    discard_file,
    file_digests,
    files_under,
    fsync_files,
    raw_write_fsync,
    reset_peak_rss,
    status_kib,
    timeline_lines,
    xxh3_file,
)

GiB = 1 << 30
MiB = 1 << 20
#: ``--trim`` -> ``stream_cuda_weights(trim_host_memory=...)``.
TRIM_MODES = {"1": "malloc_trim", "0": False, "full": True}


# ---------------------------------------------------------------- child side


def child_raw(args) -> dict:
    path = os.path.join(args.out, "raw.bin")
    buf = memoryview(bytearray(64 * MiB))
    seconds = raw_write_fsync(path, args.nbytes, buf)
    discard_file(path)
    return {"seconds": seconds}


def child_raw_direct(args) -> dict:
    """The disk's limit: O_DIRECT pwrite of 64 MiB pinned blocks, 4 in flight, + fsync."""
    import concurrent.futures

    import torch

    block = 64 * MiB
    buffers = [torch.empty(block, dtype=torch.uint8, pin_memory=True) for _ in range(4)]
    for b in buffers:
        b.fill_(7)
    views = [memoryview(b.numpy()).cast("B") for b in buffers]
    path = os.path.join(args.out, "raw-direct.bin")
    t = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    aligned = args.nbytes - args.nbytes % 4096

    def put(i, offset):
        view = views[i % 4][: min(block, aligned - offset)]
        done = 0
        while done < len(view):
            done += os.pwrite(fd, view[done:], offset + done)

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        list(pool.map(put, range(len(range(0, aligned, block))), range(0, aligned, block)))
    os.fsync(fd)
    os.close(fd)
    seconds = time.perf_counter() - t
    discard_file(path)
    return {"seconds": seconds, "nbytes": aligned}


class _Stages:
    """Per-stage figures of one lowering: the up-front copies, each method's compile
    (``CudaBackend._preprocess_with_weight_collector``, its ``materialize`` apart),
    ``to_executorch``. GPU figures from ``torch.cuda`` (peak reset per stage; the
    lowering's peak is the largest), host RSS from the 5 ms sampler. Installed over
    whatever ``CudaBackend`` has (ptdstream's sharing copy included), removed first."""

    def __init__(self, args, backend, rss, weights_nbytes: int) -> None:
        import torch

        self.torch, self.args, self.backend, self.rss = torch, args, backend, rss
        self.weights_nbytes = weights_nbytes
        self.copies: list[dict] = []
        self.compiles: list[dict] = []
        self.copy_stage: dict = {}
        self.so: dict[str, bytes] = {}
        self.where = "export"
        self.gpu_peak = 0
        self._saved = {n: vars(backend)[n] for n in ("copy_exported_program_for_preprocess",
                                                     "preprocess_multimethod", "_preprocess_with_weight_collector")}
        self._t0 = time.perf_counter()
        self._rss0 = status_kib("VmRSS") * 1024

    def _gpu(self) -> dict:
        torch = self.torch
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        self.gpu_peak = max(self.gpu_peak, peak)
        return {"gpu_allocated": torch.cuda.memory_allocated(), "gpu_peak": peak}

    def install(self) -> None:
        stages, backend = self, self.backend
        copy_real = backend.copy_exported_program_for_preprocess
        multi_real = backend.preprocess_multimethod
        one_real = backend._preprocess_with_weight_collector

        def copy_for_preprocess(cls, program, specs):
            stages.where = f"copy {len(stages.copies) + 1}"
            if stages.args.weights_on == "cpu" and stages.args.variant == "upstream":
                free = status_kib("MemAvailable", "/proc/meminfo") * 1024
                if free < stages.weights_nbytes + int(stages.args.host_headroom_gib * GiB):
                    raise MemoryError(f"host memory: {stages.where} needs {stages.weights_nbytes} bytes, "
                                      f"MemAvailable {free} (headroom {stages.args.host_headroom_gib} GiB)")
            t = time.perf_counter()
            out = copy_real(program, specs)
            stages.copies.append({"seconds": time.perf_counter() - t, **stages._gpu(),
                                  "rss": status_kib("VmRSS") * 1024})
            return out

        def preprocess_multimethod(cls, programs, specs):
            stages.copy_stage = {"seconds": time.perf_counter() - stages._t0, **stages._gpu(),
                                 "rss_peak": stages.rss.peak["VmRSS"], "rss": status_kib("VmRSS") * 1024,
                                 "copies": len(stages.copies)}
            return multi_real(programs, specs)

        def preprocess_one(cls, program, specs, collector):
            torch = stages.torch
            name = backend.method_name_from_compile_specs(specs)
            stages.where = f"compile {name} (method {len(stages.compiles) + 1})"
            record = {"method": name, "gpu_start": torch.cuda.memory_allocated(),
                      "rss_start": status_kib("VmRSS") * 1024}
            stages._gpu()
            torch.cuda.reset_peak_memory_stats()
            with stages.rss.window(record):
                result = one_real(program, specs, collector)
                record.update(stages._gpu())
            record["rss_end"] = status_kib("VmRSS") * 1024
            stages.compiles.append(record)
            meta = bytes(result.processed_bytes)
            n = struct.unpack_from("<I", meta, 10)[0]  # after b"ETCUDAFQN3": the .so key
            key = meta[14:14 + n].decode()
            store = result.data_store_output
            entry = store.pte_data.get(key) or next(e[key] for e in store.external_data.values() if key in e)
            buf = store.buffers[entry.buffer_index]
            stages.so[name] = bytes(buf) if isinstance(buf, (bytes, bytearray, memoryview)) else buf.to_bytes()
            return result

        backend.copy_exported_program_for_preprocess = classmethod(copy_for_preprocess)
        backend.preprocess_multimethod = classmethod(preprocess_multimethod)
        backend._preprocess_with_weight_collector = classmethod(preprocess_one)

    def remove(self) -> None:
        for name, value in self._saved.items():
            setattr(self.backend, name, value)

    def to_dict(self) -> dict:
        return {"copies": self.copies, "copy_stage": self.copy_stage, "compiles": self.compiles}


def _rss_kinds() -> dict:
    """Host RSS (bytes) split as ``/proc/self/status`` does: ``anon`` (heap, mmaps,
    pinned memory; what ``malloc_trim`` can hand back) and ``file`` (pages of mapped
    files: libraries and the kernel images read from them)."""
    return {"anon": status_kib("RssAnon") * 1024, "file": status_kib("RssFile") * 1024}


def _is_oom(e: BaseException) -> bool:
    return isinstance(e, MemoryError) or "out of memory" in str(e).lower()


def aoti_outputs(args, so: dict[str, bytes], weights: dict, methods: dict[str, int], dim: int) -> dict:
    """Each method's compiled library run through torch's AOTI loader on fixed inputs
    (constants bound by FQN from ``weights``); outputs saved under ``args.out``."""
    import torch

    res = {}
    for name, so_bytes in so.items():
        path = os.path.join(args.out, f"{args.variant}-{name}.so")
        with open(path, "wb") as f:
            f.write(so_bytes)
        try:
            runner = torch._C._aoti.AOTIModelContainerRunnerCuda(path, 1, "cuda")
            names = runner.get_constant_names_to_original_fqns()
            # Keyed by internal name and by FQN (releases differ in which one they look up).
            bound = {k: weights[fqn] for k, fqn in names.items()}
            runner.update_constant_buffer({**{names[k]: t for k, t in bound.items()}, **bound}, False, True)
            g = torch.Generator(device="cuda").manual_seed(1234 + methods[name])
            x = torch.randn(methods[name], dim, dtype=torch.bfloat16, device="cuda", generator=g)
            out = runner.run([x])[0]
            saved = os.path.join(args.out, f"outputs-{args.weights_on}-m{len(methods)}-{args.variant}-{name}.pt")
            torch.save(out.cpu(), saved)
            res[name] = saved
        except Exception as e:  # noqa: BLE001 - reported in the table, not fatal to the run
            res[name] = f"error: {type(e).__name__}: {str(e)[:300]}"
        finally:
            os.remove(path)
    return res


def child_export(args) -> dict:
    import torch

    rss0 = status_kib("VmRSS") * 1024
    torch.cuda.init()
    torch.empty(1, device="cuda")
    torch.cuda.synchronize()
    cuda_context_rss = status_kib("VmRSS") * 1024 - rss0
    from executorch.backends.cuda import cuda_weight_collector as collector_module
    from executorch.backends.cuda.cuda_backend import CudaBackend
    from executorch.backends.cuda.cuda_partitioner import CudaPartitioner
    from executorch.exir import EdgeCompileConfig, to_edge_transform_and_lower
    from executorch.exir.backend.compile_spec_schema import CompileSpec

    import ptdstream
    from ptdstream.hooks.cuda.backend import stream_cuda_weights

    device = args.weights_on
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[
        torch.nn.Linear(args.dim, args.dim, dtype=torch.bfloat16, device=device)
        for _ in range(args.layers)
    ]).eval()
    weights_nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    methods = {f"batch{b}": b for b in args.batches}
    t = time.perf_counter()
    programs = {
        name: torch.export.export(
            model, (torch.randn(b, args.dim, dtype=torch.bfloat16, device=device),), strict=False
        )
        for name, b in methods.items()
    }
    export_s = time.perf_counter() - t
    specs = [CompileSpec("max_autotune", b"OFF")] if not args.max_autotune else []
    partitioners = {
        name: [CudaPartitioner([CudaBackend.generate_method_name_compile_spec(name), *specs])]
        for name in programs
    }
    torch.cuda.synchronize()
    res = {"weights_nbytes": weights_nbytes, "export_s": export_s, "materialize": [],
           "written_while_lowering": 0, "gpu": torch.cuda.get_device_name(),
           "cuda_context_rss": cuda_context_rss, "weights_on": device, "methods": len(methods),
           "rss_model": status_kib("VmRSS") * 1024, "gpu_model_nbytes": torch.cuda.memory_allocated(),
           "rss_kinds": {"model": _rss_kinds()}}

    rss = RssSampler()
    real_materialize = collector_module.CudaWeightCollector.materialize

    current = {}

    def materialize(self, weights, *a, **kw):
        record = {"storages": len(weights), "write_s": 0.0, "rss_start": status_kib("VmRSS") * 1024}
        current["record"] = record
        with rss.window(record):
            out = real_materialize(self, weights, *a, **kw)
            torch.cuda.synchronize()
        record["rss_end"] = status_kib("VmRSS") * 1024
        res["materialize"].append(record)
        return out

    def count_writes(write):
        def counted(tensor, path):
            t = time.perf_counter()
            out = write(tensor, path)
            torch.cuda.synchronize()
            current["record"]["write_s"] += time.perf_counter() - t
            res["written_while_lowering"] += os.path.getsize(path)
            return out
        return counted

    if args.variant == "ptdstream":
        # One-time host memory of ptdstream's CUDA path, also shown apart: loading
        # the GPU fingerprint's kernels (elementwise products and sums; no cuBLAS)
        # and the pinned ring. Both count in "host RSS over the model" (measured
        # from rss_model).
        from ptdstream.hooks.cuda.twins import probe, same_bytes
        from ptdstream.sources.cuda import PinnedRing
        from ptdstream.sources.cuda_fingerprint import ROW_NBYTES, STEP_ROWS, gpu_fingerprint

        r0 = status_kib("VmRSS") * 1024
        # At the shapes of real weights: whole steps, a tail, a storage under one row
        # (a bias), and the probe and exact comparison the routing runs on each storage.
        warm = torch.zeros(2 * STEP_ROWS * ROW_NBYTES + 2 * args.dim + 8, dtype=torch.uint8, device="cuda")
        for flat in (warm, warm[: 2 * args.dim]):
            gpu_fingerprint(flat)
            probe(flat, {})
            same_bytes(flat.clone(), flat)
        del warm, flat
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        r1 = status_kib("VmRSS") * 1024
        PinnedRing.get(torch.device("cuda", torch.cuda.current_device()), 8 * MiB, 4)
        r2 = status_kib("VmRSS") * 1024
        res["fingerprint_warmup_rss"], res["pinned_ring_rss"] = r1 - r0, r2 - r1
    torch.cuda.synchronize()
    res["rss_before_lowering"] = status_kib("VmRSS") * 1024
    res["rss_kinds"]["before lowering"] = _rss_kinds()
    reset_peak_rss()
    torch.cuda.reset_peak_memory_stats()
    collector_module.CudaWeightCollector.materialize = materialize
    budget = None if args.device_copy_budget_gib < 0 else int(args.device_copy_budget_gib * GiB)
    routed = (stream_cuda_weights(twins=not args.no_twins, device_copy_budget_nbytes=budget,
                                  share_weights=bool(args.share), trim_host_memory=TRIM_MODES[args.trim[0]])
              if args.variant == "ptdstream" else None)
    stats = routed.__enter__() if routed is not None else None
    stages = _Stages(args, CudaBackend, rss, weights_nbytes)
    stages.install()
    real_write = collector_module._write_tensor_storage
    collector_module._write_tensor_storage = count_writes(real_write)
    t = time.perf_counter()
    manager = None
    try:
        edge = to_edge_transform_and_lower(
            programs, partitioner=partitioners,
            compile_config=EdgeCompileConfig(_check_ir_validity=False),
        )
        stages.where = "to_executorch"
        emit = {"gpu_start": torch.cuda.memory_allocated()}
        torch.cuda.reset_peak_memory_stats()
        emit["rss_start"] = status_kib("VmRSS") * 1024
        with rss.window(emit):
            manager = edge.to_executorch()
        emit.update(stages._gpu())
        emit["rss_end"] = status_kib("VmRSS") * 1024
        res["emit"] = emit
    except Exception as e:  # a run to its failure point: OOM (device or host) ends it here
        if not _is_oom(e):
            raise
        res["failed"] = {"stage": stages.where, "error": f"{type(e).__name__}: {str(e)[:400]}",
                         "copies_made": len(stages.copies), "methods_compiled": len(stages.compiles)}
    finally:
        stages.remove()
        collector_module._write_tensor_storage = real_write
        if routed is not None:
            routed.__exit__(None, None, None)
        collector_module.CudaWeightCollector.materialize = real_materialize
    res["lower_s"] = time.perf_counter() - t
    res["rss_kinds"]["after lowering"] = _rss_kinds()
    res["stages"] = stages.to_dict()
    if stats is not None:
        res["routed"], res["routed_nbytes"], res["copied_nbytes"], res["twin_nbytes"] = (
            stats.routed, stats.routed_nbytes, stats.copied_nbytes, stats.twin_nbytes)
        res["spilled_nbytes"], res["shared_nbytes"] = stats.spilled_nbytes, stats.shared_nbytes
        res["hosted_nbytes"] = stats.hosted_nbytes
    res["gpu_peak_lowering_nbytes"] = max(stages.gpu_peak, torch.cuda.max_memory_allocated())
    res["rss_peak_lowering"] = max(rss.peak["VmRSS"], status_kib("VmHWM") * 1024)
    if manager is None:
        rss.stop()
        res["peak_rss"] = res["rss_peak_lowering"]
        return res
    del edge, programs
    torch.cuda.synchronize()
    res["gpu_before_save_nbytes"] = torch.cuda.memory_allocated()
    res["gpu_reserved_before_save_nbytes"] = torch.cuda.memory_reserved()
    torch.cuda.reset_peak_memory_stats()
    out = os.path.join(args.out, args.variant)
    os.makedirs(out, exist_ok=True)
    save = {}
    save_start = time.perf_counter()
    save["rss_start"] = status_kib("VmRSS") * 1024
    with rss.window(save):
        if args.variant == "ptdstream":
            from ptdstream.timeline import record_stages

            with record_stages() as timeline:
                report = ptdstream.save(manager, os.path.join(out, "model.pte"), direct=args.direct)
            res["save_plan_s"] = report.plan_seconds
            res["timeline"] = timeline.to_dict()
        else:
            with open(os.path.join(out, "model.pte"), "wb") as f:
                manager.write_to_file(f)
            manager.write_tensor_data_to_file(out)
            res["save_as_is_s"] = time.perf_counter() - save_start
            fsync_files(out)
    save["rss_end"] = status_kib("VmRSS") * 1024
    res["save"] = save
    res["rss_kinds"]["after the save"] = _rss_kinds()
    res["saved_nbytes"] = sum(os.path.getsize(p) for p in files_under(out))
    res["peak_rss"] = max(rss.peak["VmRSS"], status_kib("VmHWM") * 1024)
    res["gpu_peak_save_nbytes"] = torch.cuda.max_memory_allocated()
    res["gpu_reserved_peak_save_nbytes"] = torch.cuda.max_memory_reserved()
    res["gpu_after_save_nbytes"] = torch.cuda.memory_allocated()
    res["gpu_peak_nbytes"] = max(res["gpu_peak_lowering_nbytes"], res["gpu_peak_save_nbytes"])
    res["files"] = file_digests(out)
    if args.variant == "ptdstream":
        # The .pte holds each process's own AOTI .so, so it is compared with
        # upstream's serializer on this same manager (the .ptd across processes).
        reference = os.path.join(args.out, "reference.pte")
        with open(reference, "wb") as f:
            manager.write_to_file(f)
        res["reference_pte"] = (os.path.getsize(reference), xxh3_file(reference))
        discard_file(reference)
    for p in files_under(out):
        discard_file(p)
    if args.check_outputs:
        res["outputs"] = aoti_outputs(args, stages.so, {k: v.to("cuda") for k, v in model.state_dict().items()},
                                      methods, args.dim)
    if args.variant == "ptdstream" and args.second_save:
        # The same manager saved again with the other write mode (buffered / O_DIRECT).
        other = os.path.join(args.out, "ptdstream-other")
        os.makedirs(other, exist_ok=True)
        again = {}
        with rss.window(again):
            with record_stages() as timeline:
                ptdstream.save(manager, os.path.join(other, "model.pte"), direct=not args.direct)
        again["timeline"] = timeline.to_dict()
        again["direct"] = not args.direct
        again["files"] = {os.path.basename(p): (os.path.getsize(p), xxh3_file(p)) for p in files_under(other)}
        res["save_other_mode"] = again
        for p in files_under(other):
            discard_file(p)
    # What the process still held that a collection and a heap trim hand back (after every figure above).
    import ctypes
    import gc

    gc.collect()
    res["rss_kinds"]["after gc.collect"] = _rss_kinds()
    ctypes.CDLL(None).malloc_trim(0)
    res["rss_kinds"]["after malloc_trim"] = _rss_kinds()
    rss.stop()
    return res


def fingerprint_steps(steps: list[int], gib: float = 1.0) -> list[str]:
    """The GPU fingerprint alone, once per ``STEP_ROWS`` in ``steps`` (in this process):
    seconds and GB/s over ``gib`` GiB, device memory added at its peak and held after, and
    the host RSS its first call adds (its kernels loaded)."""
    import torch

    from ptdstream.sources import cuda_fingerprint as cf

    torch.empty(1, device="cuda")
    x = torch.randint(0, 256, (int(gib * GiB),), dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    r0 = status_kib("VmRSS") * 1024
    cf.gpu_fingerprint(x[: 3 * cf.ROW_NBYTES + 5])
    torch.cuda.synchronize()
    lines = [f"first call (kernels loaded): host RSS +{(status_kib('VmRSS') * 1024 - r0) / MiB:.1f} MiB"]
    default = cf.STEP_ROWS
    for step in steps:
        cf.STEP_ROWS = step
        cf.gpu_fingerprint(x[: 4 * step * cf.ROW_NBYTES])
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        t = time.perf_counter()
        cf.gpu_fingerprint(x)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t
        lines.append(f"STEP_ROWS {step}: {x.numel() / GiB:g} GiB in {dt * 1e3:.1f} ms ({x.numel() / dt / 1e9:.1f} "
                     f"GB/s), {-(-x.numel() // (step * cf.ROW_NBYTES))} steps, device memory added at the peak "
                     f"{(torch.cuda.max_memory_allocated() - base) / MiB:.2f} MiB, held after "
                     f"{(torch.cuda.memory_allocated() - base) / MiB:.2f} MiB")
    cf.STEP_ROWS = default
    return lines


# ---------------------------------------------------------------- parent side


def run_child(args, variant: str, weights_on: str = "cuda", batches=None, trim: str = "1", **extra) -> dict:
    batches = batches or args.batches
    result = os.path.join(args.out, f"{variant}.json")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", variant, "--out", args.out,
           "--result", result, "--layers", str(extra["layers"]), "--dim", str(extra["dim"]),
           "--nbytes", str(extra["nbytes"]), "--batches", *map(str, batches)]
    cmd += ["--direct", str(int(args.direct)), "--device-copy-budget-gib", str(args.device_copy_budget_gib)]
    cmd += ["--no-twins"] if args.no_twins else []
    cmd += ["--weights-on", weights_on, "--share", str(args.share), "--max-autotune", str(args.max_autotune),
            "--host-headroom-gib", str(args.host_headroom_gib),
            "--check-outputs", str(int(bool(args.check_outputs) and (args.check_outputs_upto is None
                                                                   or len(batches) <= args.check_outputs_upto))),
            "--second-save", str(args.second_save), "--trim", trim]
    named = f"{variant} --trim {trim}" if variant == "ptdstream" else variant
    print(f"[{time.strftime('%H:%M:%S')}] {named} ({extra['nbytes'] / GiB:.2f} GiB, weights on {weights_on}, "
          f"{len(batches)} methods)", file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True)
    os.sync()
    with open(result) as f:
        res = json.load(f)
    if args.json:
        # Each child's figures as soon as they exist: a run cut short keeps them.
        tag = f"-trim{trim}" if variant == "ptdstream" else ""
        with open(f"{args.json}.{variant}{tag}-{weights_on}-m{len(batches)}.partial", "w") as f:
            json.dump(res, f)
    return res


def width_for(gib: float, layers: int) -> int:
    """Square bf16 width (multiple of 64) whose ``layers`` weights total ``gib`` GiB."""
    return max(64, round((gib * GiB / layers / 2) ** 0.5 / 64) * 64)


def measure(args, gib: float, done: list[dict] | None = None) -> list[dict]:
    """One result per (weights placement, method count) at ``gib``; the raw writes once.
    With ``--json``, ``done`` (the results of earlier sizes) and those so far are written
    to ``<json>.runs.partial`` after each run (``--report`` renders them)."""
    dim = width_for(gib, args.layers)
    nbytes = args.layers * (dim * dim + dim) * 2
    shape = {"layers": args.layers, "dim": dim, "nbytes": nbytes}
    raw = [run_child(args, "raw", **shape)["seconds"]] if not args.skip_raw else [float("nan")]
    raw_direct = (run_child(args, "raw_direct", **shape) if not args.skip_raw
                  else {"seconds": float("nan"), "nbytes": nbytes})
    results = []
    counts = args.methods or [len(args.batches)]
    for weights_on in args.weights_on:
        for count in counts:
            batches = list(range(1, count + 1)) if args.methods else args.batches
            run = {"weights_on": weights_on, "batches": batches}
            got, trims = {}, {}
            for v in args.variants:  # in their order; ptdstream once per --trim mode, side by side
                if v == "ptdstream":
                    trims = {m: run_child(args, v, weights_on, batches, trim=m, **shape) for m in args.trim}
                    got[v] = trims[args.trim[0]]
                else:
                    got[v] = run_child(args, v, weights_on, batches, **shape)
            up, ours = got.get("upstream"), got.get("ptdstream")
            results.append({"gib": gib, "dim": dim, "nbytes": nbytes, "raw_s": raw, "raw_direct": raw_direct,
                            "upstream": up, "ptdstream": ours, **run,
                            "trims": trims if len(trims) > 1 else {}})
            results[-1]["outputs_compare"] = compare_outputs(results[-1])
            if args.json:
                with open(f"{args.json}.runs.partial", "w") as f:
                    json.dump([*(done or []), *results], f, indent=2)
    if not args.skip_raw:
        raw.append(run_child(args, "raw", **shape)["seconds"])
    return results


def weight_handling_s(r: dict) -> float:
    return sum(m["seconds"] for m in r["materialize"]) + r["save"]["seconds"]


def _rss_added(r: dict) -> int:
    return max([m["rss_added"] for m in r["materialize"]] + [r["save"]["rss_added"]])


def compare_outputs(run: dict) -> dict:
    """Per method: ptdstream's AOTI outputs against upstream's (same inputs), bitwise and max |diff|."""
    import torch

    up, ours = run["upstream"], run["ptdstream"]
    if not up or not ours or "outputs" not in up or "outputs" not in ours:
        return {}
    found = {}
    for name, theirs in up["outputs"].items():
        mine = ours["outputs"].get(name, "missing")
        if theirs.startswith("error") or mine.startswith(("error", "missing")):
            found[name] = {"error": theirs if theirs.startswith("error") else mine}
            continue
        a, b = torch.load(mine), torch.load(theirs)
        found[name] = {"equal": bool(torch.equal(a, b)),
                       "max_abs_diff": float((a.float() - b.float()).abs().max()) if a.shape == b.shape else None}
    return found


def _gib(n: float) -> str:
    return f"{n / GiB:.2f}"


def _workspace(r: dict) -> int:
    return max((c["gpu_peak"] - c["gpu_start"] for c in r["stages"]["compiles"]), default=0)


def _grown(rec: dict | None) -> int:
    """Current host RSS at a stage's end minus at its start (bytes; 0 when not recorded)."""
    return rec["rss_end"] - rec["rss_start"] if rec and "rss_end" in rec else 0


def rss_breakdown(r: dict) -> dict:
    """Host RSS over the model (bytes), by where it grew and stayed: ``one_time`` (before
    lowering: ptdstream's fingerprint kernels and pinned ring), ``copies`` (the up-front
    per-method copies), ``compile`` (every method's compile, its collect excluded: Inductor,
    triton, autotuning, AOTI; ``compile_first`` the first method's), ``collect`` (the
    collector's ``materialize``), ``emit`` (``to_executorch``), ``save``; ``transient`` what
    the peak stood above all of those; ``own``: what ptdstream's routing itself adds
    (one-time, collects, save; upstream's collect and save for upstream)."""
    base, before = r["rss_model"], r.get("rss_before_lowering", r["rss_model"])
    st = r["stages"]
    cs = st.get("copy_stage") or {}
    copies = (cs["rss"] if "rss" in cs else st["copies"][-1]["rss"] if st["copies"] else before) - before
    collects = [_grown(m) for m in r["materialize"]]
    compiles = [_grown(c) for c in st["compiles"]]
    compile_ = sum(compiles) - sum(collects[:len(compiles)])
    first = compiles[0] - collects[0] if compiles and collects else 0
    out = {"one_time": before - base, "copies": copies, "compile": compile_, "compile_first": first,
           "collect": sum(collects), "emit": _grown(r.get("emit")), "save": _grown(r.get("save"))}
    kept = sum(v for k, v in out.items() if k != "compile_first")
    out["transient"] = r["peak_rss"] - base - kept
    out["own"] = out["one_time"] + out["collect"] + max(out["save"], 0)
    return out


def rss_line(r: dict) -> str:
    b = rss_breakdown(r)
    return ("    host RSS over the model by stage (grown and kept, MiB): one-time before lowering "
            f"{b['one_time'] / MiB:.0f}, copies {b['copies'] / MiB:.0f}, compiles without their collect "
            f"{b['compile'] / MiB:.0f} (first {b['compile_first'] / MiB:.0f}), collects {b['collect'] / MiB:.0f}, "
            f"to_executorch {b['emit'] / MiB:.0f}, save {b['save'] / MiB:.0f}, peak above those "
            f"{b['transient'] / MiB:.0f}; the writer's own (one-time + collects + save) {b['own'] / MiB:.0f}")


def stage_lines(r: dict) -> list[str]:
    st, base = r["stages"], r["rss_model"]
    cs = st.get("copy_stage") or {}
    copies = st["copies"]
    lines = [f"    copy: {len(copies)} copies in {sum(c['seconds'] for c in copies):.2f} s; entering "
             f"preprocess_multimethod: GPU allocated {_gib(cs.get('gpu_allocated', 0))} GiB, GPU peak "
             f"{_gib(cs.get('gpu_peak', 0))} GiB, host RSS over the model "
             f"{_gib(cs.get('rss_peak', base) - base)} GiB" if cs else
             f"    copy: {len(copies)} copies made; GPU allocated after each: "
             + ", ".join(_gib(c["gpu_allocated"]) for c in copies) + " GiB; host RSS after the last: "
             + (_gib(copies[-1]["rss"] - base) if copies else "0") + " GiB over the model"]
    collected = r["materialize"] + [None] * (len(st["compiles"]) - len(r["materialize"]))
    for c, m in zip(st["compiles"], collected, strict=False):
        lines.append(f"    compile {c['method']}: {c['seconds']:.1f} s, GPU {_gib(c['gpu_start'])} -> peak "
                     f"{_gib(c['gpu_peak'])} -> {_gib(c['gpu_allocated'])} GiB, RSS+ {c['rss_added'] / MiB:.0f} MiB"
                     + (f"; collect (materialize) {m['seconds']:.3f} s, RSS+ {m['rss_added'] / MiB:.0f} MiB"
                        if m else ""))
    if "emit" in r:
        e = r["emit"]
        lines.append(f"    to_executorch: {e['seconds']:.1f} s, GPU peak {_gib(e['gpu_peak'])} GiB, "
                     f"RSS+ {e['rss_added'] / MiB:.0f} MiB")
    if "save" in r:
        lines.append(f"    save: {r['save']['seconds']:.2f} s, GPU peak {_gib(r['gpu_peak_save_nbytes'])} GiB, "
                     f"RSS+ {r['save']['rss_added'] / MiB:.0f} MiB")
        lines.append("    " + gpu_save_line(r))
    if "peak_rss" in r:
        lines.append(rss_line(r))
    if r.get("rss_kinds"):
        lines.append("    host RSS anon / file-backed (MiB): " + "; ".join(
            f"{where} {k['anon'] / MiB:,.0f} / {k['file'] / MiB:,.0f}" for where, k in r["rss_kinds"].items()))
    return lines


def gpu_save_line(r: dict) -> str:
    """GPU memory entering and during the save: allocated, its peak, reserved (MiB)."""
    before, peak = r["gpu_before_save_nbytes"], r["gpu_peak_save_nbytes"]
    reserved = r.get("gpu_reserved_before_save_nbytes")
    return (f"GPU at the save (MiB): allocated entering {before / MiB:,.1f}, peak {peak / MiB:,.1f} (added "
            f"{(peak - before) / MiB:,.1f}), after {r.get('gpu_after_save_nbytes', 0) / MiB:,.1f}; reserved "
            f"entering {(reserved or 0) / MiB:,.1f}, peak {r.get('gpu_reserved_peak_save_nbytes', 0) / MiB:,.1f}")


def trim_lines(res: dict) -> list[str]:
    """ptdstream once per ``--trim`` mode, side by side: host RSS, lowering and collect time."""
    lines = []
    for mode, r in res.get("trims", {}).items():
        if "failed" in r:
            lines.append(f"  ptdstream --trim {mode}: FAILED at {r['failed']['stage']}")
            continue
        b = rss_breakdown(r)
        collects = sum(m["seconds"] for m in r["materialize"])
        lines.append(f"  ptdstream --trim {mode} ({TRIM_MODES[mode]!r}): host RSS over the model "
                     f"{(r['peak_rss'] - r['rss_model']) / MiB:,.0f} MiB (one-time {b['one_time'] / MiB:.0f}, "
                     f"compiles {b['compile'] / MiB:.0f}, collects {b['collect'] / MiB:.0f}, save "
                     f"{b['save'] / MiB:.0f}); lower {r['lower_s']:.1f} s, collects {collects:.3f} s; "
                     + gpu_save_line(r))
    return lines


def variant_line(name: str, r: dict | None, raw_s: float) -> list[str]:
    if r is None:
        return [f"  {name:<10} (not run)"]
    w = r["weights_nbytes"]
    over = r["peak_rss"] - r["rss_model"]
    head = (f"  {name:<10} host RSS over the model {over / MiB:,.0f} MiB (peak {_gib(r['peak_rss'])} GiB); "
            f"GPU peak lowering {_gib(r['gpu_peak_lowering_nbytes'])} GiB ({r['gpu_peak_lowering_nbytes'] / w:.2f}x "
            f"the weights; largest compile workspace {_gib(_workspace(r))} GiB); lower {r['lower_s']:.1f} s")
    if "failed" in r:
        f = r["failed"]
        return [head, f"  {'':<10} FAILED at {f['stage']}: {f['error']} ({f['copies_made']} copies made, "
                      f"{f['methods_compiled']} methods compiled)"] + stage_lines(r)
    handling = weight_handling_s(r)
    save_gbps = r["saved_nbytes"] / r["save"]["seconds"] / 1e9
    extra = (f"; one-time before lowering (counted above): fingerprint, probe and comparison kernels "
             f"{r['fingerprint_warmup_rss'] / MiB:.0f} MiB, pinned ring {r['pinned_ring_rss'] / MiB:.0f} MiB"
             if "pinned_ring_rss" in r else "")
    return [head, f"  {'':<10} weights s {handling:.2f} ({handling / raw_s:.2f}x raw); "
                  f"save {r['save']['seconds']:.2f} s "
                  f"{save_gbps:.2f} GB/s; GPU peak save {_gib(r['gpu_peak_save_nbytes'])} GiB; written while "
                  f"lowering {_gib(r['written_while_lowering'])} GiB; RSS+ {_rss_added(r) / MiB:.1f} MiB; CUDA "
                  f"context RSS {r['cuda_context_rss'] / MiB:.0f} MiB{extra}"] + stage_lines(r)


def _ptd(r: dict | None) -> dict:
    return {n: tuple(v) for n, v in (r or {}).get("files", {}).items() if n.endswith(".ptd")}


def upstream_ptd(res: dict, results: list[dict]) -> tuple[dict, str]:
    """Upstream's ``.ptd`` files for ``res`` and where from: its own run, else (upstream
    failed or was not run) upstream's at the fewest methods of the same size and placement
    (the same weights), else ``{}``."""
    if _ptd(res["upstream"]):
        return _ptd(res["upstream"]), ""
    same = [r for r in results if r["gib"] == res["gib"] and r["weights_on"] == res["weights_on"]
            and _ptd(r["upstream"])]
    if not same:
        return {}, ""
    ref = min(same, key=lambda r: len(r["batches"]))
    return _ptd(ref["upstream"]), f" (upstream's at {len(ref['batches'])} methods)"


def table(results: list[dict], layers: int) -> str:
    lines = []
    for res in results:
        raw_s = sum(res["raw_s"]) / len(res["raw_s"])
        w = res["nbytes"]
        up, ours = res["upstream"], res["ptdstream"]
        rd = res["raw_direct"]
        raw_gbps = w / raw_s / 1e9
        rd_gbps = rd["nbytes"] / rd["seconds"] / 1e9
        any_run = ours or up or {}
        lines.append(f"{res['gib']:g} GiB of weights on {res['weights_on']}: {layers} x Linear({res['dim']}, "
                     f"{res['dim']}) bf16, {len(res['batches'])} methods, GPU {any_run.get('gpu', '?')}; raw write "
                     f"+ fsync of {w / GiB:.2f} GiB: {' / '.join(f'{s:.2f}' for s in res['raw_s'])} s "
                     f"(mean {raw_s:.2f} s, {raw_gbps:.2f} GB/s); raw O_DIRECT: {rd['seconds']:.2f} s, "
                     f"{rd_gbps:.2f} GB/s")
        lines += variant_line("upstream", up, raw_s) + variant_line("ptdstream", ours, raw_s) + trim_lines(res)
        if not ours or "failed" in ours:
            lines.append("  FAIL ptdstream completes" if ours else "")
            continue
        other = ours.get("save_other_mode")
        if other:
            o_s = other["timeline"]["wall_seconds"]
            lines.append(f"  ptdstream save again, {'O_DIRECT' if other['direct'] else 'buffered'}: {o_s:.2f} s, "
                         f"{ours['saved_nbytes'] / o_s / 1e9:.2f} GB/s; RSS+ {other['rss_added'] / MiB:.1f} MiB")
        first = ours["materialize"][0]["seconds"] + ours["save"]["seconds"]
        later = [m["seconds"] for m in ours["materialize"][1:]]
        lines.append("  ptdstream: methods 2..: " + ", ".join(f"{100 * s / first:.3f}%" for s in later)
                     + f" of the first; shared with the program {_gib(ours.get('shared_nbytes', 0))} GiB, served "
                     f"from host weights {_gib(ours.get('hosted_nbytes', 0))} GiB, twins "
                     f"{_gib(ours.get('twin_nbytes', 0))} GiB, device copies {_gib(ours.get('copied_nbytes', 0))} GiB, "
                     f"spilled {_gib(ours.get('spilled_nbytes', 0))} GiB, of {_gib(ours.get('routed_nbytes', 0))} "
                     f"GiB routed")
        lines.append("  per-stage timeline of the first save:")
        lines += timeline_lines(ours["timeline"])
        same_pte = tuple(ours["files"]["model.pte"]) == tuple(ours["reference_pte"])
        same_other = other is None or other["files"] == ours["files"]
        up_ptd, up_from = upstream_ptd(res, results)
        same_ptd = None if not up_ptd else bool(_ptd(ours)) and _ptd(ours) == up_ptd
        outputs = res.get("outputs_compare", {})
        out_ok = all(o.get("equal") for o in outputs.values()) if outputs else None
        lines.append("  files: " + ", ".join(f"{n} {s:,} B" for n, (s, _) in sorted(ours["files"].items()))
                     + f"; .ptd == upstream's export{up_from}: "
                     f"{'n/a' if same_ptd is None else 'yes' if same_ptd else 'NO'}; "
                     f".pte == upstream's serializer on the same manager: {'yes' if same_pte else 'NO'}; second "
                     f"save identical: {'yes' if same_other else 'NO'}; AOTI outputs == upstream's: "
                     + ("n/a" if out_ok is None else "yes" if out_ok else
                        "NO " + json.dumps(outputs)))
        ring = 4 * 8 * MiB
        rss_over = ours["peak_rss"] - ours["rss_model"]
        own = rss_breakdown(ours)["own"]
        targets = [
            ("ptdstream completes", True),
            ("host RSS over the model <= ring + 64 MiB (one-time kernel load and AOTI compile included)",
             rss_over <= ring + 64 * MiB),
            ("ptdstream's own host RSS (one-time kernels and ring, collects, save) <= ring + 64 MiB",
             own <= ring + 64 * MiB),
            ("GPU peak lowering <= 1.25x weights + largest compile workspace",
             ours["gpu_peak_lowering_nbytes"] <= 1.25 * w + _workspace(ours)),
            ("byte-identical", same_pte and same_other and same_ptd is not False),
            ("AOTI outputs equal upstream's", out_ok),
        ]
        if raw_s == raw_s:  # raw measured
            save_gbps = ours["saved_nbytes"] / ours["save"]["seconds"] / 1e9
            targets += [("weight handling <= 1.1x one raw write", weight_handling_s(ours) <= 1.1 * raw_s),
                        ("methods 2.. < 1% of the first", all(s < 0.01 * first for s in later)),
                        ("save >= 0.95x raw write+fsync (first save)", save_gbps >= 0.95 * raw_gbps)]
        if up is not None and "failed" not in up:
            targets.append(("GPU peak of the save <= upstream's + 8 MiB",
                            ours["gpu_peak_save_nbytes"] <= up["gpu_peak_save_nbytes"] + 8 * MiB))
            targets.append(("GPU allocated entering the save <= upstream's + 8 MiB",
                            ours["gpu_before_save_nbytes"] <= up["gpu_before_save_nbytes"] + 8 * MiB))
            targets.append(("host RSS over the model <= upstream's + ring + 64 MiB",
                            rss_over <= up["peak_rss"] - up["rss_model"] + ring + 64 * MiB))
        if ours.get("spilled_nbytes"):
            targets = [(what + " (not a target with storages spilled)", None)
                       if what.startswith(("weight handling", "save >=")) else (what, ok) for what, ok in targets]
        lines += [f"  {'PASS' if ok else 'FAIL' if ok is not None else 'n/a '} {what}" for what, ok in targets]
        lines.append("")
    lines += cross_lines(results)
    return "\n".join(lines)


def cross_lines(results: list[dict]) -> list[str]:
    """Each method count's .ptd against ptdstream's and upstream's at the fewest methods (same size, placement)."""
    lines = []
    for res in results:
        ref = min((r for r in results if r["gib"] == res["gib"] and r["weights_on"] == res["weights_on"]),
                  key=lambda r: len(r["batches"]))
        if ref is res or not _ptd(res["ptdstream"]):
            continue
        ours_ref, up_ref = _ptd(ref["ptdstream"]), _ptd(ref["upstream"])
        mine = _ptd(res["ptdstream"])
        lines.append(f"{res['gib']:g} GiB on {res['weights_on']}: ptdstream's .ptd at {len(res['batches'])} methods "
                     f"== ptdstream's at {len(ref['batches'])}: {'yes' if mine == ours_ref else 'NO'}; "
                     f"== upstream's at {len(ref['batches'])}: "
                     f"{'n/a' if not up_ref else 'yes' if mine == up_ref else 'NO'}")
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, nargs="+", default=[2, 16], help="weight sizes to run (GiB)")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16], help="one method per batch size")
    p.add_argument("--out", default="./bench-cuda-backend-out", help="scratch folder (removed at the end)")
    p.add_argument("--json", metavar="PATH", help="also write every figure as JSON")
    p.add_argument("--skip-upstream", action="store_true",
                   help="leave upstream's export out (its lowering is slow at 16 GiB)")
    p.add_argument("--direct", type=int, choices=[0, 1], default=0,
                   help="ptdstream's first save: 0 buffered (ptdstream's default), 1 O_DIRECT; the "
                        "manager is then saved again in the other mode")
    p.add_argument("--no-twins", action="store_true",
                   help="ptdstream does not look for parameters holding a storage's bytes: every storage "
                        "is copied on the device or, beyond the budget, spilled to disk")
    p.add_argument("--device-copy-budget-gib", type=float, default=1.0,
                   help="stream_cuda_weights' device copy budget (GiB; -1: none). With --no-twins and 0, "
                        "every storage goes through the spill file")
    p.add_argument("--methods", type=int, nargs="+",
                   help="method counts to run, each with batches 1..N (overrides --batches), e.g. 3 10")
    p.add_argument("--weights-on", nargs="+", choices=["cuda", "cpu"], default=["cuda"],
                   help="where the model's weights are while exporting and lowering (each placement is run)")
    p.add_argument("--variants", nargs="+", choices=["upstream", "ptdstream"], default=["upstream", "ptdstream"],
                   help="exports to run, in this order, per size, placement and method count")
    p.add_argument("--skip-raw", action="store_true", help="leave the raw writes out (no disk-speed targets)")
    p.add_argument("--share", type=int, choices=[0, 1], default=1,
                   help="stream_cuda_weights(share_weights=...): one copy of the weights through lowering")
    p.add_argument("--max-autotune", type=int, choices=[0, 1], default=1,
                   help="0: the max_autotune=OFF compile spec for both variants. FAILS on executorch 1.5.1 "
                        "for nn.Linear with bias (this model): Inductor then lowers addmm to its extern "
                        "kernel, which 1.5.1's AOTI shim lacks ('missing fallback kernels: "
                        "aoti_torch_cuda_addmm_out'); kept for models without it and later releases")
    p.add_argument("--host-headroom-gib", type=float, default=8.0,
                   help="upstream with weights on the host stops (reported as its failure point) before a "
                        "copy that would leave less than this much MemAvailable")
    p.add_argument("--check-outputs", type=int, choices=[0, 1], default=1,
                   help="run each method's .so through torch's AOTI loader and compare with upstream's")
    p.add_argument("--check-outputs-upto", type=int, metavar="N",
                   help="run the AOTI output check only at method counts up to N (default: every count)")
    p.add_argument("--second-save", type=int, choices=[0, 1], default=1,
                   help="ptdstream saves the manager again in the other write mode")
    p.add_argument("--trim", nargs="+", choices=list(TRIM_MODES), default=["1"],
                   help="stream_cuda_weights(trim_host_memory=...), one ptdstream run per mode, side by side "
                        "(the first in the main table): 1 'malloc_trim' after each collect (the default), "
                        "0 none, full upstream's gc.collect + malloc_trim")
    p.add_argument("--fingerprint-steps", type=int, nargs="+", metavar="ROWS",
                   help="only time the GPU fingerprint over 1 GiB with each STEP_ROWS given (speed, device "
                        "scratch, host RSS of its kernels), then exit")
    p.add_argument("--child", choices=["raw", "raw_direct", "upstream", "ptdstream"], help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--dim", type=int, help=argparse.SUPPRESS)
    p.add_argument("--nbytes", type=int, help=argparse.SUPPRESS)
    p.add_argument("--report", metavar="JSON",
                   help="print the table of a results file (--json's, or its .runs.partial) and exit; no GPU")
    args = p.parse_args()
    if args.report:
        with open(args.report) as f:
            done = json.load(f)
        print(table(done, args.layers))
        return 1 if table(done, args.layers).count("\n  FAIL ") else 0
    if args.fingerprint_steps:
        print("\n".join(fingerprint_steps(args.fingerprint_steps)))
        return 0
    if args.skip_upstream and "upstream" in args.variants:
        args.variants.remove("upstream")
    if args.child:
        args.weights_on = args.weights_on[0]
        args.variant = args.child
        args.direct = bool(args.direct)
        children = {"raw": child_raw, "raw_direct": child_raw_direct}
        res = children.get(args.child, child_export)(args)
        with open(args.result, "w") as f:
            json.dump(res, f)
        return 0
    os.makedirs(args.out, exist_ok=True)
    results = []
    try:
        for gib in args.gib:
            runs = measure(args, gib, results)
            results += runs
            print(table(runs, args.layers), flush=True)
            if args.json:
                with open(f"{args.json}.partial", "w") as f:
                    json.dump(results, f, indent=2)
    finally:
        shutil.rmtree(args.out, ignore_errors=True)
    if len(results) > 1:
        print(table(results, args.layers))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    fails = table(results, args.layers).count("\n  FAIL ")
    return 1 if fails else 0


if __name__ == "__main__":
    raise SystemExit(main())
