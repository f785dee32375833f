"""tools/bench/ncu_decode.py's reading of Nsight Compute's CSV (ncu --import R --csv --page raw --print-units
base): launches grouped by kernel and grid, per-step counts, medians, bytes and bandwidth computed by hand
here. The profiling itself needs a GPU and ncu (tools/checks/gpu_check.sh verify runs it)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools" / "bench"))

import ncu_decode  # noqa: E402

HEAD = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size",'
        '"Device","CC","dram__bytes_read.sum","dram__bytes_write.sum",'
        '"dram__throughput.avg.pct_of_peak_sustained_elapsed","gpu__time_duration.sum"')
UNITS = '"","","","","","","","","","","","byte","byte","%","nsecond"'


def launch(i, name, grid, read, write, pct, ns):
    return f'"{i}","77","python3","h","{name}","1","13","(32, 4, 1)","{grid}","0","9.0","{read}","{write}","{pct}","{ns}"'


def test_summary_of_two_steps():
    rows = []
    for step in range(2):  # per step: the product twice (two matrices), the norm once
        rows.append(launch(3 * step, "matmul_q8x_kernel", "(1024, 1, 1)", "1,000,000", "0", "20", 10000 + 2000 * step))
        rows.append(launch(3 * step + 1, "matmul_q8x_kernel", "(1024, 1, 1)", "1,000,000", "0", "30", 10000 + 4000 * step))
        rows.append(launch(3 * step + 2, "norm_quantize_kernel", "(1, 1, 1)", "200000", "100000", "1.5", 5000))
    text = "==PROF== Connected to process 77\n" + "\n".join([HEAD, UNITS] + rows) + "\n"
    launches = ncu_decode.read_raw_csv(text)
    assert len(launches) == 6 and launches[0]["Kernel Name"] == "matmul_q8x_kernel"
    s = ncu_decode.summarize(launches, steps=2)
    assert s["kernels_per_step"] == 3
    mm, norm = s["kernels"]  # the most time per step first
    assert (mm["kernel"], mm["grid"], mm["per_step"]) == ("matmul_q8x_kernel", "(1024, 1, 1)", 2)
    assert mm["us_each"] == pytest.approx(11.0)  # median of 10, 10, 12, 14 us
    assert mm["bytes_each"] == pytest.approx(1e6)
    assert mm["gb_s"] == pytest.approx(4e6 / 46e-6 / 1e9)
    assert mm["pct_peak"] == pytest.approx((20 * 10 + 30 * 10 + 20 * 12 + 30 * 14) / 46)  # weighted by time
    assert mm["us_per_step"] == pytest.approx(23.0)
    assert (norm["per_step"], norm["bytes_each"], norm["us_each"]) == (1, 3e5, pytest.approx(5.0))
    assert s["us_per_step"] == pytest.approx(28.0)
    assert s["bytes_per_step"] == pytest.approx(2.3e6)
    assert "matmul_q8x_kernel" in ncu_decode.table(s)


def test_output_without_a_csv_header_is_refused():
    with pytest.raises(ValueError, match="no ncu CSV header"):
        ncu_decode.read_raw_csv("==PROF== Disconnected\n==ERROR== no kernels were profiled\n")


def test_a_missing_ncu_is_named():
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "bench" / "ncu_decode.py"), "-m", "x.gguf", "--ncu",
                        "/nonexistent/ncu"], capture_output=True, text=True)
    assert r.returncode != 0 and "no Nsight Compute: /nonexistent/ncu" in r.stderr


def test_the_run_through_a_stand_in_ncu(tmp_path):
    """The parent's side end to end with a stand-in for ncu: how it is called (clocks as set, profiling from
    cuProfilerStart, the child with graphs off), the report read back, the table and the JSON."""
    calls = tmp_path / "calls.txt"
    fake = tmp_path / "ncu"
    rows = [launch(i, "matmul_q8x_kernel", "(64, 1, 1)", "2000000", "0", "40", 20000) for i in range(4)]
    fake.write_text(f"""#!{sys.executable}
import os, sys
with open({str(calls)!r}, "a") as f:
    f.write(repr((sys.argv[1:], os.environ.get("OPTIML_CUDA_GRAPHS"))) + "\\n")
if "--import" in sys.argv:
    print({chr(10).join([HEAD, UNITS] + rows)!r})
else:
    open(sys.argv[sys.argv.index("-o") + 1] + ".ncu-rep", "w").close()
""")
    fake.chmod(0o755)
    out = tmp_path / "ncu.json"
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "bench" / "ncu_decode.py"), "-m", "model.gguf", "--ncu",
                        str(fake), "--steps", "2", "--json", str(out)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    (run, graphs), (read, _) = [eval(line) for line in calls.read_text().splitlines()]
    assert run[:run.index(sys.executable)] == ["--clock-control", "none", "--metrics", ",".join(ncu_decode.METRICS),
                                                "-f", "-o", str(tmp_path / "ncu-decode"), "--profile-from-start", "off"]
    assert run[run.index(sys.executable) + 2:] == ["--child", "-m", "model.gguf", "--steps", "2", "--batch", "1",
                                                   "--warmup", "2"]
    assert graphs == "0"
    assert read[:2] == ["--import", str(tmp_path / "ncu-decode") + ".ncu-rep"] and "raw" in read and "base" in read
    s = json.loads(out.read_text())
    assert s["kernels_per_step"] == 2 and s["kernels"][0]["gb_s"] == pytest.approx(2e6 / 20e-6 / 1e9)
    assert "a step: 2 kernels" in r.stdout
