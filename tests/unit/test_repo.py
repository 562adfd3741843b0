"""The README's promises that code can check: set-up commands, CI entry point, defaults."""

import re
import subprocess
import sys

from conftest import REPO

from engine_args import WORKER_DEFAULTS
from settings import WorkerSettings

README = (REPO / "README.md").read_text()


def test_ci_runs_the_readme_test_command():
    assert "scripts/test.sh" in README and "scripts/serve.sh" in README
    assert "scripts/test.sh" in (REPO / ".ci" / "run").read_text()


def test_readme_worker_setting_defaults_match_the_code():
    rows = dict(re.findall(r"^\| `([A-Z_]+)`[^|]*\| `([^`]*)` \|", README, re.MULTILINE))
    for field in WorkerSettings.model_fields.values():
        env_name = field.validation_alias.choices[0]
        if field.default is not None:
            assert env_name in rows, env_name
            assert rows[env_name] == str(field.default).lower().removesuffix(".0"), env_name


def test_readme_worker_defaults_match_the_code():
    for dest, value in WORKER_DEFAULTS.items():
        assert f"{dest}={value}" in README


def test_only_the_adapter_imports_vllm():
    importers = {path.name for path in (REPO / "src").glob("*.py")
                 if re.search(r"^\s*(from|import) (vllm|torch)\b", path.read_text(), re.MULTILINE)}
    assert importers == {"vllm_adapter.py"}


def test_the_worker_error_and_input_modules_import_without_vllm():
    """errors (and what raises its errors on a job's input) stay plain: no vLLM, no torch."""
    code = ("import sys; import errors, error_types, job_input, sse, batching; "
            "print(sorted(m for m in ('vllm', 'torch') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO / "src", capture_output=True, text=True,
                            check=True)
    assert result.stdout.strip() == "[]", result.stderr


def test_the_readme_layout_names_every_source_file_and_no_other():
    layout = README[README.index("Layout ("):README.index("The tests run vLLM's CPU build")]
    named = set(re.findall(r"`src/(\w+\.py)`", layout))
    assert named == {path.name for path in (REPO / "src").glob("*.py")}
