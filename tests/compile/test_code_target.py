"""What a .pt2's native code is compiled for, and who may run it (no compile: the probes only)."""

from __future__ import annotations

import pytest

from gkbuild.compile import inductor


@pytest.fixture
def host(monkeypatch):
    """Set this host's machine and CPU features as inductor's probes see them."""
    def set_host(machine: str, features: set[str]):
        monkeypatch.setattr(inductor.platform, "machine", lambda: machine)
        monkeypatch.setattr(inductor, "cpu_features", lambda: set(features))
    return set_host


V3 = set(inductor.X86_64_V3) | {"sse4_2"}


def test_x86_64_programs_are_pinned_to_x86_64_v3_whatever_the_host_has(host):
    host("x86_64", V3 | {"avx512f", "avx512bw", "avx512vl", "amx_tile"})
    wide = inductor.flags("cpu", [1, 4])
    host("x86_64", V3)
    assert inductor.flags("cpu", [1, 4]) == wide  # one compile key on an AVX-512 farm and an AVX2 build host
    assert wide[-3:] == ["--machine=x86_64", "--march=x86-64-v3", "--simdlen=256"]
    assert inductor._pinned() == {"cpp.march": "x86-64-v3", "cpp.simdlen": 256}
    assert inductor.available("cpu") is None


def test_an_x86_64_host_without_avx2_neither_compiles_nor_loads_them(host):
    host("x86_64", V3 - {"avx2", "fma"})
    assert inductor.available("cpu") == ("this host could not run what it compiles: compiled for x86-64-v3 "
                                         "(AVX2, FMA, BMI2), and this CPU lacks avx2, fma")
    assert "lacks avx2" in inductor.cannot_run({"machine": "x86_64", "march": "x86-64-v3"})


def test_elsewhere_the_host_s_cpu_features_are_in_the_key(host):
    host("aarch64", {"fp", "asimd", "sve", "bf16"})
    sve = inductor.flags("cpu", [1])
    assert "--march=native" in sve and any(f.startswith("--cpu=") for f in sve) and inductor._pinned() == {}
    t = inductor.target_of(sve)
    assert inductor.cannot_run(t) is None
    host("aarch64", {"fp", "asimd"})
    assert inductor.flags("cpu", [1]) != sve  # a NEON-only host never gets the SVE host's program
    assert inductor.cannot_run(t) == "compiled with -march=native on a CPU with other features"
    host("x86_64", V3)
    assert inductor.cannot_run(t) == "compiled for 'aarch64', and this host is x86_64"


def test_recorded_flags_are_data(host):
    host("x86_64", V3)
    assert inductor.target_of(["--device=cpu", 7, None, "--machine=x86_64", "--march=x86-64-v3", "--x=1"]) == \
        {"machine": "x86_64", "march": "x86-64-v3"}
    assert inductor.cannot_run(inductor.target_of(["--device=cpu"])) is None  # built before flags named it
    assert "'" + "m" * 20 in inductor.cannot_run({"machine": "m" * 10_000}) and \
        len(inductor.cannot_run({"machine": "m" * 10_000})) < 200


def test_the_portable_targets_isa_warning_is_quiet_at_load_and_any_other_stays_loud(host, caplog):
    """torch warns at each load that the package's AOTI_CPU_ISA (AVX2) is not this CPU's widest:
    for a portable program that is by design; another key, another value or another target is loud."""
    import logging

    host("x86_64", V3 | {"avx512f"})
    log = logging.getLogger(inductor.LOAD_LOGGER)
    msg = "Device information mismatch for %s: %s vs %s. This could cause some issues when loading the AOTInductor compiled artifacts."
    portable = {"machine": "x86_64", "march": "x86-64-v3"}
    cases = [(portable, ("AOTI_CPU_ISA", "AVX512", "AVX2"), False), (portable, ("AOTI_CPU_ISA", "AVX512", "AVX512"), True),
             (portable, ("AOTI_DEVICE_KEY", "cpu", "cuda"), True),
             ({"machine": "x86_64", "march": "native", "cpu": "x"}, ("AOTI_CPU_ISA", "AVX512", "AVX2"), True)]
    for target, args, loud in cases:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger=inductor.LOAD_LOGGER), inductor.quiet_portable_load(target):
            log.warning(msg, *args)
        assert bool(caplog.records) == loud, (target, args)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=inductor.LOAD_LOGGER):
        log.warning(msg, "AOTI_CPU_ISA", "AVX512", "AVX2")  # outside a load it is not filtered
    assert caplog.records
