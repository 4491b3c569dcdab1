"""Forward + backward timings of the Metal kernels on an NVIDIA GPU, against its peers there.

    python gpu_bench.py LIBRARY CUBIN OUT.json     (run_on_gpu.sh builds LIBRARY and CUBIN)

For each shape N x C and logits dtype (float32, bfloat16), sparse int64 labels, one training step
(the loss and d loss / d logits), each timed by `triton.testing.do_bench` (median, L2 flushed
before every repetition):
* ours, three ways, each planned and bound by gpu::PlanLaunch as the macOS encoder does
  (libtfmo_cuda: cuda_driver.cc), without and with label smoothing 0.1:
  - ours (old): the forward kernel, then the gradient kernel without row statistics, which finds
    each row's log-sum-exp again (what the Metal kernels did before row_stats);
  - ours_stats (per-example losses, custom_loss): the forward writes row_stats, the gradient
    reads them and skips its log-sum-exp pass;
  - ours_reduced (reduced_custom_loss, Keras's CustomLoss): the forward alone, given
    row_scales = 1/N, writes the mean's gradient beside the loss; no gradient kernel;
* torch: `torch.nn.functional.cross_entropy` + `backward()`, without and with smoothing;
* liger: Liger-Kernel's Triton cross-entropy (`LigerCrossEntropyFunction`), which writes the
  gradient over its input during the forward pass;
* floor: the fewest bytes a step must move (read the logits and labels once, write the gradient
  and the loss once) at the device-to-device copy bandwidth measured here (bytes read + written).
Before timing, each of ours is compared with torch's float64 result on the same inputs.
Also, the rowtg threadgroup size the H200 prefers: ours_stats again with the pipeline limit
(maxTotalThreadsPerThreadgroup) lowered, which is how PlanLaunch is asked for smaller groups.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "msl_host"))
import msl_build as mb  # noqa: E402  (the case and result structs, shared with the emulator)

SHAPES = [(4096, 1000), (65536, 1000), (512, 32000), (8192, 128256), (65536, 10)]
DTYPES = {"float32": (torch.float32, 0), "bfloat16": (torch.bfloat16, 2)}
SMOOTHING = 0.1
SWEEP_LIMITS = (64, 128, 256, 512, 1024)
# (label smoothing, Ours.step mode, result key) of every step of ours that is timed.
OURS_METHODS = [(0.0, "old", "ours"), (0.0, "stats", "ours_stats"),
                (0.0, "reduced", "ours_reduced"), (SMOOTHING, "old", "ours_smooth"),
                (SMOOTHING, "stats", "ours_smooth_stats"),
                (SMOOTHING, "reduced", "ours_smooth_reduced")]
# QUICK=1 (a probe between full runs): three shapes, ours old and reduced and Liger, no torch and
# no threadgroup-size sweep.
QUICK = os.environ.get("QUICK", "0") == "1"
if QUICK:
    SHAPES = [(65536, 1000), (512, 32000), (8192, 128256)]
    OURS_METHODS = [m for m in OURS_METHODS if m[1] != "stats"]


def bench(fn) -> float:
    """Median milliseconds of fn, L2 flushed before each repetition."""
    return float(triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median"))


FLUSH = None


def _profiled_kernels(fn, iters: int) -> dict:
    """Total microseconds per CUDA kernel name over `iters` calls of fn, each after an L2 flush."""
    global FLUSH
    if FLUSH is None:
        FLUSH = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            FLUSH.zero_()
            fn()
        torch.cuda.synchronize()
    totals: dict = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            totals[e.name] = totals.get(e.name, 0.0) + e.time_range.elapsed_us()
    return totals


FLUSH_KERNELS = None


def kernel_time(fn, iters: int = 20) -> dict:
    """Device time of fn without the launch gaps: the mean per call of the summed durations of
    its kernels (L2 flushed before each call; the flush's own kernels left out), in ms, total and
    per kernel. Wall-clock medians (`bench`) include the host's launch overhead as well."""
    global FLUSH_KERNELS
    try:
        if FLUSH_KERNELS is None:
            FLUSH_KERNELS = set(_profiled_kernels(lambda: None, 2))
        totals = {k: v / iters / 1e3 for k, v in _profiled_kernels(fn, iters).items()
                  if k not in FLUSH_KERNELS}
    except Exception as e:  # noqa: BLE001 - the wall-clock figures stand without it
        return dict(total_ms=None, kernels={}, error=f"{type(e).__name__}: {e}"[:300])
    return dict(total_ms=sum(totals.values()), kernels=totals)


class Ours:
    def __init__(self, library: str, cubin: str):
        self.lib = ctypes.CDLL(library)
        self.lib.tfmo_cuda_load.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_uint32]
        self.lib.tfmo_cuda_run.argtypes = [ctypes.POINTER(mb.EmuCase), ctypes.POINTER(mb.EmuResult),
                                           ctypes.c_void_p, ctypes.c_int32]
        torch.zeros(1, device="cuda")  # PyTorch's primary context, current on this thread
        error = ctypes.create_string_buffer(1024)
        n = self.lib.tfmo_cuda_load(cubin.encode(), error, 1024)
        if n <= 0:
            raise RuntimeError(f"tfmo_cuda_load: {error.value.decode()}")
        self.record = torch.empty(8, dtype=torch.int32, device="cuda")

    def step(self, x, y, upstream, loss, grad, *, smoothing=0.0, max_threads=1024, variant=-1,
             mode="stats"):
        """A callable doing one training step's launches (mode "old": forward + gradient
        without row stats; "stats": forward writing row_stats + gradient reading them;
        "reduced": the forward alone, writing the gradient of the mean into `grad`); and the
        launches' plans (the one that writes the gradient last)."""
        n, c = x.shape
        dtype = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}[x.dtype]
        stats = torch.empty(n, 3, device="cuda", dtype=torch.float32)
        scales = torch.full((n,), 1.0 / n, device="cuda", dtype=torch.float32)
        common = dict(num_rows=n, num_classes=c, dtype=dtype, label_kind=1, variant=variant,
                      gamma=0.0, label_smoothing=smoothing, has_class_weights=0,
                      has_ignore_class=1, ignore_class=-100,
                      max_total_threads_per_threadgroup=max_threads, thread_execution_width=32,
                      executor=0, plan_only=0, max_concurrent_threadgroups=0, reserved=0,
                      logits=x.data_ptr(), labels=y.data_ptr(), class_weights=None,
                      error_record=self.record.data_ptr(), row_stats=stats.data_ptr())
        with_stats = int(mode != "old")
        if mode == "reduced":
            cases = [mb.EmuCase(direction=0, upstream=None, output=loss.data_ptr(),
                                has_row_stats=1, has_row_scales=1,
                                row_scales=scales.data_ptr(), scaled_gradient=grad.data_ptr(),
                                **common)]
        else:
            cases = [mb.EmuCase(direction=0, upstream=None, output=loss.data_ptr(),
                                has_row_stats=with_stats, **common),
                     mb.EmuCase(direction=1, upstream=upstream.data_ptr(),
                                output=grad.data_ptr(), has_row_stats=with_stats, **common)]
        results = [mb.EmuResult() for _ in cases]
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        run = self.lib.tfmo_cuda_run
        for case, result in zip(cases, results):
            if not run(ctypes.byref(case), ctypes.byref(result), stream, 1):
                raise RuntimeError(result.error.decode())
        torch.cuda.synchronize()
        launches = [(ctypes.byref(case), ctypes.byref(result))
                    for case, result in zip(cases, results)]

        def fn():
            for case_ref, result_ref in launches:
                run(case_ref, result_ref, stream, 0)

        fn.keep_alive = (stats, scales, cases, results)  # what the launches point at
        plans = [dict(kernel=r.kernel_name.decode(), grid=list(r.threadgroups_per_grid),
                      threads=r.threads_per_threadgroup[0], threads_per_row=r.threads_per_row,
                      rows_per_threadgroup=r.rows_per_threadgroup,
                      threadgroup_memory=r.threadgroup_memory_length) for r in results]
        return fn, [plans[0], plans[-1]]


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second (4 GiB each way)."""
    src = torch.randn(1 << 30, device="cuda")
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src))
    del src, dst
    torch.cuda.empty_cache()
    return 2 * (1 << 30) * 4 / (ms * 1e-3)


def liger_function():
    try:
        from liger_kernel.ops.cross_entropy import LigerCrossEntropyFunction
        return LigerCrossEntropyFunction, None
    except Exception as e:  # noqa: BLE001 - reported in the results, the rest still runs
        return None, f"{type(e).__name__}: {e}"


def _inputs(n: int, c: int, dtype):
    """The same inputs in both passes: a generator seeded by the configuration."""
    gen = torch.Generator(device="cuda").manual_seed(n * 1000003 + c * 7 + dtype.itemsize)
    x = (torch.randn(n, c, device="cuda", generator=gen) * 2).to(dtype)
    y = torch.randint(0, c, (n,), device="cuda", generator=gen)
    up = torch.full((n,), 1.0 / n, device="cuda", dtype=dtype)  # d mean / d loss_i
    return x, y, up, torch.empty(n, device="cuda", dtype=dtype), torch.empty_like(x)


def _one_configuration(ours, liger, row: dict, sweep: list, x, y, up, loss, grad,
                       profiled: bool) -> None:
    """Wall-clock medians (profiled False) or device times (True) of every method, into row."""
    measure = kernel_time if profiled else bench
    suffix = "_kernel" if profiled else "_ms"
    n, c = x.shape
    for eps, mode, key in OURS_METHODS:
        fn, plans = ours.step(x, y, up, loss, grad, smoothing=eps, mode=mode)
        if not profiled:  # correctness on these inputs first: ours vs float64 torch
            loss.fill_(float("nan"))  # so that a launch that wrote nothing cannot pass
            grad.fill_(float("nan"))
            fn()
            torch.cuda.synchronize()
            x64 = x.double().requires_grad_(True)
            ref_loss = F.cross_entropy(x64, y, reduction="none", label_smoothing=eps)
            (ref_grad,) = torch.autograd.grad(ref_loss.mean(), x64)
            ref_loss = ref_loss.detach()
            row[key + "_loss_max_rel_err"] = float(
                ((loss.double() - ref_loss).abs() / ref_loss.abs().clamp_min(1e-30)).max())
            row[key + "_grad_max_err_rel_to_max"] = float(
                (grad.double() - ref_grad).abs().max() / ref_grad.abs().max())
            row[key + "_plan"] = plans
            del x64, ref_loss, ref_grad
        row[key + suffix] = measure(fn)
    xt = x.clone().requires_grad_(True)
    for eps, key in (() if QUICK else ((0.0, "torch"), (SMOOTHING, "torch_smooth"))):
        def torch_step(eps=eps):
            xt.grad = None
            F.cross_entropy(xt, y, label_smoothing=eps).backward()
        row[key + suffix] = measure(torch_step)
    del xt
    if liger is not None:
        xl = x.clone().requires_grad_(True)
        for eps, key in ((0.0, "liger"), (SMOOTHING, "liger_smooth")):
            def liger_step(eps=eps):
                xl.grad = None
                out = liger.apply(xl, y, None, -100, 0.0, eps, "mean")
                out[0].backward()
            try:
                row[key + suffix] = measure(liger_step)
            except Exception as e:  # noqa: BLE001 - reported, the other methods still run
                row[key + "_error"] = f"{type(e).__name__}: {e}"[:300]
        del xl
    # The threadgroup size (PlanLaunch under a lowered pipeline limit; the other variant forced),
    # for the stats step and the reduced one (its forward has the gradient kernel's geometry).
    if x.dtype == torch.float32 and not QUICK:
        settings = [(m, -1) for m in SWEEP_LIMITS] + [(1024, int(c > 256))]
        seen = []
        for limit, variant in settings:
            fn, plans = ours.step(x, y, up, loss, grad, max_threads=limit, variant=variant)
            if plans in seen:
                continue
            seen.append(plans)
            reduced, _ = ours.step(x, y, up, loss, grad, max_threads=limit, variant=variant,
                                   mode="reduced")
            if profiled:
                entry = next(e for e in sweep
                             if e["n"] == n and e["c"] == c and e["plan"] == plans[1])
                entry["kernel_ms"] = kernel_time(fn)["total_ms"]
                entry["reduced_kernel_ms"] = kernel_time(reduced)["total_ms"]
            else:
                sweep.append(dict(n=n, c=c, dtype="float32", max_threads=limit, plan=plans[1],
                                  ms=bench(fn), reduced_ms=bench(reduced)))


def run(library: str, cubin: str, out_path: Path) -> None:
    ours = Ours(library, cubin)
    liger, liger_error = liger_function()
    bandwidth = copy_bandwidth()
    results = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                   triton=triton.__version__, copy_bandwidth_bytes_per_s=bandwidth,
                   liger_error=liger_error, rows=[], sweep=[])
    if liger is not None:
        import importlib.metadata  # noqa: PLC0415
        results["liger"] = importlib.metadata.version("liger-kernel")
    # Two passes: every wall-clock median first, then the profiler (once the profiler has run,
    # PyTorch's launches carry its callbacks, which would slow the later wall-clock figures).
    for profiled in (False, True):
        index = 0
        for (n, c) in SHAPES:
            for dtype_name, (dtype, _) in DTYPES.items():
                t0 = time.time()
                x, y, up, loss, grad = _inputs(n, c, dtype)
                if profiled:
                    row = results["rows"][index]
                else:
                    es = dtype.itemsize
                    floor_bytes = 2 * n * c * es + n * 8 + n * es
                    row = dict(n=n, c=c, dtype=dtype_name, floor_bytes=floor_bytes,
                               floor_ms=floor_bytes / bandwidth * 1e3)
                    results["rows"].append(row)
                index += 1
                _one_configuration(ours, liger, row, results["sweep"], x, y, up, loss, grad,
                                   profiled)
                del x, y, up, loss, grad
                torch.cuda.empty_cache()
                row[("profile" if profiled else "wall") + "_seconds"] = time.time() - t0
                print(json.dumps({k: (v["total_ms"] if k.endswith("_kernel") else v)
                                  for k, v in row.items() if not k.endswith("_plan")}),
                      flush=True)
        out_path.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    if len(sys.argv) != 4:
        print(__doc__)
        sys.exit(2)
    run(sys.argv[1], sys.argv[2], Path(sys.argv[3]))
