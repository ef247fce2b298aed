"""Memory readings: the real ones on this Linux CPU machine, the parsers and GPU probes on samples."""

from __future__ import annotations

import sys
import types

import pytest

from mlxhost.memory import device
from mlxhost.memory.device import parse_meminfo, parse_status_rss, parse_vm_stat, read_memory

MEMINFO = """\
MemTotal:       24684096 kB
MemFree:        20097364 kB
MemAvailable:   22247132 kB
Buffers:            4484 kB
Cached:           331980 kB
Active(anon):      12345 kB
HugePages_Total:       0
Hugepagesize:       2048 kB
"""

STATUS = """\
Name:\tpython
VmPeak:\t  900000 kB
VmRSS:\t  123456 kB
Threads:\t4
"""

# The shape of `vm_stat` on an Apple Silicon Mac (16 KiB pages); numbers made up.
VM_STAT = """\
Mach Virtual Memory Statistics: (page size of 16384 bytes)
Pages free:                               20000.
Pages active:                            300000.
Pages inactive:                          250000.
Pages speculative:                         5000.
Pages throttled:                              0.
Pages wired down:                        120000.
Pages purgeable:                           6000.
"Translation faults":                 123456789.
File-backed pages:                       200000.
Anonymous pages:                         355000.
Pages stored in compressor:              400000.
Pages occupied by compressor:            100000.
Swapins:                                      0.
Swapouts:                                     0.
"""


def test_read_memory_on_this_linux_cpu_machine():
    r = read_memory()
    assert r.total_ram > 0
    assert 0 < r.available_ram <= r.total_ram
    assert 0 < r.process_rss < r.total_ram
    assert r.backend == "cpu" and r.working_set_hint is None and r.device_free is None
    assert r.mlx_active is not None and r.mlx_active >= 0  # mlx 0.32 has mx.get_active_memory
    assert r.available_ram < r.obtainable <= r.available_ram + r.total_ram


def test_parse_meminfo():
    info = parse_meminfo(MEMINFO)
    assert info["MemTotal"] == 24684096 * 1024
    assert info["MemAvailable"] == 22247132 * 1024
    assert info["Active(anon)"] == 12345 * 1024
    assert info["HugePages_Total"] == 0  # a count, not kB
    assert info["Hugepagesize"] == 2048 * 1024


def test_parse_status_rss():
    assert parse_status_rss(STATUS) == 123456 * 1024
    assert parse_status_rss("Name:\tpython\n") is None


def test_parse_vm_stat():
    assert parse_vm_stat(VM_STAT) == (20000 + 250000 + 5000) * 16384
    assert parse_vm_stat(VM_STAT.replace("16384", "4096")) == (20000 + 250000 + 5000) * 4096
    assert parse_vm_stat("vm_stat: command failed") is None
    assert parse_vm_stat(VM_STAT.replace("Pages inactive", "Pages odd")) is None


def test_unreadable_proc_falls_back_without_crashing(monkeypatch):
    monkeypatch.setattr(device, "_read_text", lambda path: None)
    monkeypatch.setattr(device, "_run", lambda args: None)
    r = read_memory()
    assert r.process_rss > 0  # from getrusage's peak, the last resort
    assert r.available_ram == r.total_ram - r.process_rss


def test_missing_mlx_means_cpu(monkeypatch):
    monkeypatch.setitem(sys.modules, "mlx.core", None)  # makes `import mlx.core` raise ImportError
    r = read_memory()
    assert (r.backend, r.working_set_hint, r.mlx_active) == ("cpu", None, None)


# ---------------------------------------------------------------- GPU probes with a fake mlx


def fake_mx(*, metal=False, cuda=False, on_gpu=True, info=None, raises=False):
    def is_available(flag):
        def f():
            if raises:
                raise RuntimeError("no GPU here")
            return flag
        return f

    dtype = types.SimpleNamespace(gpu="gpu", cpu="cpu")
    return types.SimpleNamespace(
        DeviceType=dtype,
        gpu="gpu",
        default_device=lambda: types.SimpleNamespace(type="gpu" if on_gpu else "cpu"),
        metal=types.SimpleNamespace(is_available=is_available(metal)),
        cuda=types.SimpleNamespace(is_available=is_available(cuda)),
        device_info=lambda d=None: dict(info or {}),
    )


def test_probe_metal_reads_working_set_hint():
    mx = fake_mx(metal=True, info={"memory_size": 16 << 30, "max_recommended_working_set_size": 11453251584})
    assert device._gpu_probe(mx) == ("metal", 11453251584, None)


def test_probe_cuda_reads_device_memory():
    mx = fake_mx(cuda=True, info={"total_memory": 80 << 30, "free_memory": 70 << 30})
    assert device._gpu_probe(mx) == ("cuda", 80 << 30, 70 << 30)


@pytest.mark.parametrize("mx", [
    fake_mx(),                                  # plain CPU build
    fake_mx(metal=True, on_gpu=False),          # Mac with the default device set to the CPU
    fake_mx(metal=True, raises=True),           # a backend that throws when asked
])
def test_probe_falls_back_to_cpu(mx):
    assert device._gpu_probe(mx) == ("cpu", None, None)


def test_probe_without_metal_or_cuda_attributes():
    mx = fake_mx()
    del mx.metal, mx.cuda  # older or stripped builds
    assert device._gpu_probe(mx) == ("cpu", None, None)
