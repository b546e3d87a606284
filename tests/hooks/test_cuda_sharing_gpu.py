"""One copy of the weights through the real CUDA backend's lowering, and the GPU
fingerprint's bounded scratch (needs a GPU)."""

from __future__ import annotations

import contextlib

import pytest
import torch

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

_DIM = 1024
_LAYERS = 4
_METHODS = (("b1", 1), ("b2", 2), ("b4", 4))


def _model(device="cuda"):
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(_DIM, _DIM, dtype=torch.bfloat16) for _ in range(_LAYERS)]
                               ).to(device).eval()


def _lower(model, share: bool | None, methods=_METHODS):
    """Lowered inside stream_cuda_weights(share_weights=share) (``None``: upstream's own
    path): the manager, the stats, and the GPU memory (bytes) added when entering
    ``preprocess_multimethod`` (the copies) and at the lowering's peak."""
    from executorch.backends.cuda.cuda_backend import CudaBackend
    from executorch.backends.cuda.cuda_partitioner import CudaPartitioner
    from executorch.exir import EdgeCompileConfig, to_edge_transform_and_lower

    from ptdstream.hooks.cuda.backend import stream_cuda_weights

    device = next(model.parameters()).device
    programs = {name: torch.export.export(model, (torch.randn(b, _DIM, dtype=torch.bfloat16, device=device),))
                for name, b in methods}
    # Default compile specs: max_autotune=OFF lowers addmm to an extern kernel 1.5.1's AOTI shim lacks.
    partitioners = {name: [CudaPartitioner([CudaBackend.generate_method_name_compile_spec(name)])]
                    for name in programs}
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    real = vars(CudaBackend)["preprocess_multimethod"]
    entry = []

    def preprocess_multimethod(cls, *args):  # every copy is made by now: what they added
        torch.cuda.synchronize()
        entry.append(torch.cuda.memory_allocated() - base)
        return real.__func__(cls, *args)

    with stream_cuda_weights(share_weights=share) if share is not None else contextlib.nullcontext() as stats:
        CudaBackend.preprocess_multimethod = classmethod(preprocess_multimethod)
        try:
            edge = to_edge_transform_and_lower(programs, partitioner=partitioners,
                                               compile_config=EdgeCompileConfig(_check_ir_validity=False))
        finally:
            CudaBackend.preprocess_multimethod = real
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        manager = edge.to_executorch()
    return manager, stats, (entry[0], peak)


def test_methods_share_one_copy_of_the_weights_and_keep_upstreams_bytes(tmp_path):
    from conftest import read_folder, reference_files

    import ptdstream

    model = _model()
    weights_nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    snapshot = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    upstream_manager, _, (upstream_entry, upstream_peak) = _lower(model, share=False)
    upstream = reference_files(upstream_manager, str(tmp_path / "upstream"))
    del upstream_manager
    manager, stats, (entry, peak) = _lower(model, share=True)
    # Upstream's copies: one more copy of the weights per method, made before the first
    # method compiles; shared, they add none of it (both copy the small example inputs).
    assert upstream_entry - entry == len(_METHODS) * weights_nbytes and entry < (1 << 20), (upstream_entry, entry)
    assert peak <= upstream_peak, (peak, upstream_peak)
    assert stats.copied_nbytes == stats.spilled_nbytes == 0
    assert stats.shared_nbytes + stats.twin_nbytes == weights_nbytes
    assert stats.routed_nbytes == len(_METHODS) * weights_nbytes  # every method routes every weight
    for k, v in model.state_dict().items():  # intact after the last method: never released
        assert v.untyped_storage().nbytes() == snapshot[k].numel() * 2 and torch.equal(v.cpu(), snapshot[k]), k
    specs = {s.key for m in manager.exported_program("b1").graph_module.modules()
             for s in getattr(m, "compile_specs", ())}
    assert "low_memory_mode" not in specs and "method_name" in specs
    out = tmp_path / "out"
    out.mkdir()
    ptdstream.save(manager, str(out / "model.pte"))
    ours = read_folder(str(out))
    assert ours == reference_files(manager, str(tmp_path / "slow"))
    ptds = sorted(n for n in upstream if n.endswith(".ptd"))
    assert ptds and ptds == sorted(n for n in ours if n.endswith(".ptd"))
    for name in ptds:
        assert ours[name] == upstream[name], f"{name} differs from upstream's export"


def test_weights_on_the_host_are_served_from_there_with_upstreams_bytes(tmp_path):
    import dataclasses
    import gc

    from conftest import read_folder, reference_files

    import ptdstream

    model = _model("cpu")
    weights_nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    methods = _METHODS[:2]
    upstream = reference_files(_lower(model, None, methods)[0], str(tmp_path / "upstream"))
    # The CUDA model of the test before holds the same bytes (same seed); hosted comes first
    # even while it is alive: collected or not, it must not serve as a twin.
    twin = _model()
    gc.collect()
    manager, stats, _ = _lower(model, True, methods)
    # No device copy kept and nothing spilled: each storage is the move of a host weight.
    got = dataclasses.asdict(stats)
    assert (stats.hosted_nbytes, stats.twin_nbytes, stats.shared_nbytes, stats.copied_nbytes,
            stats.spilled_nbytes, stats.upstream) == (weights_nbytes, 0, 0, 0, 0, 0), got
    assert stats.routed_nbytes == len(methods) * weights_nbytes, got
    del twin
    out = tmp_path / "out"
    out.mkdir()
    ptdstream.save(manager, str(out / "model.pte"))
    ours = read_folder(str(out))
    ptds = sorted(n for n in upstream if n.endswith(".ptd"))
    assert ptds and all(ours[n] == upstream[n] for n in ptds)
    assert ours == reference_files(manager, str(tmp_path / "slow"))


def test_gpu_fingerprint_scratch_stays_small_and_steps_join():
    from ptdstream.sources.cuda_fingerprint import ROW_NBYTES, STEP_ROWS, _fingerprint, gpu_fingerprint

    step = STEP_ROWS * ROW_NBYTES
    n = 3 * step + 12345  # three whole steps and a tail
    a = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda")
    b = a.clone()
    gpu_fingerprint(a[:10])  # the coefficient block, once per device
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fa = gpu_fingerprint(a)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - base <= 8 << 20  # 4 MiB of products + 2 of level 2 + temporaries
    assert torch.cuda.memory_allocated() == base  # nothing held after: no cuBLAS workspace, no scratch
    assert fa == gpu_fingerprint(b) == _fingerprint(a.cpu())  # the same on the CPU
    b[2 * step + 7] ^= 1  # in the third step
    assert fa != gpu_fingerprint(b)
    odd = torch.zeros(n + 1, dtype=torch.uint8, device="cuda")
    odd[1:] = a
    assert gpu_fingerprint(odd[1:]) == fa  # an odd storage offset
    big = torch.zeros(1 << 30, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    gpu_fingerprint(big)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - base <= 8 << 20  # was 0.33 GiB for 1 GiB, then 21 MiB
    assert torch.cuda.memory_allocated() == base
