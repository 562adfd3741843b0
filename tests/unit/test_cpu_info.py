"""startup/cpu_info: the processor's description read from /proc/cpuinfo, and the runpod SDK
imported without py-cpuinfo's probe process once it is installed."""

import subprocess
import sys

from conftest import REPO

from worker.startup.cpu_info import cpu_info

TWO_PROCESSORS = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 17
model name\t: AMD EPYC 9654 96-Core Processor
stepping\t: 1

processor\t: 1
model name\t: another
"""


def test_the_first_processors_fields_are_read_with_py_cpuinfos_names(tmp_path):
    path = tmp_path / "cpuinfo"
    path.write_text(TWO_PROCESSORS)
    info = cpu_info(path)
    assert info["brand_raw"] == "AMD EPYC 9654 96-Core Processor"
    assert (info["family"], info["model"], info["stepping"]) == (25, 17, 1)
    assert isinstance(info["count"], int) and info["count"] >= 1


def test_without_the_file_the_count_is_all(tmp_path):
    assert set(cpu_info(tmp_path / "absent")) == {"count"}


def test_installed_the_sdk_is_imported_without_starting_a_process():
    code = ("from worker.startup import cpu_info; cpu_info.install()\n"
            "import subprocess\n"
            "def refused(*args, **kwargs): raise AssertionError(f'a process was started: {args}')\n"
            "subprocess.Popen.__init__ = refused\n"
            "import runpod\n"
            "from runpod.serverless.utils import rp_debugger\n"
            "assert rp_debugger.PROCESSOR == cpu_info.cpu_info().get('brand_raw', ''), rp_debugger.PROCESSOR\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(REPO / "src"), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
