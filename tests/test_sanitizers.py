"""The native CPU kernels' own tests again, with the kernels built under AddressSanitizer and
UndefinedBehaviorSanitizer (every error fatal): an out-of-bounds read, a use after free or an
undefined shift that happens to give the right numbers still fails here."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from lab.kernels import native

# Edge cases of each kernel, few enough to stay quick under ASan: a length of 1 and of 127
# against blocks of 64, GQA, unequal lengths, bf16, the backward in one pass and in two; the
# GEMV's row tails at one row in the layout this CPU takes and in each layout by name (long
# streams with rows left over; adjacent rows in passes of sixteen, of four, then single ones;
# a short contraction in column strips), int8
# weights at five rows, eleven rows (two register tiles of rows) over blocks of weight rows
# that do not divide the contraction, three rows over runs of weight rows split across parts;
# the C++ decode attention over the int8 cache.
FLASH, GEMV = "tests/test_cpu_flash.py::", "tests/test_cpu_gemv.py::"
KERNEL_TESTS = [
    FLASH + "test_matches_float64_reference[causal-g4-bfloat16-L127-D64]",
    FLASH + "test_matches_float64_reference[full-g1-float32-L1-D128]",
    FLASH + "test_unequal_lengths[False-1-129]",
    FLASH + "test_both_backward_paths_match_the_reference[k80-32x64-float32-fused]",
    FLASH + "test_both_backward_paths_match_the_reference[l200-s330-96x32-bfloat16-two-pass]",
    GEMV + "test_matches_the_float64_reference[float32-int8-5-37-130]",
    GEMV + "test_matches_the_float64_reference[bfloat16-bfloat16-1-300-77]",
    GEMV + "test_matches_the_float64_reference[float32-float32-1-301-77]",
    GEMV + "test_matches_the_float64_reference[float32-int8-1-100-77]",
    GEMV + "test_matches_the_float64_reference[float32-float32-11-75-200]",
    GEMV + "test_matches_the_float64_reference[float32-int8-3-520-90]",
    GEMV + "test_a_transposed_weight_matches_the_float64_reference[int8]",
    GEMV + "test_each_batch_one_layout_matches_the_float64_reference[adjacent-int8-1-1031-48]",
    GEMV + "test_each_batch_one_layout_matches_the_float64_reference[streams-float32-1-1031-48]",
    "tests/test_decode_attention.py::test_int8_cache_matches_reference[float32-cpu]",
]


def _runtime(name: str) -> str | None:
    cxx = native.compiler()
    if cxx is None:
        return None
    found = subprocess.run([cxx, f"-print-file-name={name}"], capture_output=True, text=True)
    path = found.stdout.strip()
    return path if os.path.isabs(path) and os.path.exists(path) else None


@pytest.mark.once
def test_the_kernel_tests_pass_with_asan_and_ubsan(tmp_path):
    asan, cxx_runtime = _runtime("libasan.so"), _runtime("libstdc++.so")
    if asan is None or cxx_runtime is None:
        pytest.skip("no AddressSanitizer runtime beside the C++ compiler")
    env = {
        **os.environ,
        "LAB_KERNEL_SANITIZE": "1",
        "LAB_KERNEL_CACHE": str(tmp_path / "kernels"),
        # ASan's runtime must come first (Python is not built with it), and the C++ runtime
        # with it, or ASan finds no __cxa_throw to intercept when jaxlib loads
        "LD_PRELOAD": f"{asan}:{cxx_runtime}",
        "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=0:exitcode=99",
        "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1:exitcode=98",
        "LAB_FULL": "1",  # the cases named, on either leg
    }
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *KERNEL_TESTS]
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-6000:]
    built = {lib.name: lib.read_bytes() for lib in (tmp_path / "kernels").rglob("*.so")}
    assert sorted(built) == ["libcpu_flash.so", "libcpu_gemv.so"], sorted(built)
    assert all(b"__asan_" in lib for lib in built.values())  # instrumented: the kernels ran so
    for needle in ("AddressSanitizer", "runtime error:", "skipped"):
        assert needle not in out, out[-6000:]
